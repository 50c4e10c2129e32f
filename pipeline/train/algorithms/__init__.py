"""Training algorithms: each a small class wrapping any torch optimizer (see base.Algorithm)."""
from .base import Algorithm  # noqa: F401
