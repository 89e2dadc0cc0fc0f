"""Readers of the committed results files, for the chapters.

Each loader reads one kind of file written by the study layer and returns a
``pandas.DataFrame`` (or a small dict); chapters call these instead of parsing JSON themselves.
:data:`COMMITTED` lists the files the chapters read; each records the command that regenerates it
(a test parses every recorded command with the command line's own parser).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from rqlib.book.results import results_dir
from rqlib.spec.presets import TARGETS

__all__ = [
    "COMMITTED",
    "MODELS",
    "committed_file",
    "committed_numbers",
    "committed_overview",
    "keys_only_pivot",
    "preset_table",
    "load_ablation",
    "load_eval_table",
    "load_headline",
    "preset_evidence",
    "preset_verdict",
    "recorded_command",
    "seed_spread",
    "shipped_allocation",
    "sweep_command",
    "top_levers",
]

#: Short name of each packaged model in results file names -> its name in the book.
MODELS = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M"}

#: The committed results files the chapters read (each records the command that regenerates
#: it) -> what it holds.
COMMITTED = {
    "eval-quantizers-smollm2.json": "every quantizer, keys only",
    "eval-quantizers-gemma3.json": "every quantizer, keys only",
    "presets-smollm2.json": "the presets, keys and values",
    "presets-gemma3.json": "the presets, keys and values",
    "seeds-smollm2.json": "rq-3.5 with three other rotation seeds",
    "ablation-smollm2.json": "each preset with one lever changed at a time",
}


def committed_file(name: str, directory: Path | str | None = None) -> Path:
    """The path of committed results file ``name``; ``FileNotFoundError`` naming the file
    (restore it from git: it records the command that regenerates it) when it is missing."""
    if name not in COMMITTED:
        raise KeyError(f"{name!r} is not a committed results file; known: {list(COMMITTED)}")
    path = Path(directory or results_dir()) / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: restore it with `git checkout -- results/{name}` (the file "
            "records the command that regenerates it), or run chapter 4 with "
            "show_committed=False to leave the committed results out"
        )
    return path


def recorded_command(path: Path | str) -> str:
    """The command a results file records as the one that produced it."""
    payload = json.loads(Path(path).read_text())
    if "command" not in payload:
        raise ValueError(f"{path} records no command")
    return payload["command"]


def committed_overview(directory: Path | str | None = None) -> pd.DataFrame:
    """One row per committed file: ``file``, ``holds``, ``tokens``, ``window``, ``command``."""
    rows = []
    for name, holds in COMMITTED.items():
        payload = json.loads(committed_file(name, directory).read_text())
        rows.append(
            {
                "file": name,
                "holds": holds,
                "tokens": payload["tokens"],
                "window": payload["window"],
                "command": payload["command"],
            }
        )
    return pd.DataFrame(rows)


def keys_only_pivot(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """ΔPPL % of every keys-only method (rows: model, method) at each key bit width (columns
    ``"2 bits"``, ...), from :func:`load_eval_table` frames keyed by short model name."""
    both = pd.concat([f.assign(model=MODELS[m]) for m, f in frames.items()], ignore_index=True)
    pivot = both[both["method"] != "fp"].pivot_table(
        index=["model", "method"], columns="key_bits", values="delta_ppl_pct"
    )
    pivot.columns = [f"{bits} bits" for bits in pivot.columns]
    return pivot


def preset_table(frames: dict[str, pd.DataFrame]):
    """The presets of :func:`load_ablation` frames (keyed by short model name) as the book
    shows them: readable headers, formats, and the long specs as numbered notes (a Styler
    and the notes' Markdown)."""
    from rqlib.book.tables import styled, with_spec_notes

    both = pd.concat([f.assign(model=MODELS[m]) for m, f in frames.items()], ignore_index=True)
    shown, notes = with_spec_notes(both[both["role"] == "preset"])
    headers = {
        "model": "model",
        "preset": "preset",
        "bits_mean": "bits per K+V coord.",
        "delta_ppl_pct": "ΔPPL %",
        "kl": "KL (nats)",
        "top1": "top-1",
        "spec": "spec",
    }
    formats = {
        "bits per K+V coord.": "{:.3f}",
        "ΔPPL %": "{:+.2f}",
        "KL (nats)": "{:.4f}",
        "top-1": "{:.3f}",
    }
    caption = "Presets, keys and values compressed"
    return styled(shown, headers, formats, caption=caption), notes


def committed_numbers(
    keys_only: dict[str, pd.DataFrame], presets: dict[str, pd.DataFrame], seeds: pd.DataFrame
) -> dict[str, object]:
    """The numbers chapter 4's prose quotes from the committed files, by glue name:
    ``keys_only_<model>_<method>_k<bits>`` (ΔPPL %), ``presets_<model>_<preset>_<column>``
    (with a ``_verdict`` against the targets) and ``seeds_<stat>``."""
    from rqlib.book.chapter import slug

    numbers: dict[str, object] = {}
    for m, frame in keys_only.items():
        numbers[f"keys_only_{m}_tokens"] = int(frame["tokens"].iloc[0])
        numbers[f"keys_only_{m}_fp_ppl"] = float(frame["perplexity"].iloc[0])
        for row in frame[frame["method"] != "fp"].itertuples():
            numbers[slug("keys_only", m, row.method, f"k{row.key_bits}")] = row.delta_ppl_pct
    for m, frame in presets.items():
        numbers[f"presets_{m}_tokens"] = int(frame["tokens"].iloc[0])
        fp = frame.loc[frame["role"] == "fp", "perplexity"]
        numbers[f"presets_{m}_fp_ppl"] = float(fp.iloc[0])
        for row in frame[frame["role"] == "preset"].itertuples():
            for column in ("bits_mean", "delta_ppl_pct", "kl"):
                numbers[slug("presets", m, row.preset, column)] = float(getattr(row, column))
            verdict = preset_verdict(row.preset, row.bits_mean, row.delta_ppl_pct, row.kl)
            numbers[slug("presets", m, row.preset, "verdict")] = verdict
    numbers.update({f"seeds_{k}": v for k, v in seed_spread(seeds).items()})
    return numbers


def load_eval_table(path: Path | str) -> pd.DataFrame:
    """A file written by ``python -m rqlib eval --json``, one row per method (``fp`` first).

    Columns: ``label``, ``method``, ``key_bits`` (an integer; 16 for full precision),
    ``perplexity``, ``delta_ppl_pct``, ``kl``, ``top1``, ``bits_key``, ``bits_mean``, and the
    run's ``model``, ``tokens``, ``window`` and ``corpus_sha256``.
    """
    payload = json.loads(Path(path).read_text())
    if "results" not in payload:
        raise ValueError(f"{path} is not a file of `rqlib eval --json` (no 'results')")
    rows = []
    for result in payload["results"]:
        config = result["config"]
        rows.append(
            {
                "label": result["label"],
                "method": "fp" if config is None else config["method"],
                "key_bits": 16 if config is None else int(config["key_bits"]),
                "perplexity": result["perplexity"],
                "delta_ppl_pct": result.get("delta_ppl_pct", 0.0),
                "kl": result["kl"],
                "top1": result["top1"],
                "bits_key": result["bits"]["key"],
                "bits_mean": result["bits"]["mean"],
            }
        )
    frame = pd.DataFrame(rows)
    frame["model"], frame["tokens"] = payload["model"], payload["tokens"]
    frame["window"], frame["corpus_sha256"] = payload["window"], payload["corpus"]["sha256"]
    return frame


def load_ablation(path: Path | str) -> pd.DataFrame:
    """The rows of a file written by :func:`rqlib.study.experiments.run_experiment`.

    Run-level fields (model, tokens, window, corpus sha256) are repeated as columns so that
    frames of several files can be concatenated.
    """
    payload = json.loads(Path(path).read_text())
    if "rows" not in payload:
        raise ValueError(f"{path} is not a presets/ablation file (no 'rows')")
    frame = pd.DataFrame(payload["rows"])
    frame["model"] = payload["model"]
    frame["tokens"] = payload["tokens"]
    frame["window"] = payload["window"]
    frame["corpus_sha256"] = payload["corpus"]["sha256"]
    return frame


def preset_verdict(preset: str, bits_mean: float, delta_ppl_pct: float, kl: float) -> str:
    """``"meets its target"`` or ``"misses its target: ..."`` naming by how much, against
    :data:`rqlib.spec.presets.TARGETS`."""
    target = TARGETS[preset]
    missed = []
    if delta_ppl_pct > target.max_delta_ppl_pct:
        missed.append(f"ΔPPL by {delta_ppl_pct - target.max_delta_ppl_pct:.2f} points")
    if bits_mean > target.max_bits:
        missed.append(f"bits by {bits_mean - target.max_bits:.3f}")
    if target.max_kl is not None and kl > target.max_kl:
        missed.append(f"KL by {kl - target.max_kl:.4f} nats")
    return "meets its target" if not missed else "misses its target: " + ", ".join(missed)


def seed_spread(frame: pd.DataFrame) -> dict[str, float]:
    """The range of ΔPPL % and KL over the baseline rows of a seeds file (other rotation
    seeds of one preset): ``{"n", "tokens", "delta_ppl_pct_min", ..., "kl_max"}``."""
    rows = frame[frame["role"] == "baseline"]
    if rows.empty:
        raise ValueError("the seeds file has no baseline rows")
    spread = {"n": len(rows), "tokens": int(frame["tokens"].iloc[0])}
    for column in ("delta_ppl_pct", "kl"):
        spread[f"{column}_min"] = float(rows[column].min())
        spread[f"{column}_max"] = float(rows[column].max())
    return spread


def top_levers(ablation: pd.DataFrame) -> pd.DataFrame:
    """Per preset of an ablation file: its own ΔPPL %, and the removed lever whose removal
    raises ΔPPL most (``lever``, ``lever_delta_ppl_pct``)."""
    presets = ablation[ablation["role"] == "preset"].set_index("preset")
    removed = ablation[(ablation["role"] == "ablation") & (ablation["change"] == "removed")]
    rows = []
    for name, group in removed.groupby("preset", sort=False):
        worst = group.loc[group["delta_ppl_pct"].idxmax()]
        rows.append(
            {
                "preset": name,
                "delta_ppl_pct": float(presets.loc[name, "delta_ppl_pct"]),
                "lever": str(worst["lever"]),
                "lever_delta_ppl_pct": float(worst["delta_ppl_pct"]),
            }
        )
    return pd.DataFrame(rows)


def preset_evidence(name: str, model: str = "smollm2-135m", directory: Path | None = None) -> dict:
    """What preset ``name`` measured on ``model``: its row of ``results/presets-<model>.json``
    (bits, ΔPPL %, KL, top-1, target and verdict) with the run's tokens and window.

    ``FileNotFoundError`` names the missing file; ``KeyError`` when the file has no such preset.
    """
    short = model.split("-")[0]
    path = Path(directory or results_dir()) / f"presets-{short}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no measured presets for {model}: {path} does not exist")
    payload = json.loads(path.read_text())
    for row in payload["rows"]:
        if row.get("role") == "preset" and row.get("preset") == name:
            return {**row, "tokens": payload["tokens"], "window": payload["window"]}
    raise KeyError(f"{path} has no row for preset {name!r}")


