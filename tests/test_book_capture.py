"""rqlib.hf.capture: the registered attention function that records q, k, v per layer.

The tiny model's weights are drawn from ``rng``; the captures are compared exactly or to float
rounding, so no test here fails by chance (false-failure rate 0).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rqlib.hf.capture import CAPTURE_NAME, capture_attention, capturing_attention


@pytest.fixture
def tiny_llama(rng):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def test_capture_records_every_layer_and_changes_nothing(tiny_llama, rng):
    ids = torch.randint(0, 97, (2, 13), generator=rng)
    with torch.no_grad():
        reference = tiny_llama(ids).logits
        with capture_attention(tiny_llama) as captured:
            assert tiny_llama.config._attn_implementation == CAPTURE_NAME
            logits = tiny_llama(ids).logits
    # the capture calls the stock sdpa function on the same tensors: bit-identical output
    assert torch.equal(logits, reference)
    assert tiny_llama.config._attn_implementation == "sdpa"
    assert captured.captured_layers() == [0, 1, 2]
    assert captured.queries(1).shape == (2, 6, 13, 8)
    assert captured.keys(1).shape == (2, 2, 13, 8)
    assert captured.values(2).shape == (2, 2, 13, 8)
    # the recorded tensors are those attention used: causal sdpa on them (GQA repeated) gives
    # the layer's attention output, so check it reproduces o_proj's input of the last layer
    layer = tiny_llama.model.layers[2].self_attn
    seen = {}
    hook = layer.o_proj.register_forward_hook(lambda m, i, o: seen.setdefault("x", i[0]))
    with torch.no_grad():
        tiny_llama(ids)
    hook.remove()
    q, k, v = captured.queries(2), captured.keys(2), captured.values(2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True
    )
    # float32 sdpa on identical inputs in a different call: rounding differences only
    torch.testing.assert_close(out.transpose(1, 2).reshape(2, 13, 48), seen["x"])


def test_capture_concatenates_calls_and_filters_layers(tiny_llama, rng):
    first = torch.randint(0, 97, (1, 5), generator=rng)
    second = torch.randint(0, 97, (1, 7), generator=rng)
    with torch.no_grad(), capture_attention(tiny_llama, layers=[1]) as captured:
        tiny_llama(first)
        tiny_llama(second)
    assert captured.captured_layers() == [1]
    assert captured.keys(1).shape[-2] == 12
    with pytest.raises(KeyError, match="not captured"):
        captured.keys(0)


def test_model_is_restored_after_an_exception(tiny_llama):
    with pytest.raises(RuntimeError, match="boom"):
        with capture_attention(tiny_llama):
            raise RuntimeError("boom")
    assert tiny_llama.config._attn_implementation == "sdpa"


def test_bad_use_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="out of range"):
        with capture_attention(tiny_llama, layers=[3]):
            pass
    with pytest.raises(TypeError, match="PreTrainedModel"):
        with capture_attention(torch.nn.Linear(2, 2)):
            pass
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="outside capture_attention"):
        capturing_attention(tiny_llama.model.layers[0].self_attn, q, q, q, None)
