"""Optional dependencies: which choice needs which package, and the one line naming what to install.

Petastorm (``loader.engine: petastorm``) and Horovod (``launcher: horovod``) are installed in the
design-card environment only (``make setup``: requirements.txt, Horovod built from source by
scripts/build_horovod.sh); the current environment (``make test-current``) has neither. Nothing
imports them unless the chosen engine or launcher needs them; :func:`require` checks that they are
installed without importing them.
"""
from __future__ import annotations

import importlib.util

from .errors import ConfigError

#: extra -> (module, the config choice that needs it, how to install it)
EXTRAS = {
    "petastorm": ("petastorm", "loader.engine='petastorm'",
                  "pip install 'hep-pipeline[petastorm]' (Petastorm 0.12.1, with pyarrow 14 and numpy < 2: "
                  "the design-card environment, make setup)"),
    "horovod": ("horovod", "launcher='horovod'",
                "build Horovod 0.28.1 from source with `bash scripts/build_horovod.sh <python>` (the design-card "
                "environment, make setup), or choose launcher=torch or launcher=local"),
}


def installed(extra: str) -> bool:
    """Whether the module of ``extra`` can be imported (without importing it)."""
    return importlib.util.find_spec(EXTRAS[extra][0]) is not None


def require(extra: str) -> None:
    """ConfigError (one line: the choice, the missing package, what to install) when ``extra`` is missing."""
    module, choice, how = EXTRAS[extra]
    if not installed(extra):
        raise ConfigError(f"invalid config value {choice}: {module} is not installed; {how}")
