"""The estimator of ``<q, k>`` from a compressed ``k``: one formula, two contractions.

A key stored by a TurboQuant quantizer (:mod:`rqlib.core.quantizers`) is estimated as

    <q, k>  ~  ||k|| <R q, c_hat>  +  ||k|| ||r|| (gamma/m) <S R q, sign(S r)>

(the second term for the ``-prod`` quantizers only). The formula splits into a query side,
``(R q, S R q)`` (:func:`query_terms`), and a key side, ``(||k|| c_hat, ||k|| ||r|| gamma/m
sign(S r))`` (:func:`key_terms`); the estimate is the sum of the two dot products. Everything
that computes a score from stored codes uses these two functions: the quantizer's
``inner_product`` (one query per key, :func:`paired_scores`), the torch reference of the kernels
and the compressed cache (every query against every key, :func:`pairwise_scores`). The Triton
kernels compute the same sums in tiles.
"""

from __future__ import annotations

import weakref

import torch

from rqlib.core.packing import CodeTable, unpack_bits, unpack_signs

__all__ = ["centroid_values", "key_terms", "paired_scores", "pairwise_scores", "query_terms"]

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # quantizer -> CodeTable


def centroid_values(c, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``c_hat``: the codebook vectors of the stored codes, ``[..., D]`` in ``dtype`` (zeros
    without codes). Whole groups of eight codes are read through a :class:`CodeTable`; a
    quantizer with a trellis reads its symbols through the trellis's shift register."""
    qz = c.quantizer
    device = c.norms.device
    if not qz.mse_bits:
        return torch.zeros(*c.shape, qz.rotated_dim, dtype=dtype, device=device)
    if getattr(qz, "trellis", None) is not None:  # the values follow the shift register
        symbols = unpack_bits(c.codes, qz.mse_bits, qz.rotated_dim)
        return qz.trellis_values(symbols, dtype)
    if qz.rotated_dim % 8 == 0:
        table = _TABLES.get(qz)
        if table is None:
            table = _TABLES[qz] = CodeTable(qz.centroids.double(), qz.mse_bits)
        return table.lookup(c.codes, qz.rotated_dim, dtype)
    codes = unpack_bits(c.codes, qz.mse_bits, qz.rotated_dim).long()
    return qz.centroids.to(device, dtype)[codes]


def key_terms(c, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The key side of the estimator for compressed vectors ``c`` of batch shape ``[...]``.

    Returns ``(||k|| c_hat [..., D], ||k|| ||r|| gamma/m sign(S r) [..., m] or None)``, where
    ``c_hat`` is the codebook vector of the stored codes (zeros without codes).
    """
    qz = c.quantizer
    mse = centroid_values(c, dtype) * c.norms.to(dtype)[..., None]
    if not qz.has_qjl:
        return mse, None
    signs = unpack_signs(c.qjl_signs, qz.qjl_dim, dtype)
    return mse, signs * (c.residual_norms.to(dtype) * qz.qjl_scale)[..., None]


def query_terms(
    quantizer, q: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The query side: ``(R q [..., D], S R q [..., m] or None)`` in ``dtype``."""
    rotated = q.to(dtype) @ quantizer.rotation.matrix.to(q.device, dtype).T
    if not quantizer.has_qjl:
        return rotated, None
    return rotated, rotated @ quantizer.sketch.to(q.device, dtype).T


def pairwise_scores(q: torch.Tensor, c, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every query against every key: ``q [..., R, d]`` and ``c`` of shape ``[..., S]`` give
    ``[..., R, S]`` (leading dimensions broadcast as in ``matmul``)."""
    q_rot, q_sketch = query_terms(c.quantizer, q, dtype)
    mse, qjl = key_terms(c, dtype)
    scores = q_rot @ mse.transpose(-1, -2)
    if qjl is not None:
        scores = scores + q_sketch @ qjl.transpose(-1, -2)
    return scores


def paired_scores(q: torch.Tensor, c, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One query per key: ``q [..., d]`` broadcast against ``c.shape``, summed over the last
    axis (e.g. q ``[B, H, L, 1, d]`` against keys ``[B, H, 1, S]`` gives ``[B, H, L, S]``)."""
    q_rot, q_sketch = query_terms(c.quantizer, q, dtype)
    mse, qjl = key_terms(c, dtype)
    scores = (q_rot * mse).sum(dim=-1)
    if qjl is not None:
        scores = scores + (q_sketch * qjl).sum(dim=-1)
    return scores
