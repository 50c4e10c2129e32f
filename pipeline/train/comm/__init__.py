"""Communication layer: one interface (base.Communicator), several backends."""
from .base import Communicator, CommStats, Group  # noqa: F401
