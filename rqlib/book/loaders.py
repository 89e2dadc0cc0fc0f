"""Readers of the committed results files, for the chapters.

Each loader reads one kind of file written by the study layer and returns a
``pandas.DataFrame`` (or a small dict); chapters call these instead of parsing JSON themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from rqlib.book.results import results_dir

__all__ = ["load_ablation", "load_headline"]


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
