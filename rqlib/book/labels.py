"""Is a committed run what its label says today?

A results file records, for every run, the label it was asked for (``preset:rq-3:once``, or an
explicit spec) and the config it ran (resolved: per-layer bits, group widths). The book reads
runs by their labels, so a change to a preset or to a token's default would leave committed
runs whose label now asks for other storage than they measured: their numbers would be read as
the new storage's. :func:`label_mismatches` finds them by resolving each label again, as the
command that wrote the file would today, and comparing with the recorded config.

A label with a bit budget (``alloc=``) is allocated again from the sensitivity table shipped
for its model and storage format, at the context its file was allocated at. Where no table
ships for the format (one measured on first use into the user cache, as for a 5-bit band), and
for the group widths of a calibrated transform (``kxf``, ``vxf``: a calibration on the model),
the per-layer bits and widths are not derived again; every other field is compared.
"""

from __future__ import annotations

import json
from pathlib import Path

from rqlib.spec.config import CompressionConfig

__all__ = ["READ_BY_SPEC", "label_mismatches", "run_mismatch"]

#: results files whose runs are read only by the config each one recorded, never by its label,
#: and so are not checked against what their labels give today: the first CPU's runs of rq-3
#: and rq-2 with the band stored twice and once, which chapter 6 pairs with the runs of the
#: same configs on a second CPU. They cannot be rerun where they ran, and a rerun here would
#: no longer show what changes from one CPU to the other.
READ_BY_SPEC = (
    "eval-band-once-smollm2-w1024.json",
    "eval-band-once-smollm2-w4096.json",
    "eval-band-once-gemma3-w1024.json",
)

#: fields a resolution sets: the per-layer bits (with the uniform bits they are written over)
#: and the budget that the allocation turns into them.
_ALLOCATED = ("key_bits", "value_bits", "layer_key_bits", "layer_value_bits", "budget")
_GROUPS = ("key_group_bits", "value_group_bits")


def _resolved(
    label: str, model: str, context: int | None
) -> tuple[CompressionConfig, tuple[str, ...]]:
    """``label`` resolved as the eval command resolves it, and the fields left unresolved."""
    from rqlib.book.loaders import packaged_config
    from rqlib.study.allocation import allocate, shipped_sensitivity

    config = CompressionConfig.parse(label)
    unresolved: tuple[str, ...] = ()
    if (config.transform_keys or config.transform_values) and not (
        config.key_group_bits or config.value_group_bits
    ):
        unresolved += _GROUPS
    if config.budget is not None:
        try:
            table = shipped_sensitivity(model, config)
        except FileNotFoundError:
            unresolved += _ALLOCATED
        else:
            config = allocate(table, config, packaged_config(model), context)
    return config, unresolved


def run_mismatch(label: str, recorded: dict, model: str, context: int | None) -> str | None:
    """``None`` when ``recorded`` (a run's config as written by ``rqlib eval`` or ``rqlib
    experiment``) is what ``label`` resolves to today on packaged ``model`` at ``context``
    tokens; otherwise the fields that differ, with both values."""
    expected, unresolved = _resolved(label, model, context)
    ran = CompressionConfig.from_dict(recorded).to_dict()
    wanted = expected.to_dict()
    differ = [
        f"{name} is {ran[name]!r}, the label gives {wanted[name]!r}"
        for name in wanted
        if name != "name" and name not in unresolved and ran[name] != wanted[name]
    ]
    return "; ".join(differ) or None


def _eval_runs(payload: dict):
    """The runs of an ``rqlib eval`` file that are rqlib's caches (a peer's label is its whole
    config, and the uncompressed reference has none)."""
    context = payload.get("context")
    for run in payload["results"]:
        if run.get("config") is not None and "peer" not in run["config"]:
            yield run["label"], run["config"], context


def _experiment_runs(payload: dict):
    """The runs of an ``rqlib experiment`` file that a label names: its presets and the
    baselines given as specs (a lever's row is its preset's config with one change)."""
    context = int(payload["context_for_bits"])
    for row in payload["rows"]:
        if row["role"] in ("preset", "baseline"):
            yield row["label"], CompressionConfig.parse(row["spec"]).to_dict(), context


def label_mismatches(path: Path | str) -> list[str]:
    """One line for each run of the results file ``path`` (``rqlib eval --json`` or ``rqlib
    experiment --json``) whose label no longer gives the config it ran, naming the file, the
    label and the fields; an empty list when every run is what its label says."""
    path = Path(path)
    payload = json.loads(path.read_text())
    if "results" in payload:
        runs = _eval_runs(payload)
    elif "rows" in payload and "context_for_bits" in payload:
        runs = _experiment_runs(payload)
    else:
        raise ValueError(f"{path} is no results file of rqlib eval or rqlib experiment")
    found = []
    for label, recorded, context in runs:
        problem = run_mismatch(label, recorded, payload["model"], context)
        if problem:
            found.append(f"{path.name}: {label}: {problem}")
    return found
