"""The torch implementation of the kernels' semantics: the CPU path, and the tests' oracle.

:func:`attention` is attention over one layer of the compressed cache (an
:class:`~rqlib.kernels.state.AttentionState`), in query blocks and key blocks with an online
softmax, so that memory grows with one block and never with ``Lq x S``:

1. the query side once per call: ``R (q / a)`` per codec part (and ``S R (q / a)`` for QJL),
   the mean term ``<q, mu>``, the rotated queries of the band codec;
2. per key block: scores from the stored codes (``||k|| <R q, c_hat>``, see
   :mod:`rqlib.core.estimator`), then **the sink/band substitution** (:func:`_substitute`): a
   pair (query ``i``, key ``j``) reads the band streams when ``i - band < j <= i``, the exact sink
   when ``j < n_sink``; scale, softcap and the mask; the online softmax update;
3. values are weighted in each codec's rotated space (``sum_j p_j ||v_j|| c_hat_j``) and rotated
   back once per query at the end, never decoded token by token.

With ``dtype=torch.float64`` it is the oracle the Triton kernels are tested against. The
Triton kernels share no code with this module. :func:`fused_scores` and :func:`quantize` are the
references of the other two kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rqlib.core.estimator import pairwise_scores
from rqlib.core.gqa import fold_queries, unfold_queries
from rqlib.core.packing import unpack_signs
from rqlib.kernels.state import AttentionState, CausalMask, Stream

__all__ = ["attention", "fused_scores", "quantize"]

QUERY_BLOCK = 256  # query positions per block
KEY_BLOCK = 4096  # key positions per block


def quantize(quantizer, x: torch.Tensor, validate: bool = True):
    """The reference quantizer is the torch quantizer itself."""
    return quantizer.quantize(x, validate=validate)


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


# ---- the query side --------------------------------------------------------------------------
def _as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in ``like``'s dtype and device (no operation when it is already)."""
    if t.dtype == like.dtype and t.device == like.device:
        return t
    return t.to(device=like.device, dtype=like.dtype)


