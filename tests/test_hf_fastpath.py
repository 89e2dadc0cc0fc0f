"""The path a user runs: ``generate()`` through the fused attention, on tiny random models.

The presets' storage format (TurboQuant-MSE keys and values, per-head key centering on pydoc,
norm correction, 11-bit norms, first token exact, the recent band as 8-bit codes) with per-layer
bits chosen by the presets' own allocation (:func:`rqlib.study.allocation.allocate`) from a
synthetic sensitivity table (a tiny random model has no measured one), on Llama (GQA 2:1),
Gemma 3 (sliding-window layers, which evict) and Qwen2 (GQA 7:1), with a left-padded batch of
two. The Triton kernels run in the interpreter (``cache.set_backend("triton")``: the attention
kernel and the quantize kernel) and must give the same tokens as the torch path.

Logit tolerance. Both paths compute the same sums in fp32 in different orders: attention outputs
agree to ~1e-6 relative (tests/test_kernels_attention.py measures ~4e-7), which a few layers of a
random model with logits of magnitude ~1 amplify to well under 1e-4; a code that flips at a
decision boundary between the two paths (a key within ~1e-7 of a boundary) would move a logit
by ~1e-2 instead, so the test also reports whether the stored codes are identical.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
from transformers import Qwen2Config, Qwen2ForCausalLM

from rqlib.hf import compress
from rqlib.spec.config import CompressionConfig
from rqlib.spec.presets import PRESETS
from rqlib.study.allocation import KEY_BITS, VALUE_BITS, Sensitivity, allocate

pytestmark = pytest.mark.interpreter

VOCAB = 256
LOGIT_TOL = 1e-4


class ByteTokenizer:
    """Bytes as token ids (vocabulary 256): the calibration tokenizer of the tiny models."""

    name_or_path = "bytes"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


def tiny_model(kind: str, seed: int) -> torch.nn.Module:
    """A small random model with head_dim 64 (a head dim the kernels serve), eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, intermediate_size=64, max_position_embeddings=128)
    if kind == "llama":
        config = LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, **common,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    elif kind == "gemma3":
        config = Gemma3TextConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=64,
            **common,
        )  # fmt: skip
        model = Gemma3ForCausalLM(config)
    else:
        config = Qwen2Config(
            hidden_size=56, num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=1,
            head_dim=64, **common,
        )  # fmt: skip
        model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def preset_config(name: str, model) -> CompressionConfig:
    """The preset resolved by its allocation against a synthetic sensitivity table
    (KL = 4^-bits times a per-item weight), so that layers get different bits."""
    n_layers = model.config.num_hidden_layers
    kl = {}
    for layer in range(n_layers):
        for kind, bits_list in (("key", KEY_BITS), ("value", VALUE_BITS)):
            weight = 1.0 + layer + (kind == "key")
            for bits in bits_list:
                kl[(kind, layer, bits)] = weight * 4.0**-bits
    table = Sensitivity("synthetic", "none", n_layers, {}, 0, 0, kl)
    config = CompressionConfig.parse(f"preset:{name}").replace(calibration_tokens=512)
    return allocate(table, config, model.config).replace(name=f"preset:{name}")


def stored_codes(cache) -> list[torch.Tensor]:
    """Every stored code and norm byte of every layer (to see whether a code flipped)."""
    out = []
    for layer in cache.layers:
        for stream in layer.streams.values():
            for ring in stream.rings:
                out.extend(t.clone() for name, t in sorted(ring.buffers.items()) if name != "exact")
    return out


def run(model, config, ids, mask, backend: str):
    options = dict(
        max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        cache.set_backend(backend)
        out = model.generate(ids, attention_mask=mask, cache=cache, **options)
        codes = stored_codes(cache)
    return out.sequences, torch.stack(out.logits, 1), codes


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen2"])
def test_generate_through_the_kernels_matches_the_torch_path(kind, preset, rng):
    model = tiny_model(kind, int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    config = preset_config(preset, model)
    assert len(set(config.layer_key_bits + config.layer_value_bits)) > 1
    ids = torch.randint(1, VOCAB, (2, 7), generator=rng)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row is left-padded by 3 tokens
    tokens, logits, codes = run(model, config, ids, mask, "torch")
    kernel_tokens, kernel_logits, kernel_codes = run(model, config, ids, mask, "triton")
    flipped = sum(int((a != b).sum()) for a, b in zip(codes, kernel_codes))
    difference = (kernel_logits - logits).abs().max().item()
    print(f"max logit difference {difference:.2e}; stored bytes that differ: {flipped}")
    assert torch.equal(kernel_tokens, tokens)
    assert math.isfinite(difference) and difference <= LOGIT_TOL
