"""Training stage: communication layer, algorithms, models, the per-worker loop and launchers."""
