"""Grouped-query attention: query head ``h`` reads KV head ``h // G``, ``G = q_heads / kv_heads``.

Two ways to line queries up with a KV cache of ``KV`` heads, used everywhere in rqlib:

- :func:`expand_kv_heads` repeats each KV head ``G`` times (simple, costs ``G`` copies);
- :func:`fold_queries` folds the ``G`` query heads of a group into the query axis,
  ``[B, Hq, L, d] -> [B, KV, G*L, d]``, so that one matmul per KV head serves its whole group
  without copying the cache; :func:`unfold_queries` undoes it on the result.
"""

from __future__ import annotations

import torch

__all__ = ["expand_kv_heads", "fold_queries", "group_size", "unfold_queries"]


def group_size(q_heads: int, kv_heads: int) -> int:
    """Query heads per KV head; ``ValueError`` unless ``q_heads`` is a multiple of ``kv_heads``."""
    if kv_heads < 1 or q_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    return q_heads // kv_heads


def expand_kv_heads(t: torch.Tensor, q_heads: int, dim: int = 1) -> torch.Tensor:
    """Repeat the KV heads along ``dim`` so that query head ``h`` finds KV head ``h // G``."""
    return t.repeat_interleave(group_size(q_heads, t.shape[dim]), dim=dim)


def fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, L, ...] -> [B, KV, G*L, ...]``: the group's heads, then positions, in rows."""
    batch, q_heads, length = q.shape[:3]
    group = group_size(q_heads, kv_heads)
    return q.reshape(batch, kv_heads, group * length, *q.shape[3:])


def unfold_queries(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Inverse of :func:`fold_queries`: ``[B, KV, G*L, ...] -> [B, Hq, L, ...]``."""
    batch, kv_heads, rows = x.shape[:3]
    group = group_size(q_heads, kv_heads)
    return x.reshape(batch, q_heads, rows // group, *x.shape[3:])
