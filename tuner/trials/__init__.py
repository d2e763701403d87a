"""Trials: the one protocol real and simulated trials implement, a trial on a live engine over its HTTP API, early stopping, where the load generator runs."""
