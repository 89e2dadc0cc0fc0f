"""``rqlib.compress(model, "preset:rq-3.5", tokenizer=tok)``: one call resolves the budget and
installs the cache (the README's first example).

The tiny model and its tokens are drawn from ``rng``; the checks are structural or exact, so no
test here fails by chance (false-failure rate 0).
"""

from __future__ import annotations

import pytest
import torch
from test_hf import ByteTokenizer, seed_of, tiny_model

import rqlib
from rqlib.hf import compress as install_cache
from rqlib.study import allocation


@pytest.fixture
def quick_measurement(monkeypatch, tmp_path):
    """Sensitivity tables measured on 32 calibration tokens, cached in a fresh folder."""
    monkeypatch.setenv("RQLIB_CACHE", str(tmp_path))
    measure = allocation.measure_sensitivity

    def on_few_tokens(*args, **kwargs):
        kwargs.update(tokens=32, progress=False)
        return measure(*args, **kwargs)

    monkeypatch.setattr(allocation, "measure_sensitivity", on_few_tokens)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_call_installs_a_preset(kind, rng, quick_measurement):
    model = tiny_model(kind, seed_of(rng))
    tokenizer = ByteTokenizer()
    ids = torch.randint(0, 256, (1, 24), generator=rng)
    # the lower layer alone refuses a budget, naming the one call
    with pytest.raises(ValueError, match=r"rqlib\.compress\(model, config"):
        with install_cache(model, "preset:rq-3.5", tokenizer=tokenizer):
            pass
    with torch.no_grad():
        exact = model(ids).logits
        with rqlib.compress(model, "preset:rq-3.5", tokenizer=tokenizer, progress=False) as cache:
            one_call = model(ids, cache=cache).logits
            installed = cache.config
        resolved = allocation.resolve("preset:rq-3.5", model, tokenizer, progress=False)
        with install_cache(model, resolved, tokenizer=tokenizer) as cache:
            two_steps = model(ids, cache=cache).logits
    assert installed == resolved and installed.budget is None
    # the same resolved config and calibration give the same numbers: exactly equal
    assert torch.equal(one_call, two_steps)
    # and the cache is really in use: compressed keys move the logits
    assert not torch.equal(one_call, exact)
    assert model.config._attn_implementation == "sdpa"  # restored after the block
