"""What a compressed cache promises: its bytes, its copies, and equal layers after a failure.

- ``nbytes()`` equals what the bit accounting promises (:func:`rqlib.spec.bits.bytes_per_token`):
  for one sequence of ``context`` tokens (a multiple of 8, so that the 11-bit norm streams are
  whole bytes) of a model in bf16 (the accounting counts exact tokens at 16 bits), the stored
  state plus the calibrated key means counted at 16 bits is exactly ``bytes_per_token * context``.
- A copy (``copy.copy``, ``copy.deepcopy``, pickle) keeps the tokens but refuses to be updated,
  saying why; the original refuses once its block is over.
- A failure in the middle of a forward leaves every layer with the same number of tokens: the
  step is rolled back, at once for a failure inside the cache (non-finite keys), at the next
  step otherwise (with a warning), and the next steps give the logits of a cache that never saw
  the failed step.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from tiny_models import ByteTokenizer, preset_config, tiny_model

from rqlib.hf import compress
from rqlib.spec.bits import bytes_per_token
from rqlib.spec.geometry import model_geometry


def seed_of(rng) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nbytes_equal_the_bit_accounting(dtype, rng):
    model = tiny_model("llama", seed_of(rng)).to(dtype)
    config = preset_config("rq-3", model)
    context = 136
    ids = torch.randint(1, 256, (1, context), generator=rng)
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        stored = cache.nbytes()
        assert cache.reserved_nbytes() >= stored
    geometry = model_geometry(model)
    per_layer_head = geometry.kv_heads * geometry.head_dim
    means = geometry.layers * per_layer_head * 2  # key means (ctr), counted at 16 bits
    promised = bytes_per_token(config, model.config, context) * context
    sink = config.n_sink * 2 * geometry.layers * per_layer_head  # sink key and value coordinates
    extra = sink * (torch.finfo(dtype).bits - 16) // 8  # exact tokens kept in the model dtype
    print(f"stored {stored} bytes, promised {promised:.1f} (+ {extra} for fp32 exact tokens)")
    assert stored + means == pytest.approx(promised + extra, rel=0, abs=1e-6)


def decode_logits(model, config, ids, steps_ids):
    """Prefill ``ids``, then feed each of ``steps_ids`` one at a time; the last logits."""
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        logits = [model(token, cache=cache).logits for token in steps_ids]
    return torch.cat(logits, 1)


@pytest.fixture
def setting(rng):
    model = tiny_model("llama", seed_of(rng))
    config = preset_config("rq-3.5", model)
    ids = torch.randint(1, 256, (1, 12), generator=rng)
    steps = [torch.randint(1, 256, (1, 1), generator=rng) for _ in range(3)]
    return model, config, ids, steps


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copy_keeps_the_tokens_and_refuses_updates(setting, how):
    model, config, ids, steps = setting
    duplicate = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda c: pickle.loads(pickle.dumps(c)),
    }[how]
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        twin = duplicate(cache)
        assert twin.get_seq_length() == cache.get_seq_length() == 12
        assert twin.nbytes() == cache.nbytes()
        buffers = cache.layers[0].streams["keys"].rings[0].buffers["codes"]
        twin_buffers = twin.layers[0].streams["keys"].rings[0].buffers["codes"]
        assert torch.equal(buffers, twin_buffers) and buffers.data_ptr() != twin_buffers.data_ptr()
        with pytest.raises(RuntimeError, match="it is a copy"):
            model(steps[0], cache=twin)
        assert cache.get_seq_length() == 12  # the failed call touched neither cache
        model(steps[0], cache=cache)  # the original still works in its block
    with pytest.raises(RuntimeError, match="outside its rqlib.hf.compress"):
        model(steps[1], cache=cache)
    with pytest.raises(RuntimeError, match="it is a copy"):
        model(steps[1], cache=twin)


def lengths(cache) -> set[int]:
    return {layer.length for layer in cache.layers}


def test_non_finite_keys_roll_the_step_back(setting):
    model, config, ids, steps = setting
    expected = decode_logits(model, config, ids, steps)
    layer = model.model.layers[1].self_attn.k_proj
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        model(steps[0], cache=cache)
        handle = layer.register_forward_hook(lambda m, i, out: out * float("nan"))
        with pytest.raises(ValueError, match="NaN or infinite") as error:
            model(steps[1], cache=cache)
        handle.remove()
        assert "rolled back to 13 tokens" in str(error.value.__notes__)
        assert lengths(cache) == {13} and cache.get_seq_length() == 13
        logits = [model(token, cache=cache).logits for token in steps[1:]]
    got = torch.cat([expected[:, :1]] + logits, 1)
    assert (got - expected).abs().max().item() <= 1e-5  # same state as never failed


def test_a_failure_between_layers_is_rolled_back_at_the_next_step(setting):
    model, config, ids, steps = setting
    expected = decode_logits(model, config, ids, steps)

    def boom(module, inputs, output):
        raise KeyError("boom")

    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        model(steps[0], cache=cache)
        handle = model.model.layers[0].mlp.register_forward_hook(boom)  # after layer 0 updated
        with pytest.raises(KeyError, match="boom"):
            model(steps[1], cache=cache)
        handle.remove()
        assert lengths(cache) == {13, 14}  # layer 0 stored the token, layer 1 did not
        assert cache.get_seq_length() == 13  # what the next forward starts from
        with pytest.warns(RuntimeWarning, match="rolled back so that every layer holds 13"):
            logits = [model(token, cache=cache).logits for token in steps[1:]]
        assert lengths(cache) == {15}
    got = torch.cat([expected[:, :1]] + logits, 1)
    assert (got - expected).abs().max().item() <= 1e-5


def test_a_failing_attention_rolls_the_step_back(setting, monkeypatch):
    model, config, ids, steps = setting
    from rqlib.hf.cache import CompressedLayer

    original = CompressedLayer.attend

    def failing(self, *args, **kwargs):
        if self.layer_idx == 1:
            raise RuntimeError("kernel failed")
        return original(self, *args, **kwargs)

    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        monkeypatch.setattr(CompressedLayer, "attend", failing)
        with pytest.raises(RuntimeError, match="kernel failed") as error:
            model(steps[0], cache=cache)
        monkeypatch.setattr(CompressedLayer, "attend", original)
        assert "rolled back to 12 tokens" in str(error.value.__notes__)
        assert lengths(cache) == {12}
        model(steps[0], cache=cache)
        assert lengths(cache) == {13}
