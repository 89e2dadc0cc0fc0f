"""Readers of the committed results files, for the chapters.

Each loader reads one kind of file written by the study layer and returns a
``pandas.DataFrame`` (or a small dict); chapters call these instead of parsing JSON themselves.
:data:`COMMITTED` lists the files the chapters read; each records the command that regenerates it
(a test parses every recorded command with the command line's own parser).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pandas as pd

from rqlib.book.results import metric_label, results_dir
from rqlib.spec.presets import PEER_TARGETS, PRESETS, TARGETS, budget_of

__all__ = [
    "COMMITTED",
    "MODELS",
    "committed_file",
    "committed_numbers",
    "committed_overview",
    "HEADLINE",
    "headline_frame",
    "held_out_tables",
    "headline_numbers",
    "headline_styled",
    "headline_table",
    "headline_targets",
    "preset_targets",
    "mode_agreement",
    "keys_only_pivot",
    "preset_table",
    "load_ablation",
    "load_eval_table",
    "load_headline",
    "preset_evidence",
    "preset_verdict",
    "recorded_command",
    "draw_spread",
    "packaged_config",
    "shipped_allocation",
    "sweep_command",
    "sweep_draws",
    "top_levers",
    "window_study",
    "window_table",
]

#: How the results tables print each metric of a run, by metric (headers: ``metric_label``).
METRIC_FORMATS = {
    "bits_mean": "{:.3f}",
    "delta_ppl_pct": "{:+.2f}",
    "kl": "{:.4f}",
    "top1": "{:.3f}",
}


def _metric_headers() -> dict[str, str]:
    return {metric: metric_label(metric) for metric in METRIC_FORMATS}


def _metric_formats() -> dict[str, str]:
    return {metric_label(metric): form for metric, form in METRIC_FORMATS.items()}


#: Short name of each packaged model in results file names -> its name in the book.
MODELS = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M"}

#: The committed results files the chapters read (each records the command that regenerates
#: it) -> what it holds.
COMMITTED = {
    "eval-quantizers-smollm2.json": "every quantizer, keys only",
    "eval-quantizers-gemma3.json": "every quantizer, keys only",
    "presets-smollm2.json": "the presets, keys and values",
    "presets-gemma3.json": "the presets, keys and values",
    "draws-smollm2.json": "rq-3.5 with three other rotation draws",
    "ablation-smollm2.json": "each preset with one lever changed at a time",
}

#: The side-by-side runs on held-out text (wikitext-2 test from token 100000 on), by file ->
#: what it holds. Our caches read every key, the chunk's own included, from its codes, so one
#: forward per window computes what decode mode computes (``*-check-*`` measure both on one
#: window); the peers keep a chunk exact, so they run token by token (``decode``) as well, and
#: so do the presets where a file holds them in decode mode (``*-decode-presets-*``).
HEADLINE = {
    "headline/smollm2-prefill-w1024.json": "held out, 1024: everything, one forward per window",
    "headline/smollm2-decode-w1024.json": "held out, 1024: quanto, token by token",
    "headline/smollm2-decode-presets-w1024.json": "held out, 1024: the presets, token by token",
    "headline/smollm2-decode-tq-w1024.json": "held out, 1024: TurboQuant-MSE, token by token",
    "headline/smollm2-prefill-w4096.json": "held out, 4096: everything, one forward per window",
    "headline/smollm2-decode-w4096.json": "held out, 4096: quanto int4, token by token",
    "headline/smollm2-decode-int2-w4096.json": "held out, 4096: quanto int2, token by token",
    "headline/smollm2-prefill-check-w1024.json": "first held-out window: one forward",
    "headline/smollm2-decode-check-w1024.json": "first held-out window: presets, token by token",
    "headline/smollm2-decode-more-w1024.json": "first held-out window: HQQ, fp8, exact cache",
    "headline/gemma3-prefill-w1024.json": "held out, Gemma 3: one forward per window",
    "headline/gemma3-decode-w1024.json": "first held-out window, Gemma 3: quanto, token by token",
    "headline/smollm2-prefill-rq2-w1024.json": "held out, 1024: rq-2, one forward per window",
    "headline/smollm2-prefill-rq2-w4096.json": "held out, 4096: rq-2, one forward per window",
    "headline/smollm2-prefill-check-rq2-w1024.json": "first held-out window: rq-2, one forward",
    "headline/smollm2-decode-check-rq2-w1024.json": "first held-out window: rq-2, token by token",
    "headline/gemma3-prefill-rq2-w1024.json": "held out, Gemma 3: rq-2, one forward per window",
}
COMMITTED.update(HEADLINE)


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
    headers = {"model": "model", "preset": "preset", **_metric_headers(), "spec": "spec"}
    formats = _metric_formats()
    caption = "Presets, keys and values compressed"
    return styled(shown, headers, formats, caption=caption), notes


def committed_numbers(
    keys_only: dict[str, pd.DataFrame], presets: dict[str, pd.DataFrame], draws: pd.DataFrame
) -> dict[str, object]:
    """The numbers chapter 4's prose quotes from the committed files, by glue name:
    ``keys_only_<model>_<method>_k<bits>`` (ΔPPL %), ``presets_<model>_<preset>_<column>``
    (with a ``_verdict`` against the targets) and ``draws_<stat>``."""
    from rqlib.book.chapter import slug

    numbers: dict[str, object] = {}
    for m, frame in keys_only.items():
        numbers[f"keys_only_{m}_tokens"] = int(frame["tokens"].iloc[0])
        numbers[f"keys_only_{m}_window"] = int(frame["window"].iloc[0])
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
    numbers.update({f"draws_{k}": v for k, v in draw_spread(draws).items()})
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


def draw_spread(frame: pd.DataFrame) -> dict[str, float]:
    """The range of ΔPPL % and KL over the baseline rows of a draws file (other rotation
    draws of one preset): ``{"n", "tokens", "delta_ppl_pct_min", ..., "kl_max"}``."""
    rows = frame[frame["role"] == "baseline"]
    if rows.empty:
        raise ValueError("the draws file has no baseline rows")
    spread = {"n": len(rows), "tokens": int(frame["tokens"].iloc[0])}
    for column in ("delta_ppl_pct", "kl"):
        spread[f"{column}_min"] = float(rows[column].min())
        spread[f"{column}_max"] = float(rows[column].max())
    return spread


def sweep_draws(directory: Path | str | None = None, bits: int = 3) -> dict[str, object]:
    """How far one setting of chapter 4 moves when its rotations are drawn again, from the
    committed sweep (``results/04_perplexity/``, every setting drawn with several draws, at
    whatever code state it was run: the range is a property of the protocol, not of a commit).

    Glue values: ``sweep_tokens``, ``sweep_window``, ``sweep_n_draws``; per method at ``bits``
    key bits and no exact window, ``sweep_<method>_k<bits>_low`` / ``_median`` / ``_high``
    (ΔPPL %); ``sweep_range_median`` and ``sweep_range_max``, the range (high - low, in
    points of ΔPPL %) at the median setting and the widest."""
    from rqlib.book.chapter import slug
    from rqlib.book.draws import repeated_draws
    from rqlib.book.results import collect

    runs = collect("04_perplexity", directory)
    keys = ["key_bits", "method", "exact_window"]
    summary = repeated_draws(runs, "delta_ppl_pct", keys, "draw")
    spread = summary["high"] - summary["low"]
    numbers: dict[str, object] = {
        "sweep_tokens": int(runs["tokens"].iloc[0]),
        "sweep_window": int(runs["window"].iloc[0]),
        "sweep_n_draws": int(summary["n_draws"].iloc[0]),
        "sweep_range_median": float(spread.median()),
        "sweep_range_max": float(spread.max()),
    }
    shown = summary[(summary["key_bits"] == bits) & (summary["exact_window"] == 0)]
    if shown.empty:
        raise ValueError(f"the sweep has no setting at {bits} key bits without an exact window")
    for row in shown.itertuples():
        for stat in ("low", "median", "high"):
            numbers[slug("sweep", row.method, f"k{bits}", stat)] = float(getattr(row, stat))
    return numbers


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


@functools.cache
def packaged_config(model: str):
    """The transformers config (the geometry the bit accounting needs) of packaged model
    ``model``, read from its converted folder without loading the weights."""
    from transformers import AutoConfig

    from rqlib.hf.models import converted_model_dir

    return AutoConfig.from_pretrained(converted_model_dir(model))


def shipped_allocation(model: str, preset: str):
    """``(sensitivity table, transformers config)`` for preset ``preset`` on packaged model
    ``model``: the table shipped in ``rqlib/study/allocations/`` for the preset's storage format,
    from which it allocates the model's bits, and the model's config (its geometry)."""
    from rqlib.spec.config import get_preset
    from rqlib.study.allocation import shipped_sensitivity

    return shipped_sensitivity(model, get_preset(preset)), packaged_config(model)


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
    exact cache fed like the others, ``hf-dynamic``), ``spec`` (for rqlib's caches the compact
    spec of the config it ran, whatever its label: two runs of equal storage have equal specs;
    the label for the others), ``bits_key``,
    ``bits_value``, ``bits_mean``, ``bytes_per_token``, ``perplexity``, ``delta_ppl_pct``,
    ``kl``, ``top1``, ``n_scored``, ``seconds``, ``seconds_per_token``, ``decoded_copy``
    (whether the steps read a decoded copy of the codes); and the run's fields
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
                "spec": _run_spec(result["label"], config),
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
                "decoded_copy": bool(result.get("extra", {}).get("decoded_copy", False)),
            }
        )
    frame = pd.DataFrame(rows)
    for key in HEADLINE_RUN_FIELDS:
        frame[key] = payload[key]
    frame["corpus_sha256"] = payload["corpus"]["sha256"]
    return frame


def _run_spec(label: str, config: dict | None) -> str:
    """The storage a run measured: its config's compact spec for rqlib's caches, else its
    label (the uncompressed model, a peer)."""
    if config is None or "peer" in config:
        return label
    from rqlib.spec.config import CompressionConfig

    return CompressionConfig.from_dict(config).spec()


def _headline_kind(config: dict | None) -> str:
    if config is None:
        return "fp"
    if "peer" not in config:
        return "rqlib"
    return "control" if config["backend"] == "dynamic" else "peer"


def headline_frame(directory: Path | str | None = None) -> pd.DataFrame:
    """Every row of the :data:`HEADLINE` files (:func:`load_headline`), with the file's name
    (``file``) and the model's short name (``short``: a key of :data:`MODELS`)."""
    frames = []
    for name in HEADLINE:
        frame = load_headline(committed_file(name, directory))
        frames.append(frame.assign(file=name, short=name.split("/")[1].split("-")[0]))
    return pd.concat(frames, ignore_index=True)


