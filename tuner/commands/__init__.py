"""The tuner's command lines (tune, sweep, simulate, calibrate) and what only they use; no library module imports them."""