def shipped_allocation(model: str):
    """``(sensitivity table, transformers config)`` of packaged model ``model``: the table
    shipped in ``rqlib/study/allocations/<model>.json``, from which the presets allocate its
    bits, and the model's config (its geometry)."""
    from transformers import AutoConfig

    from rqlib.hf.models import converted_model_dir
    from rqlib.study.allocation import SHIPPED, Sensitivity

    path = SHIPPED / f"{model}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no sensitivity table ships for {model!r}: {path} does not exist")
    table = Sensitivity.from_dict(json.loads(path.read_text()))
    return table, AutoConfig.from_pretrained(converted_model_dir(model))


def sweep_command(runs: pd.DataFrame, chapter: str) -> tuple[str, dict]:
    """The ``python -m rqlib sweep`` command that reproduces ``runs`` (a frame of
    :func:`rqlib.book.results.collect`): the parameters that vary between runs become ``-p``
    options, those equal in every run but different from the chapter's defaults the fixed
    parameters of a ``-f`` file. Returns ``(command, fixed)``."""
    from rqlib.book.chapter import parameter_specs

    specs = parameter_specs(chapter)
    swept = [name for name in specs if name != "run_id" and name in runs.columns]
    varying, fixed = {}, {}
    for name in swept:
        values = runs[name].map(lambda v: tuple(v) if isinstance(v, list) else v)
        if values.nunique() > 1:
            varying[name] = sorted(values.unique().tolist())
            continue
        value = runs[name].iloc[0]
        value = value.item() if hasattr(value, "item") else value
        if value != specs[name]["default"]:
            fixed[name] = value
    options = " ".join(f"-p {n} {' '.join(map(str, v))}" for n, v in varying.items())
    file_option = " -f sweep-params.yaml" if fixed else ""
    return f"python -m rqlib sweep notebooks/{chapter}.ipynb {options}{file_option}", fixed