FIRST_WINDOW_FILES = "-check-|-more-"  # the runs on the first held-out window alone


def _runs(frame: pd.DataFrame, short: str, first_window: bool) -> pd.DataFrame:
    """The rows of one model: of the many-window runs, or of the runs on the first window."""
    rows = frame[frame["short"] == short]
    checks = rows["file"].str.contains(FIRST_WINDOW_FILES)
    return rows[checks] if first_window else rows[~checks]


def headline_table(
    frame: pd.DataFrame, short: str, window: int, *, first_window: bool = False
) -> pd.DataFrame:
    """The side-by-side of one model at one window, one row per method run in one forward
    per window (``fp`` first): its bits per K+V coordinate, what decode mode measures
    (``perplexity``, ``delta_ppl_pct``, ``kl``, ``top1``; ``decode_run``: ``"token by token"``, or
    ``"one forward"`` for our caches where no token-by-token run exists: they read every key
    from its codes, so one forward computes what decode mode does) and what one forward
    reports (``prefill_delta_ppl_pct``, ``prefill_kl``); ``windows``, the number of windows
    behind the decode numbers. A peer without a token-by-token run is left out: one forward
    says nothing about it. ``first_window``: the runs on the first window alone, where such a
    peer is kept with its one-forward numbers (``decode_run`` ``"not run"``, decode columns
    NaN)."""
    runs = _runs(frame, short, first_window)
    runs = runs[runs["window"] == window]
    # a method in several files of one mode (the full-precision reference of each run, the
    # same tokens through the same forward): its first row
    runs = runs.drop_duplicates(subset=["method", "mode"], keep="first")
    prefill = runs[runs["mode"] == "prefill"].set_index("method")
    decode = runs[runs["mode"] == "decode"].set_index("method")
    rows = []
    for method, one in prefill.iterrows():
        # the full-precision reference is one forward per window in every file
        measured = decode.loc[method] if method in decode.index and method != "fp" else None
        if one["kind"] in ("peer", "control") and measured is None:
            if first_window:
                rows.append(_row(method, one, None, "not run"))
            continue
        if measured is None:
            rows.append(_row(method, one, one, "one forward"))
        else:
            rows.append(_row(method, one, measured, "token by token"))
    return pd.DataFrame(sorted(rows, key=_display_order))


