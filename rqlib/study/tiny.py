"""Tiny random models the kernels serve, and the presets resolved for them without a measured
sensitivity table: what the tests and ``python -m rqlib bench gpu`` run the fused path on.

Each model is built from a config (no download) with head_dim 64; its calibration tokenizer is
:class:`ByteTokenizer` (bytes as token ids). :func:`preset_config` resolves a preset by its own
allocation (:func:`rqlib.study.allocation.allocate`) against a synthetic sensitivity table, so
that layers get different bits as a measured table would give them.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rqlib.spec.config import CompressionConfig
from rqlib.study.allocation import KEY_BITS, VALUE_BITS, Sensitivity, allocate

VOCAB = 256


class ByteTokenizer:
    """Bytes as token ids (vocabulary 256): the calibration tokenizer of the tiny models."""

    name_or_path = "bytes"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


KINDS = ("llama", "gemma3", "qwen2")


def tiny_model(kind: str, draw: int) -> torch.nn.Module:
    """A small random model with head_dim 64 (a head dim the kernels serve), eval mode."""
    if kind not in KINDS:
        raise ValueError(f"no tiny model {kind!r}; the kinds are {', '.join(KINDS)}")
    torch.manual_seed(draw)
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


def synthetic_sensitivity(n_layers: int) -> Sensitivity:
    """A sensitivity table with KL = 4^-bits times a per-item weight that grows with the layer
    (keys weigh more), so that an allocation gives layers different bits."""
    kl = {}
    for layer in range(n_layers):
        for kind, bits_list in (("key", KEY_BITS), ("value", VALUE_BITS)):
            weight = 1.0 + layer + (kind == "key")
            for bits in bits_list:
                kl[(kind, layer, bits)] = weight * 4.0**-bits
    return Sensitivity("synthetic", "none", n_layers, {}, 0, 0, kl)


def preset_config(name: str, model) -> CompressionConfig:
    """The preset resolved by its allocation against :func:`synthetic_sensitivity`."""
    table = synthetic_sensitivity(model.config.num_hidden_layers)
    config = CompressionConfig.parse(f"preset:{name}").replace(calibration_tokens=512)
    return allocate(table, config, model.config).replace(name=f"preset:{name}")
