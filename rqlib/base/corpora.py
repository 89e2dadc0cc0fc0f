"""Text corpora for evaluation and calibration, with their provenance.

- ``"wikitext-2"``: the test split of wikitext-2-raw-v1. Looked up in this order:
  ``$RQLIB_WIKITEXT2`` (a path to ``wiki.test.raw``),
  ``../shared/data/wikitext-2-raw/wiki.test.raw`` relative to the repository root, then the
  ``datasets`` package.
- ``"pydoc"``: the help topics that ship with CPython (``pydoc_data.topics``), about 113k tokens
  of English: always available; the calibration corpus (never used for evaluation numbers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from rqlib.base.paths import CHECKOUT, env_path

__all__ = ["CORPORA", "Corpus", "load_corpus", "tokenize_corpus"]

SHARED_WIKITEXT2 = CHECKOUT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
CORPORA = ("wikitext-2", "pydoc")


@dataclass(frozen=True)
class Corpus:
    """A text and where it came from: ``source`` (a path or a description) and its sha256."""

    name: str
    text: str
    source: str
    sha256: str

    def provenance(self) -> dict[str, str]:
        """Name, source and sha256 as a JSON-ready dict (no text)."""
        return {"name": self.name, "source": self.source, "sha256": self.sha256}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _from_file(name: str, path: Path) -> Corpus:
    text = path.read_text(encoding="utf-8")
    return Corpus(name, text, str(path), _sha256(text))


def _wikitext2() -> Corpus:
    path = env_path("RQLIB_WIKITEXT2")
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"$RQLIB_WIKITEXT2 points to {path}, which is not a file")
        return _from_file("wikitext-2", path)
    if SHARED_WIKITEXT2.is_file():
        return _from_file("wikitext-2", SHARED_WIKITEXT2)
    try:
        import datasets
    except ModuleNotFoundError as error:
        raise FileNotFoundError(
            "wikitext-2 not found: set $RQLIB_WIKITEXT2 to a copy of wiki.test.raw "
            f"(wikitext-2-raw-v1, test split), place it at {SHARED_WIKITEXT2}, or "
            "`pip install datasets` to download it from the Hugging Face hub"
        ) from error
    rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    # Same layout as the shared file: the non-empty rows, in order, one per line.
    text = "".join(row if row.endswith("\n") else row + "\n" for row in rows if row.strip())
    return Corpus("wikitext-2", text, "datasets:wikitext/wikitext-2-raw-v1/test", _sha256(text))


def _pydoc() -> Corpus:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return Corpus("pydoc", text, "pydoc_data.topics (CPython, sorted topics)", _sha256(text))


def load_corpus(name: str) -> Corpus:
    """Load corpus ``name`` (one of :data:`CORPORA`) with its provenance."""
    if name == "wikitext-2":
        return _wikitext2()
    if name == "pydoc":
        return _pydoc()
    raise ValueError(f"unknown corpus {name!r}; known: {list(CORPORA)}")


def tokenize_corpus(corpus: Corpus, tokenizer, n_tokens: int | None = None):
    """The corpus as one ``int64`` tensor of token ids (no BOS), truncated to ``n_tokens``.

    Raises ``ValueError`` when the corpus has fewer than ``n_tokens`` tokens.
    """
    import torch

    if n_tokens is not None and (not isinstance(n_tokens, int) or n_tokens < 2):
        raise ValueError(f"n_tokens must be an int >= 2 or None, got {n_tokens!r}")
    ids = tokenizer(corpus.text, add_special_tokens=False)["input_ids"]
    if n_tokens is not None:
        if len(ids) < n_tokens:
            raise ValueError(f"{corpus.name} has {len(ids)} tokens, fewer than n_tokens={n_tokens}")
        ids = ids[:n_tokens]
    return torch.tensor(ids, dtype=torch.long)
