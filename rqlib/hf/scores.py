"""Attention scores estimated from compressed keys: the one place the kernel dispatcher plugs in.

:func:`estimate_scores` is the TurboQuant estimator of ``<q, k>`` for every query/key pair,
with grouped-query attention (query head ``h`` reads KV head ``h // group``)::

    <q, k> ~ ||k|| <R q, c_hat> + ||r|| (gamma/m) <S R q, signs>     (second term: -prod only)

It is written in torch on the quantizer's public API (``rotate_query``, ``sketch_query``,
the centroids and the packed codes); swapping it for ``rqlib.kernels.fused_scores`` is a
one-line change here: on CUDA, keys whose geometry the Triton kernels support go through
``rqlib.kernels.fused_scores``; everything else (CPU, and channel subsets of unsupported
widths such as the outlier split's) through the torch estimator below, the same formula.
"""

from __future__ import annotations

import torch

from rqlib.packing import unpack_bits

__all__ = ["estimate_scores", "torch_scores"]


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, L, d]`` -> ``[B, KV, group*L, d]`` with query heads grouped by their KV head."""
    batch, q_heads, length, dim = q.shape
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    return q.reshape(batch, kv_heads, (q_heads // kv_heads) * length, dim)


def _kernel_supports(keys) -> bool:
    from rqlib.kernels import geometry

    try:
        geometry.check_compressed(keys, "keys", ndim=3)
    except ValueError:
        return False
    return True


def estimate_scores(q: torch.Tensor, keys) -> torch.Tensor:
    """Estimated ``<q_i, k_j>`` (unscaled, no mask) as float32 ``[B, Hq, Lq, S]``.

    ``q`` is ``[B, Hq, Lq, d]``; ``keys`` a ``CompressedVectors`` of shape ``[B, KV, S]``.
    """
    if q.is_cuda and _kernel_supports(keys):
        from rqlib.kernels import fused_scores

        return fused_scores(q.contiguous(), keys, scale=1.0)
    return torch_scores(q, keys)


def torch_scores(q: torch.Tensor, keys) -> torch.Tensor:
    """The torch estimator of :func:`estimate_scores` (any device, any geometry)."""
    quantizer = keys.quantizer
    batch, q_heads, length, _ = q.shape
    kv_heads, n_keys = keys.shape[1], keys.shape[2]
    grouped = _grouped(q.float(), kv_heads)
    scores = torch.zeros(batch, kv_heads, grouped.shape[2], n_keys, device=q.device)
    if quantizer.mse_bits > 0:
        codes = unpack_bits(keys.codes, quantizer.mse_bits, quantizer.rotated_dim).long()
        c_hat = quantizer.centroids.to(q.device)[codes]  # [B, KV, S, D]
        rotated = quantizer.rotate_query(grouped)  # [B, KV, G*L, D]
        scores = (rotated @ c_hat.transpose(-1, -2)) * keys.norms.float()[:, :, None, :]
    if quantizer.has_qjl:
        signs = unpack_bits(keys.qjl_signs, 1, quantizer.qjl_dim).float() * 2 - 1
        sketched = quantizer.sketch_query(grouped)  # [B, KV, G*L, m]
        weight = keys.residual_norms.float()[:, :, None, :] * quantizer.qjl_scale
        scores = scores + (sketched @ signs.transpose(-1, -2)) * weight
    return scores.reshape(batch, q_heads, length, n_keys)
