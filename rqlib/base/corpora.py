"""Text corpora for evaluation and calibration, with their provenance.

- ``"wikitext-2"``: the test split of wikitext-2-raw-v1, the evaluation text. Looked up in
  this order: ``$RQLIB_WIKITEXT2`` (a path to a ``wiki.test.raw``; recorded with its sha256,
  whatever it holds), the copy shipped in the repository (``data/wikitext-2/wiki.test.raw``,
  CC BY-SA 3.0, see its README; its sha256 is checked at every load), then the Hugging Face hub
  through the ``datasets`` package.
- ``"wikitext-2-validation"``, ``"wikitext-2-train"``: the other splits, from the hub only
  (``datasets``, network on first use; ``datasets`` caches them).
- ``"pydoc"``: the help topics that ship with CPython (``pydoc_data.topics``), about 113k tokens
  of English: always available; the calibration corpus (never used for evaluation numbers).

Every text from wikitext-2 has the same layout: the non-empty rows of the split, in order, one
per line, so the hub's test split and the shipped file are the same text (same sha256).
A corpus's ``source`` says where it came from without an absolute machine path (it is
written into results that are committed): the repository-relative path of the shipped copy,
``$RQLIB_WIKITEXT2`` with the file's name, or the hub dataset.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from rqlib.base.files import CorruptFileError
from rqlib.base.paths import CHECKOUT, env_path

__all__ = [
    "CORPORA",
    "Corpus",
    "CorpusUnavailableError",
    "WIKITEXT2_SHA256",
    "load_corpus",
    "tokenize_corpus",
]

#: The shipped copy of wikitext-2's test split and its sha256.
SHIPPED_WIKITEXT2 = CHECKOUT / "data" / "wikitext-2" / "wiki.test.raw"
WIKITEXT2_SHA256 = "bbf94c53a05abe9ee670d3b6343608095822c85e26de37c70b24fc571964574a"
WIKITEXT2_ENV = "RQLIB_WIKITEXT2"
#: corpus name -> the split of wikitext-2-raw-v1 it is
WIKITEXT2_SPLITS = {
    "wikitext-2": "test",
    "wikitext-2-validation": "validation",
    "wikitext-2-train": "train",
}
CORPORA = (*WIKITEXT2_SPLITS, "pydoc")


class CorpusUnavailableError(FileNotFoundError):
    """A corpus that cannot be found here, with what to do about it."""


@dataclass(frozen=True)
class Corpus:
    """A text and where it came from: ``source`` (a description, no machine path) and its
    sha256."""

    name: str
    text: str
    source: str
    sha256: str

    def provenance(self) -> dict[str, str]:
        """Name, source and sha256 as a JSON-ready dict (no text)."""
        return {"name": self.name, "source": self.source, "sha256": self.sha256}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise CorruptFileError(path, f"not UTF-8 text: {error.reason}") from None


def _from_hub(name: str) -> Corpus:
    split = WIKITEXT2_SPLITS[name]
    try:
        import datasets
    except ModuleNotFoundError:
        raise CorpusUnavailableError(
            f"{name} comes from the Hugging Face hub through the `datasets` package, which is "
            "not installed (it is a dependency of rqlib: pip install -e .)"
        ) from None
    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
    except Exception as error:  # offline, hub down, cache unreadable: say which corpus and why
        raise CorpusUnavailableError(
            f"{name}: loading wikitext/wikitext-2-raw-v1 ({split} split) from the Hugging Face "
            f"hub failed: {type(error).__name__}: {error}"
        ) from error
    text = "".join(row if row.endswith("\n") else row + "\n" for row in rows if row.strip())
    return Corpus(name, text, f"hub:wikitext/wikitext-2-raw-v1/{split} (datasets)", _sha256(text))


def _wikitext2() -> Corpus:
    path = env_path(WIKITEXT2_ENV)
    if path is not None:
        if not path.is_file():
            raise CorpusUnavailableError(f"${WIKITEXT2_ENV} points to {path}, which is not a file")
        text = _read(path)
        return Corpus("wikitext-2", text, f"${WIKITEXT2_ENV} ({path.name})", _sha256(text))
    if SHIPPED_WIKITEXT2.is_file():
        text = _read(SHIPPED_WIKITEXT2)
        digest = _sha256(text)
        if digest != WIKITEXT2_SHA256:
            raise CorruptFileError(
                SHIPPED_WIKITEXT2,
                f"sha256 {digest[:12]}... instead of {WIKITEXT2_SHA256[:12]}...; restore it with "
                "`git checkout -- data/wikitext-2/wiki.test.raw`",
            )
        source = f"{SHIPPED_WIKITEXT2.relative_to(CHECKOUT).as_posix()} (shipped with rqbook)"
        return Corpus("wikitext-2", text, source, digest)
    return _from_hub("wikitext-2")


def _pydoc() -> Corpus:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return Corpus("pydoc", text, "pydoc_data.topics (CPython, sorted topics)", _sha256(text))


def load_corpus(name: str) -> Corpus:
    """Load corpus ``name`` (one of :data:`CORPORA`) with its provenance."""
    if name == "wikitext-2":
        return _wikitext2()
    if name in WIKITEXT2_SPLITS:
        return _from_hub(name)
    if name == "pydoc":
        return _pydoc()
    raise ValueError(f"unknown corpus {name!r}; known: {list(CORPORA)}")


def tokenize_corpus(corpus: Corpus, tokenizer, n_tokens: int | None = None):
    """The corpus as one ``int64`` tensor of token ids (no BOS), truncated to ``n_tokens``.

    Raises ``ValueError`` when the corpus has fewer than ``n_tokens`` tokens.
    """
    import torch

    if n_tokens is not None and (
        isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 2
    ):
        raise ValueError(f"n_tokens must be an int >= 2 or None, got {n_tokens!r}")
    ids = tokenizer(corpus.text, add_special_tokens=False)["input_ids"]
    if n_tokens is not None:
        if len(ids) < n_tokens:
            raise ValueError(
                f"{corpus.name} has {len(ids)} tokens, fewer than the {n_tokens} asked for"
            )
        ids = ids[:n_tokens]
    return torch.tensor(ids, dtype=torch.long)
