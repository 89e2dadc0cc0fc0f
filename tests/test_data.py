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
    assert corpus.source == "$RQLIB_WIKITEXT2 (wiki.test.raw)"  # no machine path
    assert corpus.text.startswith(" = Title")
    assert corpus.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_wikitext_env_variable_pointing_nowhere_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLIB_WIKITEXT2", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="RQLIB_WIKITEXT2"):
        data.load_corpus("wikitext-2")


def test_missing_wikitext_explains_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("RQLIB_WIKITEXT2", raising=False)
    monkeypatch.setattr(data, "SHIPPED_WIKITEXT2", tmp_path / "absent.raw")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import fails
    with pytest.raises(FileNotFoundError, match="`datasets` package, which is not installed"):
        data.load_corpus("wikitext-2")


def test_shipped_wikitext_is_the_default_and_has_the_documented_checksum(monkeypatch):
    monkeypatch.delenv("RQLIB_WIKITEXT2", raising=False)
    digest = hashlib.sha256(data.SHIPPED_WIKITEXT2.read_bytes()).hexdigest()
    assert digest == data.WIKITEXT2_SHA256
    corpus = data.load_corpus("wikitext-2")
    assert corpus.sha256 == data.WIKITEXT2_SHA256
    assert corpus.source == "data/wikitext-2/wiki.test.raw (shipped with rqbook)"
    for name in ("README.md", "LICENSE"):  # its license and attribution beside it
        assert "CC BY-SA 3.0" in (data.SHIPPED_WIKITEXT2.parent / name).read_text()


def test_a_changed_shipped_copy_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.delenv("RQLIB_WIKITEXT2", raising=False)
    copy = tmp_path / "wiki.test.raw"
    copy.write_bytes(data.SHIPPED_WIKITEXT2.read_bytes()[:-10])  # truncated
    monkeypatch.setattr(data, "SHIPPED_WIKITEXT2", copy)
    with pytest.raises(ValueError, match=rf"{copy}.*sha256"):
        data.load_corpus("wikitext-2")


def test_hub_splits_use_datasets_with_the_shipped_layout(tmp_path, monkeypatch):
    """The hub path (faked: no network here) keeps the non-empty rows, one per line; the
    test split from the hub is then the same text as the shipped copy."""
    import sys
    import types

    shipped = data.SHIPPED_WIKITEXT2.read_text(encoding="utf-8")
    rows = []
    for line in shipped.splitlines(keepends=True)[:50]:
        rows += [line, ""]  # the hub's split has empty rows in between
    calls = []

    def load_dataset(path, config, split):
        calls.append((path, config, split))
        return {"text": rows}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    corpus = data.load_corpus("wikitext-2-validation")
    assert calls == [("wikitext", "wikitext-2-raw-v1", "validation")]
    assert corpus.text == "".join(shipped.splitlines(keepends=True)[:50])
    assert corpus.source == "hub:wikitext/wikitext-2-raw-v1/validation (datasets)"

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(FileNotFoundError, match="wikitext-2-train.*ConnectionError: no network"):
        data.load_corpus("wikitext-2-train")


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
