"""Where rqlib reads and writes: the checkout it runs from and the user cache.

- :data:`PACKAGE_ROOT` is the ``rqlib`` folder; :data:`CHECKOUT` the folder above it, which is
  the repository when rqlib is installed editable (``pip install -e .``).
- :func:`cache_dir` is where derived files live (converted models, codebooks, sensitivity
  tables): ``$RQLIB_CACHE``, default ``~/.cache/rqlib``.

Every path taken from the environment goes through :func:`env_path`, so ``~`` and ``$VARS``
are expanded the same way everywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CHECKOUT", "PACKAGE_ROOT", "cache_dir", "env_path", "repo_root"]

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CHECKOUT = PACKAGE_ROOT.parent
CACHE_ENV = "RQLIB_CACHE"


def env_path(name: str) -> Path | None:
    """The path in environment variable ``name`` with ``~`` and ``$VARS`` expanded, or None."""
    value = os.environ.get(name)
    if not value:
        return None
    return Path(os.path.expandvars(value)).expanduser()


def cache_dir() -> Path:
    """Where derived files live: ``$RQLIB_CACHE``, default ``~/.cache/rqlib``."""
    return env_path(CACHE_ENV) or Path.home() / ".cache" / "rqlib"


def repo_root() -> Path:
    """The checkout this (editable) rqlib lives in: the folder holding ``pyproject.toml``."""
    if not (CHECKOUT / "pyproject.toml").is_file():
        raise FileNotFoundError(
            f"rqlib is not running from a checkout ({CHECKOUT} has no pyproject.toml)"
        )
    return CHECKOUT
