"""Named compression presets: one table, read by ``CompressionConfig.preset(name)`` and by the
eval command's ``--method preset:NAME``.

The table maps a name to a compact spec (see :mod:`rqlib.hf.config`). The number in a name is
a budget: the average stored bits per key and value coordinate, counted by
:func:`rqlib.eval.average_bits` at a context of 4096 tokens (codes, fp16 norms, exact sink and
recent tokens, calibrated means), is at most that number. At head_dim 64 the fp16 norm alone
costs 0.25 bits per coordinate and the exact first token plus a 32-token recent band another
33 * 16 / 4096 = 0.129, so a "3.5-bit" cache has about 3.1 bits of codes per coordinate.

Every preset is data-free: the key means used for centering are fitted on the ``pydoc``
calibration corpus (2048 tokens, see :mod:`rqlib.hf.calibration`), never on the evaluation
text; nothing else is fitted. The evidence for each preset (and for each of its ingredients,
one removed at a time) is in ``results/presets-*.json`` and ``results/ablation-*.json``,
produced by :mod:`rqlib.experiments`; the docstrings below quote those files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rqlib.hf.config import CompressionConfig

__all__ = ["PRESETS", "PRESET_NOTES", "PresetTarget", "TARGETS", "budget_of", "get_preset"]


@dataclass(frozen=True)
class PresetTarget:
    """The targets a preset is held to on SmolLM2 (issue 5): budget, ΔPPL % and mean KL."""

    max_bits: float
    max_delta_ppl_pct: float
    max_kl: float | None  # None: reported, not gated


# name -> compact spec.
PRESETS: dict[str, str] = {
    "rq-3.5": "turboquant-mse:b3:k0-3=4:v0-2=4:sink1:win32:ctr:nc",
    "rq-3": "turboquant-mse:k3:v2:k0-2=4:v0-3=3:sink1:win32:ctr:nc",
    "rq-2.5": "turboquant-mse:b2:k0-3=3:v0-2=3:sink1:win32:ctr:nc",
}

# name -> what the preset is and the measured evidence (filled from the result files).
PRESET_NOTES: dict[str, str] = {
    "rq-3.5": (
        "3-bit TurboQuant (dense rotation, Lloyd-Max codes) for keys and values, one more bit "
        "for the keys of layers 0-3 and the values of layers 0-2; per-head key centering "
        "calibrated on pydoc; first token and a 32-token recent band exact; norm correction."
    ),
    "rq-3": (
        "Keys at 3 bits (4 in layers 0-2), values at 2 bits (3 in layers 0-3); the same "
        "centering, sink, recent band and norm correction as rq-3.5."
    ),
    "rq-2.5": (
        "2-bit keys and values, one more bit for the keys of layers 0-3 and the values of "
        "layers 0-2; centering, sink, recent band and norm correction as rq-3.5."
    ),
}

TARGETS: dict[str, PresetTarget] = {
    "rq-3.5": PresetTarget(3.5, 1.0, 0.01),
    "rq-3": PresetTarget(3.0, 3.0, 0.03),
    "rq-2.5": PresetTarget(2.5, 10.0, None),
}


def budget_of(name: str) -> float:
    """The bit budget in a preset's name (``"rq-3.5"`` -> 3.5); ``ValueError`` otherwise."""
    prefix = "rq-"
    try:
        if not name.startswith(prefix):
            raise ValueError
        return float(name[len(prefix) :])
    except ValueError:
        raise ValueError(f"preset name {name!r} does not have the form rq-<bits>") from None


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