HEADLINE_RUN_FIELDS = ("model", "offset", "tokens", "window", "windows", "mode", "chunk", "context")


def load_headline(path: Path | str) -> pd.DataFrame:
    """The rows of a file written by ``python -m rqlib eval ... --json PATH`` (a headline
    table): one row per method, the uncompressed model (``fp``) first.

    Columns: ``method`` (its label), ``kind`` (``fp``; ``rqlib``; ``peer``; ``control``, the
    exact cache fed like the others, ``hf-dynamic``), ``bits_key``,
    ``bits_value``, ``bits_mean``, ``bytes_per_token``, ``perplexity``, ``delta_ppl_pct``,
    ``kl``, ``top1``, ``n_scored``, ``seconds``, ``seconds_per_token``; and the run's fields
    (:data:`HEADLINE_RUN_FIELDS`, ``corpus_sha256``) repeated on every row so that frames of
    several files can be concatenated. ``ValueError`` names a file that is not such a table.
    """
    payload = json.loads(Path(path).read_text())
    missing = [key for key in ("results", "corpus", *HEADLINE_RUN_FIELDS) if key not in payload]
    if payload.get("kind") != "eval" or missing:
        raise ValueError(
            f"{path} is not a file written by `rqlib eval --json`"
            + (f" (no {', '.join(missing)})" if missing else "")
        )
    rows = []
    for result in payload["results"]:
        config = result["config"]
        rows.append(
            {
                "method": result["label"],
                "kind": _headline_kind(config),
                "bits_key": result["bits"]["key"],
                "bits_value": result["bits"]["value"],
                "bits_mean": result["bits"]["mean"],
                "bytes_per_token": result["bytes_per_token"],
                "perplexity": result["perplexity"],
                "delta_ppl_pct": result.get("delta_ppl_pct", 0.0),
                "kl": result["kl"],
                "top1": result["top1"],
                "n_scored": result["n_scored"],
                "seconds": result["seconds"],
                "seconds_per_token": result["seconds_per_token"],
            }
        )
    frame = pd.DataFrame(rows)
    for key in HEADLINE_RUN_FIELDS:
        frame[key] = payload[key]
    frame["corpus_sha256"] = payload["corpus"]["sha256"]
    return frame


def _headline_kind(config: dict | None) -> str:
    if config is None:
        return "fp"
    if "peer" not in config:
        return "rqlib"
    return "control" if config["backend"] == "dynamic" else "peer"
