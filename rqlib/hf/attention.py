"""The attention and mask functions registered with transformers under the name ``"rqlib"``.

Models whose attention goes through ``AttentionInterface`` (Llama, Qwen2, Gemma3, ...) call
``attention_interface(module, query, key, value, attention_mask, scaling=..., **kwargs)``
right after writing the new keys and values to the cache. :func:`rqlib_attention` looks up
the :class:`~rqlib.hf.cache.CompressedCache` installed for that module by
:func:`rqlib.hf.compress` and lets the layer attend from its compressed contents.

The mask function never builds an ``[Lq, S]`` tensor for the masks transformers itself would
let SDPA skip (plain causal, optionally with a sliding window, plus 2-d padding): it returns a
:class:`~rqlib.kernels.state.CausalMask`, which the attention evaluates block by block (and the
Triton kernel key by key). Any other mask (extra mask functions such as bidirectional image
tokens, packed sequences) is materialized by ``sdpa_mask`` with both "skip" shortcuts disabled:
an explicit boolean mask (True = attend). (With the shortcuts, ``sdpa_mask`` returns ``None``
for plain causal input, meaning "is_causal", which a custom attention must not mistake for "no
mask".)
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)

from rqlib.kernels.state import CausalMask

__all__ = ["ATTENTION_NAME", "register", "rqlib_attention", "rqlib_mask"]

ATTENTION_NAME = "rqlib"

# attention module -> (cache, layer index), filled by compress() for the duration of the block
ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rqlib_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    use_vmap: bool = False,
    **kwargs,
):
    """A :class:`CausalMask` where transformers says the mask is plain causal (it allows the
    causal skip: no extra mask function, no packed sequences), else ``sdpa_mask``'s explicit
    boolean mask."""
    kwargs.pop("allow_is_bidirectional_skip", None)
    plain = allow_is_causal_skip and not use_vmap
    if local_size is None:
        plain = plain and mask_function is causal_mask_function
    if plain and not isinstance(q_offset, torch.Tensor):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        return CausalMask(batch_size, q_offset, q_length, kv_offset, kv_length, local_size, padding)
    mask = sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=use_vmap,
        **kwargs,
    )
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
    if attention_mask is None:
        raise RuntimeError(
            f"layer {layer_idx}: the compressed attention needs a mask (a CausalMask or an "
            "explicit boolean 4-d mask), got None; is the rqlib mask function registered?"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap = softcap if softcap is not None else getattr(module, "attn_logit_softcapping", None)
    output = cache.attend(layer_idx, query, key, attention_mask, scaling, softcap)
    return output, None


_REGISTERED = False


def register() -> None:
    """Register :func:`rqlib_attention` and :func:`rqlib_mask` under ``"rqlib"`` (idempotent)."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTENTION_NAME, rqlib_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, rqlib_mask)
        _REGISTERED = True