def _display_order(row: dict) -> tuple[int, int]:
    """Where a row goes in a side-by-side table (a stable sort keeps file order in a tie): full
    precision, the presets in the order of :data:`PRESETS`, our other caches, the peers, the
    control."""
    presets = [f"preset:{name}" for name in PRESETS]
    rank = {"fp": 0, "rqlib": 1, "peer": 2, "control": 3}[row["kind"]]
    return rank, presets.index(row["method"]) if row["method"] in presets else len(presets)


def held_out_tables(frame: pd.DataFrame, short: str) -> dict[int, pd.DataFrame]:
    """:func:`headline_table` of one model at every window length its many-window runs have,
    shortest first."""
    windows = sorted(_runs(frame, short, first_window=False)["window"].unique())
    return {int(w): headline_table(frame, short, int(w)) for w in windows}


def _row(method: str, one: pd.Series, measured: pd.Series | None, decode_run: str) -> dict:
    """A row of :func:`headline_table`: bits and one-forward numbers from ``one``, decode
    numbers from ``measured`` (``None``: not run, NaN)."""
    nan = float("nan")

    def decoded(column):
        return nan if measured is None else measured[column]

    return {
        "method": method,
        "kind": one["kind"],
        "bits_mean": one["bits_mean"],
        "perplexity": decoded("perplexity"),
        "delta_ppl_pct": decoded("delta_ppl_pct"),
        "kl": decoded("kl"),
        "top1": decoded("top1"),
        "decode_run": decode_run,
        "prefill_delta_ppl_pct": one["delta_ppl_pct"],
        "prefill_kl": one["kl"],
        "windows": int(one["windows"] if measured is None else measured["windows"]),
        "seconds_per_token": decoded("seconds_per_token"),
        "prefill_seconds_per_token": one["seconds_per_token"],
        "decoded_copy": bool(measured is not None and measured.get("decoded_copy", False)),
    }


