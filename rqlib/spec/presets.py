"""Named compression presets: what each one is, and the targets it is held to.

The table maps a name to a compact spec (see :mod:`rqlib.spec.config`, where
``CompressionConfig.parse("preset:NAME")`` and :func:`rqlib.spec.config.get_preset` read it).
The number in a name is a budget: the average stored bits per key and value coordinate,
counted by :func:`rqlib.spec.bits.average_bits` at a context of 4096 tokens (codes, norms,
exact sink tokens, the recent band, calibrated means), is at most that number.

Every preset is TurboQuant-MSE (dense rotation, Lloyd-Max codes) for keys and values with the
first token exact, the most recent tokens stored as 8-bit codes (``win64:wb=8``; ``rq-2``
keeps 32, ``win32``, to leave more of its two bits to the codes) and stored once (``once``: a
token gets its main codes only when it leaves the band, so no bits pay for a second copy),
per-head key centering, norm correction and 11-bit norms (``nm=6``); what differs is the
budget (spec token ``alloc=``): the bits of each layer's keys and values are chosen for the
model at hand by :mod:`rqlib.study.allocation`, from a table of sensitivities measured with
the preset's own recent window, so that the average bits are at most the budget. A preset is
therefore resolved against a model before use (``rqlib.study.allocation.resolve``).

Every preset is data-free: the key means used for centering are fitted on the ``pydoc``
calibration corpus and the sensitivities are measured on later ``pydoc`` tokens, never on the
evaluation text. What a preset costs on a model is measured, not stated here: the results live
in ``results/presets-*.json`` (written by ``python -m rqlib experiment``) and chapter 4 of the
book reads them (:func:`rqlib.book.loaders.preset_evidence` quotes them at run time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DESCRIPTIONS",
    "HANDMADE",
    "PEER_TARGETS",
    "PRESETS",
    "PeerTarget",
    "PresetTarget",
    "TARGETS",
    "budget_of",
]


@dataclass(frozen=True)
class PresetTarget:
    """What a preset is held to on SmolLM2: its budget, the change of perplexity in % and the
    mean KL to full precision (``None``: reported, not gated)."""

    max_bits: float
    max_delta_ppl_pct: float
    max_kl: float | None


#: name -> compact spec.
PRESETS: dict[str, str] = {
    "rq-3.5": "turboquant-mse:b3:sink1:win64:wb=8:ctr:nc:nm=6:alloc=3.5:once",
    "rq-3": "turboquant-mse:b3:sink1:win64:wb=8:ctr:nc:nm=6:alloc=3:once",
    "rq-2.5": "turboquant-mse:b3:sink1:win64:wb=8:ctr:nc:nm=6:alloc=2.5:once",
    "rq-2": "turboquant-mse:b3:sink1:win32:wb=8:ctr:nc:nm=6:alloc=2:once",
}


def _recent_window(spec: str) -> int:
    """The length of the recent window in a preset's spec (its ``win<N>`` token)."""
    (match,) = re.findall(r"(?:^|:)win(\d+)(?::|$)", spec)
    return int(match)


#: name -> what the preset is (no measured numbers: those are read from results files).
DESCRIPTIONS: dict[str, str] = {
    name: (
        f"TurboQuant-MSE keys and values with per-layer bits allocated from measured "
        f"sensitivity within {name.removeprefix('rq-')} bits per coordinate; first token exact, "
        f"{_recent_window(spec)} most recent tokens as 8-bit codes only (main codes written "
        "when a token leaves them), per-head key centering, norm correction, 11-bit norms"
    )
    for name, spec in PRESETS.items()
}

#: Hand-chosen per-layer bits (extra bits for the first layers, a 32-token exact band) at the
#: same budgets: the baselines the allocated presets are compared with at equal bits.
HANDMADE: dict[str, str] = {
    "rq-3.5": "turboquant-mse:b3:k0-3=4:v0-2=4:sink1:win32:ctr:nc",
    "rq-3": "turboquant-mse:k3:v2:k0-2=4:v0-3=3:sink1:win32:ctr:nc",
    "rq-2.5": "turboquant-mse:b2:k0-3=3:v0-2=3:sink1:win32:ctr:nc",
    "rq-2": "turboquant-mse:k2:v1:k0-2=3:v0-3=2:sink1:win32:ctr:nc",
}

TARGETS: dict[str, PresetTarget] = {
    "rq-3.5": PresetTarget(3.5, 1.0, 0.01),
    "rq-3": PresetTarget(3.0, 1.5, 0.03),
    "rq-2.5": PresetTarget(2.5, 10.0, None),
    "rq-2": PresetTarget(2.0, 10.0, None),
}


@dataclass(frozen=True)
class PeerTarget:
    """What a preset is held to against a cache users would pick instead, on held-out text
    in decode mode: fewer stored bits than ``peer`` (a method label of ``rqlib eval``) and a mean
    KL at most ``max_kl_ratio`` times the peer's."""

    peer: str
    max_kl_ratio: float


PEER_TARGETS: dict[str, PeerTarget] = {
    "rq-3.5": PeerTarget("hf-quanto:int4", 1 / 2),
    "rq-3": PeerTarget("hf-quanto:int4", 1.0),
    "rq-2.5": PeerTarget("hf-quanto:int2", 1 / 3),
    "rq-2": PeerTarget("hf-quanto:int2", 1 / 10),
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
