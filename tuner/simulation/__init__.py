"""The simulator: the engine's own scheduler and KV-cache bookkeeping on a virtual clock, its step-time model, simulated trials."""
