"""rqlib.base.corpora: corpora with provenance, the lookup order and its errors."""

from __future__ import annotations

import hashlib

import pytest

from rqlib.base import corpora as data


def test_pydoc_is_always_available():
    corpus = data.load_corpus("pydoc")
    assert len(corpus.text) > 100_000
    assert corpus.sha256 == hashlib.sha256(corpus.text.encode()).hexdigest()
    assert corpus.provenance() == {
        "name": "pydoc",
        "source": corpus.source,
        "sha256": corpus.sha256,
    }


def test_wikitext_env_variable_wins(tmp_path, monkeypatch):
    path = tmp_path / "wiki.test.raw"
    path.write_text(" = Title = \n some text \n", encoding="utf-8")
    monkeypatch.setenv("RQLIB_WIKITEXT2", str(path))
    corpus = data.load_corpus("wikitext-2")
    assert corpus.source == str(path) and corpus.text.startswith(" = Title")


def test_wikitext_env_variable_pointing_nowhere_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLIB_WIKITEXT2", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="RQLIB_WIKITEXT2"):
        data.load_corpus("wikitext-2")


def test_missing_wikitext_explains_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("RQLIB_WIKITEXT2", raising=False)
    monkeypatch.setattr(data, "SHARED_WIKITEXT2", tmp_path / "absent.raw")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import fails
    with pytest.raises(FileNotFoundError, match="pip install datasets"):
        data.load_corpus("wikitext-2")


def test_shared_wikitext_has_the_documented_checksum():
    if not data.SHARED_WIKITEXT2.is_file():
        pytest.fail(f"{data.SHARED_WIKITEXT2} is missing")
    digest = hashlib.sha256(data.SHARED_WIKITEXT2.read_bytes()).hexdigest()
    assert digest == "bbf94c53a05abe9ee670d3b6343608095822c85e26de37c70b24fc571964574a"


def test_unknown_corpus_and_bad_token_counts_raise():
    with pytest.raises(ValueError, match="unknown corpus"):
        data.load_corpus("ptb")

    class Tokenizer:
        def __call__(self, text, add_special_tokens):
            return {"input_ids": list(range(5))}

    corpus = data.Corpus("x", "abc", "test", "0")
    assert data.tokenize_corpus(corpus, Tokenizer(), 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="fewer than"):
        data.tokenize_corpus(corpus, Tokenizer(), 6)
    with pytest.raises(ValueError, match="n_tokens"):
        data.tokenize_corpus(corpus, Tokenizer(), 1)
