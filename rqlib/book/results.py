"""Chapter results on disk: one JSON file per run, gathered back into a DataFrame.

A chapter executed with a non-empty ``run_id`` parameter (the sweep sets one per
combination) calls :func:`save_result`, which writes ``results/<chapter>/<run_id>.json`` with
the run's parameters, its metrics and its provenance; large tables go next to it as parquet.
:func:`collect` reads them all back, one row per run, parameters and metrics as columns.
:func:`glue_metrics` hands numbers to the book's prose through myst-nb ``glue``, so that no
number in the text is typed by hand.

Nothing is lost or silently replaced:

- every file is written atomically (a reader sees the old file or the new one);
- a run is replaced only by a run with the same parameters (the same run at other code):
  saving another run under an existing ``run_id`` raises ``FileExistsError`` naming the file;
- a run made from a tree with uncommitted code changes (provenance commit ``...-dirty``) is
  saved as ``<run_id>.dirty.json``, a name the repository's ``.gitignore`` keeps out of
  committed results; a clean run of the same ``run_id`` replaces it;
- :func:`collect` reports (warning) and skips every file it cannot read, naming each, and
  with ``current_code_only=True`` refuses runs made at other code or from a dirty tree
  (:class:`StaleResultsError` lists them with the fingerprints).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from rqlib.base.files import CorruptFileError, atomic_output, atomic_write_text, read_json
from rqlib.base.paths import env_path, repo_root
from rqlib.book.provenance import chapter_fingerprint, code_fingerprint

__all__ = [
    "PROVENANCE_COLUMNS",
    "ResultFileWarning",
    "StaleResultsError",
    "collect",
    "common_provenance",
    "glue_metrics",
    "metric_label",
    "results_dir",
    "save_result",
]

#: Environment variable that moves the results folder (default: ``<repo>/results``).
RESULTS_DIR_ENV = "RQLIB_RESULTS_DIR"

#: Provenance fields :func:`collect` returns as ``prov_<field>`` columns.
PROVENANCE_COLUMNS = (
    "model",
    "weights",
    "corpus",
    "corpus_sha256",
    "tokens",
    "device",
    "commit",
    "code",
    "chapter_code",
)
#: How the book names the metrics a chapter saves, in tables, axes and prose.
METRIC_LABELS = {
    "delta_ppl_pct": "ΔPPL %",
    "kl": "KL (nats)",
    "top1": "top-1",
    "bits_mean": "bits per K+V coord.",
}


def metric_label(metric: str) -> str:
    """The name the book gives ``metric`` (:data:`METRIC_LABELS`), else the column's own."""
    return METRIC_LABELS.get(metric, metric)


#: What makes two runs comparable: the same model, weights, text and number of tokens.
CONTENT_COLUMNS = ("prov_model", "prov_weights", "prov_corpus_sha256", "prov_tokens")
DIRTY_SUFFIX = ".dirty"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")
_SCALAR = (str, int, float, bool, type(None))


class ResultFileWarning(UserWarning):
    """A results file that :func:`collect` skipped (the message names it and says why)."""


class StaleResultsError(ValueError):
    """Runs made at another code state or from a dirty tree, where only current runs count."""


