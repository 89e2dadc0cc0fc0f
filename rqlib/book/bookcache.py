"""The book's execution cache follows what the chapters read, not only their code.

Jupyter Book (myst-nb, ``execute_notebooks: cache``) re-executes a chapter only when the
chapter's code cells change: it keys its cache (``_build/.jupyter_cache``) on them. A chapter
that reads results files, or numbers computed by the library, would then keep showing the
numbers of its last execution after new results land or the library changes.

This Sphinx extension (``sphinx: extra_extensions: [rqlib.book.bookcache]`` in
``_config.yml``) closes the gap. When a build starts, it computes for each chapter a digest of
its inputs:

- the library's code fingerprint (:func:`rqlib.book.provenance.code_fingerprint`);
- ``$RQLIB_WIKITEXT2``'s file, when that variable moves the evaluation text;
- the results files the chapter reads (:data:`CHAPTER_INPUTS`, globs relative to the results
  folder, :func:`rqlib.book.results.results_dir`), by content.

It compares them with the digests recorded at the previous build (``rqlib-inputs.json`` in the
cache folder), removes the cache records of every chapter whose inputs changed and tells
Sphinx to read it again (``env-get-outdated``), so that myst-nb executes it again. The
Sphinx config value ``rqlib_chapter_inputs`` replaces :data:`CHAPTER_INPUTS`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rqlib.base.files import atomic_write_text
from rqlib.base.paths import env_path
from rqlib.book.provenance import code_fingerprint
from rqlib.book.results import results_dir

__all__ = ["CHAPTER_INPUTS", "STAMP", "inputs_digest", "invalidate", "setup"]

#: chapter -> globs of the results files it reads (relative to the results folder).
CHAPTER_INPUTS: dict[str, tuple[str, ...]] = {
    "04_perplexity": ("*.json", "headline/*.json", "04_perplexity/*.json"),
    "05_sweeps": ("04_perplexity/*.json", "04_perplexity/*.parquet", "cluster-sweep/*.txt"),
    "06_bound": (
        "eval-*.json",  # its runs, and every earlier run a run of the band stored once repeats
        "headline/*.json",
    ),
}
#: The file in the cache folder recording each chapter's input digest at the last build.
STAMP = "rqlib-inputs.json"


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def inputs_digest(patterns: tuple[str, ...], results: Path | None = None) -> str:
    """A sha256 over the library's code fingerprint, ``$RQLIB_WIKITEXT2``'s file and the
    files matching ``patterns`` under ``results`` (paths and contents)."""
    results = results_dir() if results is None else Path(results)
    digest = hashlib.sha256(f"code {code_fingerprint()}\n".encode())
    wikitext = env_path("RQLIB_WIKITEXT2")
    if wikitext is not None and wikitext.is_file():
        digest.update(f"wikitext {_file_digest(wikitext)}\n".encode())
    files = sorted({path for pattern in patterns for path in results.glob(pattern)})
    for path in files:
        if path.is_file():
            digest.update(f"{path.relative_to(results).as_posix()} {_file_digest(path)}\n".encode())
    return digest.hexdigest()


def _stamp(cache: Path) -> dict[str, str]:
    try:
        stamp = json.loads((cache / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def invalidate(
    cache: Path | str,
    chapters: dict[str, tuple[str, ...]],
    results: Path | None = None,
) -> list[str]:
    """Remove the cache records of the chapters whose inputs changed since the last call;
    return their names. Every chapter in the cache counts, with the results files
    ``chapters`` lists for it (none for a chapter it does not name); a chapter seen for the
    first time counts as changed."""
    cache = Path(cache)
    records = []
    if (cache / "global.db").is_file():
        from jupyter_cache import get_cache

        jupyter_cache = get_cache(str(cache))
        records = jupyter_cache.list_cache_records()
    names = set(chapters) | {Path(record.uri).stem for record in records}
    previous = _stamp(cache)
    current = {name: inputs_digest(chapters.get(name, ()), results) for name in sorted(names)}
    changed = sorted(name for name in current if previous.get(name) != current[name])
    for record in records:
        if Path(record.uri).stem in changed:
            jupyter_cache.remove_cache(record.pk)
    cache.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cache / STAMP, json.dumps({**previous, **current}, indent=1) + "\n")
    return changed


def _on_builder_inited(app) -> None:
    from sphinx.util import logging

    cache = app.config.nb_execution_cache_path or str(Path(app.outdir).parent / ".jupyter_cache")
    cache = Path(cache)
    if not cache.is_absolute():
        cache = Path(app.confdir) / cache
    changed = invalidate(cache, dict(app.config.rqlib_chapter_inputs))
    app.env.rqlib_changed_chapters = changed
    if changed:
        logging.getLogger(__name__).info(
            f"rqlib: inputs changed for {', '.join(changed)}: executed again"
        )


def _outdated(app, env, added, changed, removed) -> list[str]:
    """Sphinx re-reads only changed sources: name the chapters whose inputs changed too."""
    chapters = set(getattr(env, "rqlib_changed_chapters", []))
    return sorted(doc for doc in env.found_docs if Path(doc).name in chapters)


def setup(app) -> dict:
    """The Sphinx extension entry point."""
    app.add_config_value("rqlib_chapter_inputs", CHAPTER_INPUTS, "env")
    app.connect("builder-inited", _on_builder_inited)
    app.connect("env-get-outdated", _outdated)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
