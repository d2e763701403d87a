"""The retuning controller (``slotune control``): watch live traffic, detect, retune in the simulator, canary the
candidate on the engine under a lease, keep it or roll it back, and log every decision."""