def mode_agreement(first: pd.DataFrame) -> pd.DataFrame:
    """Our caches on one window, token by token against one forward (``first``: a
    :func:`headline_table` of ``first_window=True``): ``method``, ``kl_decode``,
    ``kl_prefill``, ``kl_ratio`` (decode over one forward), ``cost_ratio`` (seconds per
    token, decode over one forward) and ``decoded_copy`` (whether the token-by-token steps read
    a decoded copy of the codes)."""
    ours = first[(first["kind"] == "rqlib") & (first["decode_run"] == "token by token")]
    return pd.DataFrame(
        {
            "method": ours["method"].to_numpy(),
            "kl_decode": ours["kl"].to_numpy(),
            "kl_prefill": ours["prefill_kl"].to_numpy(),
            "kl_ratio": (ours["kl"] / ours["prefill_kl"]).to_numpy(),
            "cost_ratio": (
                ours["seconds_per_token"] / ours["prefill_seconds_per_token"]
            ).to_numpy(),
            "decoded_copy": ours["decoded_copy"].to_numpy(),
        }
    )


#: Windows the held-out targets need, by window length.
HEADLINE_MIN_WINDOWS = {1024: 8, 4096: 2}


def preset_targets(preset: str, ours, peer) -> list[dict]:
    """The held-out targets of ``preset`` for one run ``ours`` (``delta_ppl_pct``, ``kl``,
    ``bits_mean``) next to its peer's run ``peer`` (the :data:`PEER_TARGETS` peer; ``None``
    when it was not run, which meets nothing): ``target`` (what is asked), ``measured`` and
    ``bound``, met when ``measured <= bound``. The preset's own bounds (:data:`TARGETS`), then
    fewer bits than the peer and a KL at most a share of the peer's."""
    target, versus = TARGETS[preset], PEER_TARGETS[preset]
    rows = [("ΔPPL %", ours["delta_ppl_pct"], target.max_delta_ppl_pct)]
    if target.max_kl is not None:
        rows.append(("KL", ours["kl"], target.max_kl))
    if peer is None:
        rows.append((f"KL / KL of {versus.peer}", float("nan"), versus.max_kl_ratio))
    else:
        rows.append((f"bits vs {versus.peer}", ours["bits_mean"], peer["bits_mean"]))
        rows.append((f"KL / KL of {versus.peer}", ours["kl"] / peer["kl"], versus.max_kl_ratio))
    return [{"target": t, "measured": m, "bound": b} for t, m, b in rows]


