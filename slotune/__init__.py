"""slotune: the distribution's command-line entry point; the work lives in engine/, loadtest/, tuner/, ..."""
