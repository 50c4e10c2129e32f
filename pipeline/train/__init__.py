"""Training stage: communication layer, algorithms, models, the worker, its drivers and the launchers."""
