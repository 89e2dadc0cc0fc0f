"""rqlib.hf.models: names, the conversion cache location and its errors (no conversion here:
the real conversions run in tests/test_hf_models.py)."""

from __future__ import annotations

import pytest

from rqlib.hf import models


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLIB_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"


def test_unknown_names_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown packaged model"):
        models.converted_model_dir("llama-7b")
    with pytest.raises(ValueError, match="packaged models"):
        models.load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(TypeError, match="non-empty string"):
        models.load_model("")


def test_an_existing_conversion_is_reused_without_converting(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLIB_CACHE", str(tmp_path))
    target = tmp_path / "smollm2-135m"
    target.mkdir()
    (target / "config.json").write_text("{}")

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_convert", fail)
    assert models.converted_model_dir("smollm2-135m") == target


def test_conversion_happens_once_under_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLIB_CACHE", str(tmp_path))
    calls = []

    def fake_convert(model, target):
        calls.append(model.name)
        target.mkdir()
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert", fake_convert)
    first = models.converted_model_dir("gemma3-270m")
    second = models.converted_model_dir("gemma3-270m")
    assert first == second == tmp_path / "gemma3-270m" and calls == ["gemma3-270m"]
    assert (tmp_path / ".gemma3-270m.lock").exists()