def _per_head(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-KV-head constant ``[KV, c]`` broadcast against rows ``[B, KV, R, c]``."""
    return _as(t, like)[None, :, None, :]


def _channels(x: torch.Tensor, channels: torch.Tensor | None) -> torch.Tensor:
    """``x[b, h, r, channels[h]]`` for rows ``[B, KV, R, d]`` and ``channels [KV, c]``."""
    if channels is None:
        return x
    index = channels.to(x.device)[None, :, None, :].expand(x.shape[0], -1, x.shape[2], -1)
    return torch.gather(x, -1, index)


@dataclass
class _Queries:
    """The query side of one stream: per part ``(R q', S R q' or None)``, and ``<q, mu>``."""

    parts: list
    mean: torch.Tensor | None


def _query_side(stream: Stream, rows: torch.Tensor) -> _Queries:
    if stream.is_exact:
        return _Queries([], None)
    scaled = rows if stream.scale is None else rows / _per_head(stream.scale, rows)
    if stream.transform is not None:
        scaled = stream.transform.queries(scaled)
    parts = []
    for part in stream.parts:
        qz = part.quantizer
        sub = _channels(scaled, part.channels)
        rotated = sub @ _as(qz.rotation.matrix, rows).T
        sketch = rotated @ _as(qz.sketch, rows).T if qz.has_qjl else None
        parts.append((rotated, sketch))
    mean = None
    if stream.mean is not None:  # [B, KV, R, 1]
        mean = rows @ _as(stream.mean, rows)[None, :, :, None]
    return _Queries(parts, mean)


# ---- one block of keys -----------------------------------------------------------------------
def _written(stream: Stream, k0: int, k1: int) -> int:
    """The end of the positions of ``k0 .. k1 - 1`` that ``stream`` holds: ``k1``, except for a
    main stream that lags behind the band (``band_once``), whose newest tokens are in the band
    only. The columns after it read as zeros, as the kernel's zero-filled slots do; no pair
    reads them, since they are every later query's band."""
    return max(k0, min(k1, stream.rings[0].end))


def _scores(stream: Stream, queries: _Queries, rows: torch.Tensor, k0: int, k1: int):
    """Scores ``[B, KV, R, k1 - k0]`` of the rows against stored positions ``k0 .. k1 - 1``."""
    stop = _written(stream, k0, k1)
    if stop < k1:
        scores = rows.new_zeros((*rows.shape[:3], k1 - k0))
        if stop > k0:
            scores[..., : stop - k0] = _scores(stream, queries, rows, k0, stop)
        return scores
    dtype = rows.dtype
    if stream.is_exact:
        return rows @ _as(stream.exact.read(k0, k1), rows).transpose(-1, -2)
    total = None
    for part, (rotated, sketch) in zip(stream.parts, queries.parts):
        c_hat, norms = part.ring.decoded(k0, k1, dtype)
        qz = part.quantizer
        scores = rotated @ c_hat.transpose(-1, -2)
        scores = scores * norms[:, :, None, :]
        if qz.has_qjl:
            stored = part.ring.read(k0, k1, dtype)
            signs = unpack_signs(stored.qjl_signs, qz.qjl_dim, dtype)
            qjl = sketch @ signs.transpose(-1, -2)
            scores = scores + qjl * (stored.residual_norms * qz.qjl_scale)[:, :, None]
        total = scores if total is None else total + scores
    return total if queries.mean is None else total + queries.mean


class _Values:
    """Running ``sum_j p_j v_j`` of one stream: per part in its quantizer's rotated space
    (``sum_j p_j ||v_j|| c_hat_j``), or exact; :meth:`finish` rotates back once."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.acc: list[torch.Tensor | None] = [None] * max(1, len(stream.parts))
        self.weight: torch.Tensor | None = None  # sum of the weights (for a value mean)

    def rescale(self, alpha: torch.Tensor) -> None:
        self.acc = [None if a is None else a * alpha for a in self.acc]
        if self.weight is not None:
            self.weight = self.weight * alpha

    def add(self, weights: torch.Tensor, k0: int, k1: int) -> None:
        dtype = weights.dtype
        stream = self.stream
        stop = _written(stream, k0, k1)  # the weights of the later columns are zero
        if stop == k0:
            return
        weights, k1 = weights[..., : stop - k0], stop
        if stream.is_exact:
            terms = [weights @ _as(stream.exact.read(k0, k1), weights)]
        else:
            terms = []
            for part in stream.parts:
                c_hat, norms = part.ring.decoded(k0, k1, dtype)
                terms.append((weights * norms[:, :, None, :]) @ c_hat)
        self.acc = [t if a is None else a + t for a, t in zip(self.acc, terms)]
        if stream.mean is not None:
            total = weights.sum(-1, keepdim=True)
            self.weight = total if self.weight is None else self.weight + total

    def finish(self, shape, dtype, device) -> torch.Tensor:
        """``[B, KV, R, d]``: the accumulated values back in the model's coordinates."""
        stream = self.stream
        if all(a is None for a in self.acc):
            return torch.zeros(shape, dtype=dtype, device=device)
        if stream.is_exact:
            return self.acc[0]
        out = torch.zeros(shape, dtype=dtype, device=device)
        for part, acc in zip(stream.parts, self.acc):
            if acc is None:
                continue
            back = acc @ _as(part.quantizer.rotation.matrix, acc)  # [B, KV, R, c]
            if part.channels is None:
                out = out + back
            else:
                index = part.channels.to(device)[None, :, None, :].expand(*back.shape)
                out = out.scatter_add(-1, index, back)
        if stream.transform is not None:
            out = stream.transform.back(out)
        if stream.scale is not None:
            out = out / _per_head(stream.scale, out)
        if stream.mean is not None and self.weight is not None:
            out = out + self.weight * _per_head(stream.mean, out)
        return out


# ---- the substitution: sink and band ---------------------------------------------------------
def _substitute(state: AttentionState, side: dict, rows, positions, span, scores, k0, k1):
    """Replace the scores of band pairs and sink keys in one key block (in place); return the
    boolean ``[R, n]`` band pairs and the number of sink columns, which the values reuse.

    A pair (query ``i``, key ``j``) reads the band when ``i - band < j <= i``, and the exact sink
    when ``j < n_sink`` (the sink wins where both hold). ``positions`` are the rows' query
    positions, ``span`` the first and last of them. This is the only place where either
    substitution happens in the torch implementation."""
    band_lo = band_hi = k0
    in_band = None
    if state.band:
        band_lo = max(k0, span[0] - state.band + 1, state.n_sink)
        band_hi = min(k1, span[1] + 1)
    if band_hi > band_lo:
        keys = torch.arange(band_lo, band_hi, device=rows.device)[None, :]
        in_band = (keys > positions[:, None] - state.band) & (keys <= positions[:, None])
        band = _scores(state.band_keys, side["band"], rows, band_lo, band_hi)
        window = scores[..., band_lo - k0 : band_hi - k0]
        window.copy_(torch.where(in_band, band, window))
    n_sink = max(0, min(state.n_sink, k1) - k0)
    if n_sink:
        sink = _as(state.sink_keys[:, :, k0 : k0 + n_sink], rows)
        scores[..., :n_sink] = rows @ sink.transpose(-1, -2)
    return (band_lo, band_hi, in_band), n_sink


# ---- attention -------------------------------------------------------------------------------
def attention(
    state: AttentionState,
    q: torch.Tensor,
    mask,
    *,
    scale: float,
    softcap: float | None = None,
    dtype: torch.dtype = torch.float32,
    query_block: int = QUERY_BLOCK,
    key_block: int = KEY_BLOCK,
) -> torch.Tensor:
    """Attention output ``[B, Hq, Lq, d]`` (in ``dtype``) of ``q [B, Hq, Lq, d]`` (positions
    ``state.start .. state.end - 1``) over the layer's stored tokens under ``mask`` (a
    :class:`~rqlib.kernels.state.CausalMask` or :class:`~rqlib.kernels.state.DenseMask`).

    A query that sees no key at all (a padding position) gets zeros.
    """
    batch, q_heads, length, head_dim = q.shape
    kv_heads = state.keys.rings[0].heads
    group = q_heads // kv_heads
    # rows are (position, head of the group), position-major: row r is position r // group
    rows_all = q.to(dtype).reshape(batch, kv_heads, group, length, head_dim).transpose(2, 3)
    rows_all = rows_all.reshape(batch, kv_heads, length * group, head_dim)
    out = torch.empty_like(rows_all)
    for t0 in range(0, length, query_block):
        t1 = min(length, t0 + query_block)
        rows = rows_all[:, :, t0 * group : t1 * group]
        out[:, :, t0 * group : t1 * group] = _query_block(
            state, rows, group, t0, t1, mask, scale, softcap, key_block
        )
    out = out.reshape(batch, kv_heads, length, group, head_dim).transpose(2, 3)
    return out.reshape(batch, q_heads, length, head_dim)


def _query_block(state, rows, group, t0, t1, mask, scale, softcap, key_block):
    """Attention of the rows of query positions ``start + t0 .. start + t1 - 1``."""
    dtype, device = rows.dtype, rows.device
    positions = torch.arange(state.start + t0, state.start + t1, device=device)
    if group > 1:
        positions = positions.repeat_interleave(group)  # position of each row
    side = {"keys": _query_side(state.keys, rows)}
    if state.band:
        side["band"] = _query_side(state.band_keys, rows)
    values = _Values(state.values)
    band_values = _Values(state.band_values) if state.band_values is not None else None
    exact_acc = None  # sink values (and nothing else: an exact band is a stream)
    span = (state.start + t0, state.start + t1 - 1)
    first, last = state.first, state.end
    if isinstance(mask, CausalMask):  # no query of the block reads beyond its own position
        last = span[1] + 1
        if mask.window is not None:
            first = max(first, span[0] - mask.window + 1)
    running_max = torch.full((*rows.shape[:3], 1), float("-inf"), dtype=dtype, device=device)
    total = torch.zeros_like(running_max)
    for k0 in range(first, last, key_block):
        k1 = min(last, k0 + key_block)
        scores = _scores(state.keys, side["keys"], rows, k0, k1)
        band, n_sink = _substitute(state, side, rows, positions, span, scores, k0, k1)
        scores = scores * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        hidden = mask.hidden(t0, t1, k0, k1)
        if hidden is not None:
            if group > 1:
                hidden = hidden.repeat_interleave(group, dim=2)
            scores = scores.masked_fill(hidden, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        safe_max = new_max.clamp_min(torch.finfo(dtype).min)  # a row that sees nothing yet
        alpha = torch.exp(running_max - safe_max)
        weights = torch.exp(scores - safe_max)
        total = total * alpha + weights.sum(-1, keepdim=True)
        running_max = new_max
        # values: main pairs read the main stream, band pairs the band values and sink keys the
        # sink values, where those are kept apart (exact values have neither: all read main)
        band_lo, band_hi, in_band = band
        band_apart = in_band is not None and state.band_values is not None
        sink_apart = n_sink > 0 and state.sink_values is not None
        main = weights.clone() if (band_apart or sink_apart) else weights
        if band_apart:
            main[..., band_lo - k0 : band_hi - k0].masked_fill_(in_band, 0.0)
        if sink_apart:
            main[..., :n_sink] = 0.0
        values.rescale(alpha)
        values.add(main, k0, k1)
        if state.band_values is not None:
            band_values.rescale(alpha)
            if in_band is not None:
                band_weights = weights[..., band_lo - k0 : band_hi - k0] * in_band
                band_values.add(band_weights, band_lo, band_hi)
        if exact_acc is not None:
            exact_acc = exact_acc * alpha
        if sink_apart:
            sink = _as(state.sink_values[:, :, k0 : k0 + n_sink], weights)
            term = weights[..., :n_sink] @ sink
            exact_acc = term if exact_acc is None else exact_acc + term
    shape = (*rows.shape[:3], rows.shape[-1])
    out = values.finish(shape, dtype, device)
    if band_values is not None:
        out = out + band_values.finish(shape, dtype, device)
    if exact_acc is not None:
        out = out + exact_acc
    return torch.where(total > 0, out / total.clamp_min(torch.finfo(dtype).tiny), 0.0)
