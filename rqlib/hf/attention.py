"""The attention and mask functions registered with transformers under the name ``"rqlib"``.

Models whose attention goes through ``AttentionInterface`` (Llama, Qwen2, Gemma3, ...) call
``attention_interface(module, query, key, value, attention_mask, scaling=..., **kwargs)``
right after writing the new keys and values to the cache. :func:`rqlib_attention` looks up
the :class:`~rqlib.hf.cache.CompressedCache` installed for that module by
:func:`rqlib.hf.compress` and lets the layer attend from its compressed contents.

The mask function is ``sdpa_mask`` with both "skip" shortcuts disabled: it always returns an
explicit boolean mask (True = attend), causal, with the padding and, for sliding-window
layers, the window folded in. (With the shortcuts, ``sdpa_mask`` returns ``None`` for plain
causal input, meaning "is_causal", which a custom attention must not mistake for "no mask".)
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["ATTENTION_NAME", "register", "rqlib_attention", "rqlib_mask"]

ATTENTION_NAME = "rqlib"

# attention module -> (cache, layer index), filled by compress() for the duration of the block
ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rqlib_mask(*args, **kwargs) -> torch.Tensor:
    """``sdpa_mask`` that always materializes the boolean mask (never ``None``)."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    mask = sdpa_mask(*args, **kwargs)
    if mask is None:  # cannot happen with both skips disabled; guard the contract anyway
        raise RuntimeError("sdpa_mask returned None with the skips disabled")
    return mask


def rqlib_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` ``[B, Hq, Lq, d]`` over the compressed cache of ``module``'s layer.

    Returns ``([B, Lq, Hq, d], None)`` like the built-in implementations.
    """
    entry = ACTIVE.get(module)
    if entry is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTENTION_NAME!r} outside an "
            "rqlib.hf.compress(...) block"
        )
    cache, layer_idx = entry
    if dropout:
        raise ValueError("the compressed cache is for inference: dropout must be 0 (call .eval())")
    if attention_mask is None or attention_mask.dim() != 4:
        raise RuntimeError(
            f"layer {layer_idx}: the compressed attention needs an explicit 4-d mask, got "
            f"{None if attention_mask is None else tuple(attention_mask.shape)}"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap = softcap if softcap is not None else getattr(module, "attn_logit_softcapping", None)
    layer = cache.layers[layer_idx]
    output = layer.attend(query, key, attention_mask, scaling, softcap)
    return output, None


_REGISTERED = False


def register() -> None:
    """Register :func:`rqlib_attention` and :func:`rqlib_mask` under ``"rqlib"`` (idempotent)."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTENTION_NAME, rqlib_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, rqlib_mask)
        _REGISTERED = True
