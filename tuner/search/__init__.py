"""The search: the Optuna study, its samplers and structured start, the objective and constraints, screening on the simulator, search methods compared."""