def results_dir() -> Path:
    """The results folder: ``$RQLIB_RESULTS_DIR`` when set, else ``<repo>/results``."""
    return env_path(RESULTS_DIR_ENV) or repo_root() / "results"


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name.endswith(DIRTY_SUFFIX):
        raise ValueError(
            f"{kind} must be a non-empty file-name-safe string (letters, digits, '._=+-', "
            f"not starting with a punctuation mark, not ending in {DIRTY_SUFFIX!r}), got {name!r}"
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


def _is_dirty(provenance: Mapping) -> bool:
    return str(provenance.get("commit", "")).endswith("-dirty")


def _remove_run(folder: Path, stem: str) -> None:
    """Delete a run's JSON and its tables (a superseded ``.dirty`` run)."""
    for path in [folder / f"{stem}.json", *folder.glob(f"{_glob_escape(stem)}.*.parquet")]:
        path.unlink(missing_ok=True)


def _glob_escape(text: str) -> str:
    """``text`` with the glob metacharacters ``*?[`` escaped."""
    return re.sub(r"([*?\[])", r"[\1]", text)


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
    """Write one run's results to ``<directory>/<chapter>/<run_id>.json`` and return the path
    (``<run_id>.dirty.json`` when the provenance's commit is ``-dirty``).

    Args:
        chapter: the chapter's notebook stem, e.g. ``"04_perplexity"``; the code cells of
            ``notebooks/<chapter>.ipynb`` are fingerprinted into the provenance
            (``chapter_code``).
        run_id: the run's name (the sweep derives it from the combination of parameters).
        parameters: the notebook's parameters for this run.
        metrics: scalar results (numbers or strings), the columns :func:`collect` returns.
        provenance: a :class:`rqlib.book.provenance.Provenance` (or its ``to_dict()``).
        tables: optional larger tables, written as ``<stem>.<name>.parquet`` beside the JSON.
        directory: the results folder (default :func:`results_dir`).

    Raises ``FileExistsError`` naming the file when it holds a run with other parameters.
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
    for name, frame in (tables or {}).items():
        _check_name("table name", name)
        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"tables[{name!r}] must be a pandas DataFrame")
    plain_parameters = _plain(dict(parameters), "parameters")
    prov = dict(prov)
    prov.setdefault("chapter_code", chapter_fingerprint(_chapter_notebook(chapter)))

    folder = (Path(directory) if directory is not None else results_dir()) / chapter
    dirty = _is_dirty(prov)
    stem = run_id + (DIRTY_SUFFIX if dirty else "")
    path = folder / f"{stem}.json"
    for existing in {path, folder / f"{run_id}.json"}:
        _refuse_other_run(existing, plain_parameters)
    table_files = {}
    for name, frame in (tables or {}).items():
        table_path = folder / f"{stem}.{name}.parquet"
        with atomic_output(table_path) as temporary:
            frame.to_parquet(temporary)
        table_files[name] = table_path.name
    record = {
        "chapter": chapter,
        "run_id": run_id,
        "parameters": plain_parameters,
        "metrics": _plain(dict(metrics), "metrics"),
        "provenance": _plain(prov, "provenance"),
        "tables": table_files,
    }
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    if not dirty:  # a clean run supersedes a local dirty run of the same combination
        _remove_run(folder, run_id + DIRTY_SUFFIX)
    return path


def _chapter_notebook(chapter: str) -> Path:
    try:
        return repo_root() / "notebooks" / f"{chapter}.ipynb"
    except FileNotFoundError:  # rqlib installed outside a checkout: no chapters to hash
        return Path("/nonexistent") / f"{chapter}.ipynb"


def _refuse_other_run(path: Path, parameters: dict) -> None:
    """``FileExistsError`` when ``path`` holds a run with other parameters."""
    if not path.is_file():
        return
    try:
        existing = read_json(path).get("parameters")
    except (CorruptFileError, AttributeError):
        return  # unreadable: replacing it loses nothing
    if existing != parameters:
        changed = sorted(
            name
            for name in set(existing or {}) | set(parameters)
            if (existing or {}).get(name) != parameters.get(name)
        )
        raise FileExistsError(
            f"{path} holds another run with the same run_id (parameters differ: {changed}); "
            "a run is only replaced by a rerun of the same parameters"
        )


def _read_run(path: Path) -> dict:
    """One row of :func:`collect`; ``ValueError`` saying why the file is not a result."""
    record = read_json(path)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    missing = {"chapter", "run_id", "parameters", "metrics", "provenance"} - set(record)
    if missing:
        raise ValueError(f"not a rqlib result (missing {sorted(missing)})")
    for key in ("parameters", "metrics", "provenance"):
        if not isinstance(record[key], dict):
            raise ValueError(f"{key} is not a mapping")
    row: dict[str, Any] = {"chapter": record["chapter"], "run_id": record["run_id"]}
    row.update(record["parameters"])
    row.update(record["metrics"])
    for key in PROVENANCE_COLUMNS:
        row[f"prov_{key}"] = record["provenance"].get(key)
    row["prov_dirty"] = _is_dirty(record["provenance"])
    row["path"] = str(path)
    return row


def collect(
    chapter: str | None = None,
    directory: Path | str | None = None,
    *,
    current_code_only: bool = False,
) -> pd.DataFrame:
    """All saved runs (of one chapter, or of every chapter) as a DataFrame, one row per run.

    Columns: ``chapter``, ``run_id``, then every parameter and metric under its own name, then
    the provenance fields of :data:`PROVENANCE_COLUMNS` prefixed ``prov_`` (``prov_commit``,
    ``prov_code``, ...), ``prov_dirty``, ``current`` (made at the current code from a clean
    tree) and ``path``. A file that cannot be read is skipped with a :class:`ResultFileWarning`
    naming it and saying why; the skipped files are also in ``frame.attrs["skipped"]``.

    With ``current_code_only=True``, :class:`StaleResultsError` lists every run made at another
    code state (library or chapter code) or from a dirty tree, with the command that
    regenerates them. Raises ``FileNotFoundError`` when there is nothing to collect (an empty
    frame would hide a typo).
    """
    root = Path(directory) if directory is not None else results_dir()
    if chapter is not None:
        _check_name("chapter", chapter)
    pattern = f"{chapter}/*.json" if chapter is not None else "*/*.json"
    paths = sorted(root.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no results match {root / pattern}")
    rows, skipped = [], []
    for path in paths:
        try:
            rows.append(_read_run(path))
        except ValueError as error:  # CorruptFileError included
            reason = error.reason if isinstance(error, CorruptFileError) else str(error)
            skipped.append({"path": str(path), "reason": reason})
            warnings.warn(f"skipped {path}: {reason}", ResultFileWarning, stacklevel=2)
    if not rows:
        raise FileNotFoundError(f"no readable results in {root / pattern} (skipped {skipped})")
    frame = pd.DataFrame(rows)
    code = code_fingerprint()
    chapter_codes = {
        name: chapter_fingerprint(_chapter_notebook(name)) for name in frame["chapter"].unique()
    }
    frame["current"] = (
        (frame["prov_code"] == code)
        & (frame["prov_chapter_code"] == frame["chapter"].map(chapter_codes))
        & ~frame["prov_dirty"]
    )
    frame.attrs["skipped"] = skipped
    if current_code_only and not frame["current"].all():
        stale = frame[~frame["current"]]
        lines = [
            f"{row.path}: code {row.prov_code}, chapter code {row.prov_chapter_code}, "
            f"commit {row.prov_commit}"
            for row in stale.itertuples()
        ]
        raise StaleResultsError(
            f"{len(stale)} of {len(frame)} runs were not made at the current code (code "
            f"{code}; chapter code {', '.join(f'{k}: {v}' for k, v in chapter_codes.items())}) "
            "from a clean tree; regenerate them with the sweep command the chapter shows:\n"
            + "\n".join(lines)
        )
    return frame


def common_provenance(frame: pd.DataFrame) -> dict[str, Any]:
    """What every run of ``frame`` (from :func:`collect`) shares: model, weights, corpus
    sha256 and tokens, compared by content (a corpus read from two paths is one corpus);
    ``ValueError`` listing the distinct combinations and a file of each when they differ."""
    missing = [column for column in CONTENT_COLUMNS if column not in frame.columns]
    if missing:
        raise ValueError(f"not a frame from collect(): no columns {missing}")
    groups = frame.groupby(list(CONTENT_COLUMNS), dropna=False)["path"].first()
    if len(groups) != 1:
        listing = "\n".join(
            f"{dict(zip(CONTENT_COLUMNS, key))}: e.g. {path}" for key, path in groups.items()
        )
        raise ValueError(f"the runs mix models, weights or texts:\n{listing}")
    (key,) = groups.index
    return {column.removeprefix("prov_"): value for column, value in zip(CONTENT_COLUMNS, key)}


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
