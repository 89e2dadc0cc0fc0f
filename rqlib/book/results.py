"""Chapter results on disk: one JSON file per run, gathered back into a DataFrame.

A chapter executed with a non-empty ``run_id`` parameter (the sweep sets one per
combination) calls :func:`save_result`, which writes ``results/<chapter>/<run_id>.json`` with
the run's parameters, its metrics and its provenance; large tables go next to it as parquet.
:func:`collect` reads them all back, one row per run, parameters and metrics as columns.
:func:`glue_metrics` hands numbers to the book's prose through myst-nb ``glue``, so that no
number in the text is typed by hand.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from rqlib.base.paths import env_path, repo_root

#: Environment variable that moves the results folder (default: ``<repo>/results``).
RESULTS_DIR_ENV = "RQLIB_RESULTS_DIR"

#: Provenance fields :func:`collect` returns as ``prov_<field>`` columns.
PROVENANCE_COLUMNS = ("model", "corpus", "corpus_sha256", "tokens", "device", "commit")

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")
_SCALAR = (str, int, float, bool, type(None))


def results_dir() -> Path:
    """The results folder: ``$RQLIB_RESULTS_DIR`` when set, else ``<repo>/results``."""
    return env_path(RESULTS_DIR_ENV) or repo_root() / "results"


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.match(name):
        raise ValueError(
            f"{kind} must be a non-empty file-name-safe string (letters, digits, '._=+-', "
            f"not starting with a punctuation mark), got {name!r}"
        )
    return name


def _plain(value: Any, where: str) -> Any:
    """Convert numpy/torch scalars to Python ones; refuse anything JSON cannot hold."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan"/"inf": JSON has no literal for them; say it in words
    if isinstance(value, _SCALAR):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where} is a {type(value).__name__}; results hold numbers, strings, lists and dicts "
        "(put tables in save_result(tables=...))"
    )


def save_result(
    chapter: str,
    run_id: str,
    *,
    parameters: Mapping[str, Any],
    metrics: Mapping[str, Any],
    provenance: Any,
    tables: Mapping[str, pd.DataFrame] | None = None,
    directory: Path | str | None = None,
) -> Path:
    """Write one run's results to ``<directory>/<chapter>/<run_id>.json`` and return the path.

    Args:
        chapter: the chapter's notebook stem, e.g. ``"04_perplexity"``.
        run_id: the run's name (the sweep derives it from the combination of parameters).
        parameters: the notebook's parameters for this run.
        metrics: scalar results (numbers or strings), the columns :func:`collect` returns.
        provenance: a :class:`rqlib.book.provenance.Provenance` (or its ``to_dict()``).
        tables: optional larger tables, written as ``<run_id>.<name>.parquet`` beside the JSON.
        directory: the results folder (default :func:`results_dir`).
    """
    _check_name("chapter", chapter)
    _check_name("run_id", run_id)
    overlap = set(parameters) & set(metrics)
    if overlap:
        raise ValueError(f"metrics and parameters share the names {sorted(overlap)}; rename one")
    for name, value in metrics.items():
        if not isinstance(_plain(value, f"metrics[{name!r}]"), (str, int, float, bool)):
            raise TypeError(f"metrics[{name!r}] must be a scalar, got {type(value).__name__}")
    prov = provenance.to_dict() if hasattr(provenance, "to_dict") else provenance
    if not isinstance(prov, Mapping) or "commit" not in prov:
        raise TypeError("provenance must be a rqlib.book.provenance.Provenance or its to_dict()")

    folder = (Path(directory) if directory is not None else results_dir()) / chapter
    folder.mkdir(parents=True, exist_ok=True)
    table_files = {}
    for name, frame in (tables or {}).items():
        _check_name("table name", name)
        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"tables[{name!r}] must be a pandas DataFrame")
        table_path = folder / f"{run_id}.{name}.parquet"
        frame.to_parquet(table_path)
        table_files[name] = table_path.name
    record = {
        "chapter": chapter,
        "run_id": run_id,
        "parameters": _plain(dict(parameters), "parameters"),
        "metrics": _plain(dict(metrics), "metrics"),
        "provenance": _plain(dict(prov), "provenance"),
        "tables": table_files,
    }
    path = folder / f"{run_id}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def collect(chapter: str | None = None, directory: Path | str | None = None) -> pd.DataFrame:
    """All saved runs (of one chapter, or of every chapter) as a DataFrame, one row per run.

    Columns: ``chapter``, ``run_id``, then every parameter and metric under its own name, then
    the provenance fields of :data:`PROVENANCE_COLUMNS` prefixed ``prov_`` (``prov_commit``,
    ``prov_device``, ...), and ``path``. Raises
    ``FileNotFoundError`` when there is nothing to collect (an empty frame would hide a typo).
    """
    root = Path(directory) if directory is not None else results_dir()
    if chapter is not None:
        _check_name("chapter", chapter)
    pattern = f"{chapter}/*.json" if chapter is not None else "*/*.json"
    paths = sorted(root.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no results match {root / pattern}")
    rows = []
    for path in paths:
        record = json.loads(path.read_text())
        missing = {"chapter", "run_id", "parameters", "metrics", "provenance"} - set(record)
        if missing:
            raise ValueError(f"{path} is not a rqlib result (missing {sorted(missing)})")
        row: dict[str, Any] = {"chapter": record["chapter"], "run_id": record["run_id"]}
        row.update(record["parameters"])
        row.update(record["metrics"])
        for key in PROVENANCE_COLUMNS:
            row[f"prov_{key}"] = record["provenance"].get(key)
        row["path"] = str(path)
        rows.append(row)
    return pd.DataFrame(rows)


class _Text(str):
    """A string whose repr is itself, so that a glued string appears without quotes."""

    def __repr__(self) -> str:
        return str(self)


def glue_metrics(metrics: Mapping[str, Any], *, prefix: str = "") -> None:
    """Glue every metric into the page (``{glue:text}`<prefix><name>:.2f```) without showing it.

    The names become myst-nb glue keys, so prose can quote the numbers with a format spec
    instead of typing them. Strings are glued as plain text (no quotes).
    """
    from myst_nb import glue

    for name, value in metrics.items():
        value = _plain(value, f"metrics[{name!r}]")
        glue(f"{prefix}{name}", _Text(value) if isinstance(value, str) else value, display=False)
