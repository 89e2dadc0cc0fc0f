"""Named compression presets: one table, read by ``CompressionConfig.preset(name)`` and by the
eval command's ``--method preset:NAME``.

The table maps a name to a compact spec (see :mod:`rqlib.hf.config`). It is filled by the
presets/ablation work (issue 5); every preset must be data-free: anything fitted is fitted on
the calibration corpus (``pydoc``), never on the evaluation text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rqlib.hf.config import CompressionConfig

__all__ = ["PRESETS", "get_preset"]

# name -> compact spec. Empty until the presets are measured (issue 5).
PRESETS: dict[str, str] = {}


def get_preset(name: str) -> CompressionConfig:
    """The config of preset ``name``; ``ValueError`` listing the known names otherwise."""
    from rqlib.hf.config import CompressionConfig

    if name not in PRESETS:
        known = ", ".join(sorted(PRESETS)) or "none defined yet"
        raise ValueError(f"unknown preset {name!r}; known presets: {known}")
    spec = PRESETS[name]
    if spec.startswith("preset:"):
        raise ValueError(f"preset {name!r} must be a method spec, not another preset")
    return CompressionConfig.parse(spec).replace(name=f"preset:{name}")
