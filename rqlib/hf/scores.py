"""Attention scores estimated from compressed keys: the one place the kernel dispatcher plugs in.

:func:`estimate_scores` is the TurboQuant estimator of ``<q, k>`` for every query/key pair,
with grouped-query attention (query head ``h`` reads KV head ``h // group``)::

    <q, k> ~ ||k|| <R q, c_hat> + ||r|| (gamma/m) <S R q, signs>     (second term: -prod only)

On CUDA, keys whose geometry the Triton kernels support go through
``rqlib.kernels.fused_scores``; everything else (CPU, and channel subsets of unsupported
widths such as the outlier split's) through the kernels' torch reference, the same formula,
which accepts any geometry.
"""

from __future__ import annotations

import torch

from rqlib.kernels import reference

__all__ = ["estimate_scores", "torch_scores"]


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
    if q.shape[1] % keys.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {keys.shape[1]} KV heads")
    return reference.fused_scores(q, keys, scale=1.0)