def headline_targets(tables: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Every held-out target of every preset at every window length (``tables``: window ->
    :func:`headline_table` of SmolLM2): ``preset``, ``window``, ``target`` (what is asked),
    ``measured``, ``bound``, ``met``. The presets' own bounds (:data:`TARGETS`) and their
    bounds against a peer (:data:`PEER_TARGETS`: fewer bits, and a KL at most a ratio of the
    peer's); a table with fewer windows than :data:`HEADLINE_MIN_WINDOWS` meets nothing, and a
    peer target whose peer was not run at that window is not met (``measured`` NaN)."""
    rows = []
    for window, table in tables.items():
        by_method = table.set_index("method")
        enough = int(table["windows"].min()) >= HEADLINE_MIN_WINDOWS.get(window, 1)

        for preset in TARGETS:
            ours = by_method.loc[f"preset:{preset}"]
            peer = PEER_TARGETS[preset].peer
            versus = by_method.loc[peer] if peer in by_method.index else None
            for row in preset_targets(preset, ours, versus):
                met = enough and row["measured"] <= row["bound"]
                rows.append({"preset": preset, "window": window, **row, "met": met})
    return pd.DataFrame(rows)


def headline_styled(table: pd.DataFrame, caption: str):
    """A :func:`headline_table` as the book shows it (a Styler)."""
    from rqlib.book.tables import styled

    headers = {
        "method": "method",
        **_metric_headers(),
        "decode_run": "decode measured in",
        "prefill_delta_ppl_pct": "one forward: ΔPPL %",
        "prefill_kl": "one forward: KL",
        "windows": "windows",
    }
    formats = {
        **_metric_formats(),
        "one forward: ΔPPL %": "{:+.2f}",
        "one forward: KL": "{:.4f}",
    }
    return styled(table[table["kind"] != "fp"], headers, formats, caption=caption)


def headline_numbers(
    tables: dict[int, pd.DataFrame],
    targets: pd.DataFrame,
    first: pd.DataFrame,
    gemma: pd.DataFrame,
) -> dict[str, object]:
    """The numbers the side-by-side section quotes, by glue name: ``held_<window>_<method>_
    <column>`` for every row of SmolLM2's tables, ``held_<window>_windows``, the targets
    (``held_targets_met``, ``held_targets_total``, ``held_targets_missed``: a sentence;
    ``held_closest_met``: the met target with the least margin, as a share of its bound),
    ``first_<method>_<column>`` of the first window's table, ``agree_<preset>_<column>``
    (:func:`mode_agreement`) and ``gemma_<method>_<column>``."""
    from rqlib.book.chapter import slug
    from rqlib.study.peers import DEFAULT_GROUP, DEFAULT_RESIDUAL

    numbers: dict[str, object] = {
        "peer_group": DEFAULT_GROUP,
        "peer_residual_max": DEFAULT_RESIDUAL - 1,
        "peer_targets": "; ".join(
            f"{preset} at most {target.max_kl_ratio:.3g} times the KL of {target.peer}"
            for preset, target in PEER_TARGETS.items()
        ),
    }
    for window, table in tables.items():
        numbers[f"held_{window}_windows"] = int(table["windows"].max())
        fp = table[table["kind"] == "fp"]
        numbers[f"held_{window}_fp_ppl"] = float(fp["perplexity"].iloc[0])
        for row in table.itertuples():
            for column in ("bits_mean", "delta_ppl_pct", "kl", "top1", "prefill_delta_ppl_pct"):
                numbers[slug("held", window, row.method, column)] = float(getattr(row, column))
    numbers["held_targets_met"] = int(targets["met"].sum())
    numbers["held_targets_total"] = len(targets)
    missed = targets[~targets["met"]]
    numbers["held_targets_missed"] = (
        "none"
        if missed.empty
        else "; ".join(
            f"{r.preset} at {r.window} tokens, {r.target}: "
            + (
                f"{r.measured:.4g} against {r.bound:.4g}"
                if r.measured == r.measured
                else f"not measured ({r.target.split(' of ')[-1]} was not run token by token)"
            )
            for r in missed.itertuples()
        )
    )
    met = targets[targets["met"]]
    closest = met.loc[(1 - met["measured"] / met["bound"]).idxmin()] if not met.empty else None
    numbers["held_closest_met"] = (
        "none"
        if closest is None
        else f"{closest.preset} at {closest.window} tokens, {closest.target}: "
        f"{closest.measured:.4g} against {closest.bound:.4g}"
    )
    for row in first.itertuples():
        for column in ("bits_mean", "delta_ppl_pct", "kl", "prefill_delta_ppl_pct"):
            numbers[slug("first", row.method, column)] = float(getattr(row, column))
    agreement = mode_agreement(first)
    for row in agreement.itertuples():
        for column in ("kl_decode", "kl_prefill", "kl_ratio"):
            numbers[slug("agree", row.method, column)] = float(getattr(row, column))
    numbers["agree_cost_ratio_min"] = float(agreement["cost_ratio"].min())
    numbers["agree_cost_ratio_max"] = float(agreement["cost_ratio"].max())
    numbers["agree_kl_ratio_min"] = float(agreement["kl_ratio"].min())
    numbers["agree_kl_ratio_max"] = float(agreement["kl_ratio"].max())
    numbers["agree_decode_reads"] = (
        "a decoded copy of the codes, written once per token"
        if bool(agreement["decoded_copy"].all())
        else "the packed codes, decoding every stored one again"
    )
    for row in gemma.itertuples():
        for column in ("bits_mean", "delta_ppl_pct", "kl", "prefill_delta_ppl_pct"):
            numbers[slug("gemma", row.method, column)] = float(getattr(row, column))
    numbers["gemma_windows_min"] = int(gemma["windows"].min())
    numbers["gemma_windows_max"] = int(gemma["windows"].max())
    return numbers


def _window_free_format(config) -> str:
    """The storage format a sensitivity table is for, without its window, sink and band
    precision (:func:`rqlib.study.allocation._base_of`)."""
    from rqlib.study.allocation import _base_of

    return _base_of(config).replace(recent_window=0, n_sink=0, band_bits=None).spec()


@functools.cache
def _shipped_windows(model: str, form: str) -> dict[int, Path]:
    """The shipped tables of packaged ``model`` in format ``form`` (as
    :func:`_window_free_format` writes it), by recent window; each file read once."""
    from rqlib.base.files import read_json
    from rqlib.spec.config import CompressionConfig
    from rqlib.study.allocation import SHIPPED

    tables = {}
    for path in sorted(SHIPPED.glob("*.json")):
        data = read_json(path)
        base = CompressionConfig.parse(data["base"])
        if data.get("model") == model and _window_free_format(base) == form:
            tables[base.recent_window] = path
    return tables


@functools.cache
def _read_table(path: Path):
    from rqlib.study.allocation import Sensitivity

    return Sensitivity.read(path)


def window_table(model: str, config):
    """The shipped sensitivity table (:mod:`rqlib.study.allocation`) measured with the recent
    window nearest ``config``'s, on a log scale (ties: the shorter), among the tables of
    packaged ``model`` whose format is ``config``'s apart from its window, sink and band
    precision. A window with no table of its own is allocated from it, as an approximation:
    the layers are ranked by their sensitivity next to a band of another length.
    ``FileNotFoundError`` names the model and format when no table qualifies."""
    from rqlib.study.allocation import SHIPPED

    form = _window_free_format(config)
    tables = _shipped_windows(model, form)
    if not tables:
        raise FileNotFoundError(
            f"no sensitivity table in {SHIPPED} is for {model} and the format {form}"
        )
    wanted = max(config.recent_window, 1)
    nearest = min(tables, key=lambda w: (abs(math.log2(max(w, 1) / wanted)), w))
    return _read_table(tables[nearest])


def _allocated_spec(table, config, model_config, context: int) -> str | None:
    """The spec of ``config``'s allocation from ``table`` at ``context``; ``None`` when its
    budget is below every allocation."""
    from rqlib.study.allocation import allocate

    try:
        return allocate(table, config, model_config, context).spec()
    except ValueError:
        return None


def window_study(path: Path | str, budgets: tuple[float, ...] | None = None) -> pd.DataFrame:
    """The runs of one recent-window file (``rqlib eval --json``; every method a resolved
    config at the file's context) as rows: ``budget``, ``context``, ``window`` (its recent
    window), ``band_bits``, ``sink``, ``norm_bits``, ``trellis`` (its ``tcq`` state bits, or
    None), ``bits_mean``, ``delta_ppl_pct``, ``kl``, ``top1``, ``offset``, ``model`` and
    ``method``.

    A run's budget is the one of ``budgets`` (default: the presets' budgets) whose allocation
    at the file's context, from :func:`window_table`, gives exactly its per-layer bits; a run
    that matches none raises ``ValueError`` naming the file and the run, so a file whose bits
    were chosen otherwise is refused rather than read."""
    from rqlib.spec.config import CompressionConfig

    frame = load_headline(path)
    model = str(frame.model.iloc[0])
    model_config = packaged_config(model)
    budgets = tuple(budget_of(name) for name in PRESETS) if budgets is None else budgets
    rows = []
    for run in frame[frame.kind == "rqlib"].itertuples():
        config = CompressionConfig.parse(run.method)
        storage = config.replace(key_bits=3, value_bits=3, layer_key_bits=(), layer_value_bits=())
        table, context = window_table(model, config), int(run.context)
        matched = [
            budget
            for budget in budgets
            if _allocated_spec(table, storage.replace(budget=budget), model_config, context)
            == config.spec()
        ]
        if not matched:
            raise ValueError(
                f"{path}: the bits of {run.method} are no allocation of the budgets {budgets} "
                f"at context {run.context}"
            )
        rows.append(
            {
                "budget": matched[0],
                "context": int(run.context),
                "window": config.recent_window,
                "band_bits": config.band_bits,
                "sink": config.n_sink,
                "norm_bits": None if config.norm_mantissa is None else config.norm_mantissa + 5,
                "trellis": config.trellis_state_bits,
                "bits_mean": run.bits_mean,
                "delta_ppl_pct": run.delta_ppl_pct,
                "kl": run.kl,
                "top1": run.top1,
                "offset": int(run.offset),
                "model": model,
                "method": run.method,
            }
        )
    return pd.DataFrame(rows)
