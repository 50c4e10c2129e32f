"""Training stage: communication layer, algorithms, models, the worker, its schedules and the launchers."""
