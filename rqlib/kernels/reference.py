"""Pure-torch references of the Triton kernels, with identical semantics.

They are the CPU backend of the dispatcher (in float32) and the oracle of the tests (in
float64). Scores come from :mod:`rqlib.core.estimator`, the estimator every torch path of
rqlib uses, which unpacks the stored bits with :mod:`rqlib.core.packing`; they share no code
with the Triton kernels.
"""

from __future__ import annotations

import torch

from rqlib.core.estimator import key_terms, pairwise_scores
from rqlib.core.gqa import expand_kv_heads, fold_queries, unfold_queries


def quantize(quantizer, x: torch.Tensor):
    """The reference quantizer is the torch quantizer itself."""
    return quantizer.quantize(x)


def fused_scores(
    q: torch.Tensor, keys, *, scale: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """scale * (||k|| <R q, c[codes]> + ||r|| gamma/m <S R q, signs>), [B, QH, Lq, S] in dtype.

    ``q`` is [batch, q_heads, q_len, d]; ``keys`` a CompressedVectors of shape
    [batch, kv_heads, kv_len]. No mask is applied. The estimator is
    :func:`rqlib.core.estimator.pairwise_scores`, with each GQA group folded into the rows.
    """
    grouped = fold_queries(q, keys.shape[1])  # [B, KV, G*Lq, d]
    scores = pairwise_scores(grouped, keys, dtype)
    return unfold_queries(scores, q.shape[1]) * scale


def dequantize_values(values, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MSE-compressed values back in the original space: ||v|| R^T c[codes], [B, KV, S, d]."""
    matrix = values.quantizer.rotation.matrix.to(values.norms.device, dtype)
    return key_terms(values, dtype)[0] @ matrix


def decode_attention(
    q: torch.Tensor,
    keys,
    values,
    *,
    scale: float,
    sink_keys: torch.Tensor | None = None,
    sink_values: torch.Tensor | None = None,
    recent_keys: torch.Tensor | None = None,
    recent_values: torch.Tensor | None = None,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """softmax(scores) . V for one decode query at position S-1; [B, QH, 1, d] in ``dtype``.

    Scores come from the compressed keys except at the first n_sink / last n_recent positions,
    where the exact keys are used (a position in both ranges counts as a sink); values are the
    float tensor, or the dequantized compressed values with the exact copies substituted.
    With ``window`` only keys at positions >= S - window are visible.
    """
    kv_len = keys.shape[2]
    positions = torch.arange(kv_len, device=q.device)
    n_sink = 0 if sink_keys is None else sink_keys.shape[2]
    n_recent = 0 if recent_keys is None else recent_keys.shape[2]
    is_sink = positions < n_sink
    is_recent = (positions >= kv_len - n_recent) & ~is_sink

    key_rows = torch.zeros(*keys.shape, q.shape[-1], dtype=dtype, device=q.device)
    if n_sink:
        key_rows[:, :, is_sink] = sink_keys.to(dtype)[:, :, : int(is_sink.sum())]
    if n_recent:
        key_rows[:, :, is_recent] = recent_keys.to(dtype)[:, :, n_recent - int(is_recent.sum()) :]
    exact_scores = q.to(dtype) @ expand_kv_heads(key_rows, q.shape[1]).transpose(-1, -2) * scale
    scores = fused_scores(q, keys, scale=scale, dtype=dtype)
    exact = is_sink | is_recent
    scores = torch.where(exact, exact_scores, scores)
    if window is not None:
        scores = scores.masked_fill(positions < kv_len - window, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [B, QH, 1, S]

    if isinstance(values, torch.Tensor):
        v = values.to(dtype)
    else:
        v = dequantize_values(values, dtype)
        if n_sink:
            v[:, :, is_sink] = sink_values.to(dtype)[:, :, : int(is_sink.sum())]
        if n_recent:
            v[:, :, is_recent] = recent_values.to(dtype)[:, :, n_recent - int(is_recent.sum()) :]
    return weights @ expand_kv_heads(v, q.shape[1])
