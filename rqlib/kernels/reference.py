"""Pure-torch references of the Triton kernels, with identical semantics.

They are the CPU backend of the dispatcher (in float32) and the oracle of the tests (in
float64). They unpack the stored bits with :func:`rqlib.packing.unpack_bits` and use the
quantizer's rotation, sketch and codebook, so they share no code with the kernels.
"""

from __future__ import annotations

import torch

from rqlib.packing import unpack_bits


def quantize(quantizer, x: torch.Tensor):
    """The reference quantizer is the torch quantizer itself."""
    return quantizer.quantize(x)


def decoded_rotated(c, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """norm * c[codes] in the rotated space, [..., D] (zeros when the vectors have no codes)."""
    qz = c.quantizer
    if qz.mse_bits == 0:
        return torch.zeros(*c.shape, qz.rotated_dim, dtype=dtype, device=c.norms.device)
    codes = unpack_bits(c.codes, qz.mse_bits, qz.rotated_dim).long()
    return qz.centroids.to(c.norms.device, dtype)[codes] * c.norms.to(dtype)[..., None]


def signs_pm1(c, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The QJL sign bits of ``c`` as +1/-1, [..., m]."""
    bits = unpack_bits(c.qjl_signs, 1, c.quantizer.qjl_dim)
    return bits.to(dtype) * 2 - 1


def _expand_group(t: torch.Tensor, group: int) -> torch.Tensor:
    """Repeat kv heads (dim 1) so that query head h reads kv head h // group."""
    return t.repeat_interleave(group, dim=1)


def fused_scores(
    q: torch.Tensor, keys, *, scale: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """scale * (||k|| <R q, c[codes]> + ||r|| gamma/m <S R q, signs>), [B, QH, Lq, S] in dtype.

    ``q`` is [batch, q_heads, q_len, d]; ``keys`` a CompressedVectors of shape
    [batch, kv_heads, kv_len]. No mask is applied.
    """
    qz = keys.quantizer
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    # query head h reads kv head h // group: fold each group into the query axis
    grouped = q.to(dtype).reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)
    q_rot = grouped @ qz.rotation.matrix.to(q.device, dtype).T  # [B, KV, G*Lq, D]
    scores = q_rot @ decoded_rotated(keys, dtype).transpose(-1, -2)
    if qz.has_qjl:
        q_sketch = q_rot @ qz.sketch.to(q.device, dtype).T
        weight = keys.residual_norms.to(dtype)[:, :, None, :] * qz.qjl_scale
        scores = scores + (q_sketch @ signs_pm1(keys, dtype).transpose(-1, -2)) * weight
    return scores.reshape(batch, q_heads, q_len, kv_len) * scale


def dequantize_values(values, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MSE-compressed values back in the original space: ||v|| R^T c[codes], [B, KV, S, d]."""
    matrix = values.quantizer.rotation.matrix.to(values.norms.device, dtype)
    return decoded_rotated(values, dtype) @ matrix


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
    group = q.shape[1] // keys.shape[1]
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
    exact_scores = q.to(dtype) @ _expand_group(key_rows, group).transpose(-1, -2) * scale
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
    return weights @ _expand_group(v, group)
