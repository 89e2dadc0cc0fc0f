"""A ``transformers.Cache`` that stores keys and values compressed, and attends from them.

Each :class:`CompressedLayer` holds, for every token seen so far (prefill and decode alike):

- the keys compressed and bit-packed (``CompressedParts``), and the values compressed too, or
  kept in full precision when the config's value bits are ``None``;
- exact copies of the first ``n_sink`` tokens' keys and values;
- copies of the last ``recent_window`` tokens' keys and values: a query at position ``i``
  reads keys ``i-W+1..i`` from this band, so the next chunk needs the previous ``W-1`` tokens
  (the ``W``-th is the current token, which a decode step computes anyway). The band is exact,
  or, with band codecs (``wb=B``), stored as B-bit codes and read back decoded.

Layers listed in ``exact_layers`` store plain keys and values. The exact copies are stored in
the model's dtype (fp32 in our runs, counted at that size by :meth:`CompressedCache.nbytes`);
:func:`rqlib.study.eval.average_bits` counts them at 16 bits, as a deployed fp16 cache would.

Every layer keeps every token (sliding-window layers too; their window is applied by the
mask), so ``get_mask_sizes`` is ``(seen + new, 0)`` for all layers.

Positions are cache slots: with left padding the sink is the first ``n_sink`` slots of each row
(pad slots for a padded row, which the mask hides), so a padded row keeps fewer real tokens
exact than the same sequence unpadded; results stay correct, only less exact.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from rqlib.core.gqa import fold_queries, unfold_queries
from rqlib.hf.codec import CompressedParts, VectorCodec

__all__ = ["CompressedCache", "CompressedLayer"]


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=-2)


def _grouped_matmul(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``weights [B, Hq, L, S] @ values [B, KV, S, d]``; query head ``h`` reads KV head ``h//G``."""
    return unfold_queries(fold_queries(weights, values.shape[1]) @ values, weights.shape[1])


def _grouped_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exact ``q [B, Hq, L, d] . keys [B, KV, S, d]`` -> ``[B, Hq, L, S]`` (float32)."""
    grouped = fold_queries(q.float(), keys.shape[1])
    return unfold_queries(grouped @ keys.float().transpose(-1, -2), q.shape[1])


class CompressedLayer(CacheLayerMixin):
    """One layer of a :class:`CompressedCache` (see the module docstring for what it stores)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        layer_idx: int,
        key_codec: VectorCodec | None,
        value_codec: VectorCodec | None,
        n_sink: int = 0,
        recent_window: int = 0,
        band_codecs: tuple[VectorCodec | None, VectorCodec | None] = (None, None),
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.key_codec = key_codec
        self.value_codec = value_codec
        self.n_sink = n_sink
        self.recent_window = recent_window
        self.key_band_codec, self.value_band_codec = band_codecs
        if band_codecs[0] is not None and not recent_window:
            raise ValueError("band codecs need a recent band (recent_window > 0)")
        self.active = False  # set by rqlib.hf.compress for the duration of its block
        self.reset()

    @property
    def exact(self) -> bool:
        """Whether this layer keeps keys and values exact (no key codec)."""
        return self.key_codec is None

    # ---- the CacheLayerMixin interface -----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def reset(self) -> None:
        """Forget every token (the codecs stay)."""
        self.is_initialized = False
        self.length = 0
        self.keys = self.values = None  # exact layers: all tokens; others: unused
        self.compressed_keys: CompressedParts | None = None
        self.compressed_values: CompressedParts | None = None
        self.full_values: torch.Tensor | None = None  # values kept in full precision
        self.sink_keys = self.sink_values = None
        self.recent_keys = self.recent_values = None
        self._chunk: dict | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append a chunk of new tokens; return it unchanged (attention reads this layer)."""
        if not self.active:
            raise RuntimeError(
                f"layer {self.layer_idx}: this CompressedCache is used outside its "
                "rqlib.hf.compress(...) block; the model's own attention would read only the new "
                "tokens"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self.length, key_states.shape[-2]
        chunk = {"start": start, "key_states": key_states}
        if self.exact:
            self.keys = _cat(self.keys, key_states)
            self.values = _cat(self.values, value_states)
        else:
            keys_c = self.key_codec.encode(key_states)
            self.compressed_keys = (
                keys_c if self.compressed_keys is None else self.compressed_keys.cat(keys_c)
            )
            if self.value_codec is None:
                self.full_values = _cat(self.full_values, value_states)
            else:
                values_c = self.value_codec.encode(value_states)
                self.compressed_values = (
                    values_c
                    if self.compressed_values is None
                    else self.compressed_values.cat(values_c)
                )
            # exact copies of values are needed only when the values are compressed
            exact_values = self.value_codec is not None
            if self.n_sink and start < self.n_sink:
                take = self.n_sink - start
                self.sink_keys = _cat(self.sink_keys, key_states[..., :take, :])
                if exact_values:
                    self.sink_values = _cat(self.sink_values, value_states[..., :take, :])
            if self.recent_window:
                band_keys, self.recent_keys = self._band(
                    self.key_band_codec, self.recent_keys, key_states
                )
                chunk.update(band_start=start + new - band_keys.shape[-2], band_keys=band_keys)
                if exact_values:
                    chunk["band_values"], self.recent_values = self._band(
                        self.value_band_codec, self.recent_values, value_states
                    )
        self.length = start + new
        self._chunk = chunk
        return key_states, value_states

    def _band(self, codec: VectorCodec | None, kept, new_states: torch.Tensor):
        """The band this chunk's queries read (the kept tail, then the new tokens) and the tail
        to keep for the next chunk: exact tensors, or ``codec`` codes decoded for reading."""
        if codec is None:
            band = _cat(kept, new_states)
            return band, band[..., -self.recent_window :, :]
        encoded = codec.encode(new_states)
        parts = encoded if kept is None else kept.cat(encoded)
        return codec.decode(parts), parts.tail(self.recent_window)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a CompressedCache cannot be cropped (no assisted decoding)")

    def _map_batch(self, fn) -> None:
        for name in (
            "keys",
            "values",
            "full_values",
            "sink_keys",
            "sink_values",
            "recent_keys",
            "recent_values",
        ):
            tensor = getattr(self, name)
            if isinstance(tensor, CompressedParts):  # a band kept as codes
                setattr(self, name, tensor.map(fn))
            elif tensor is not None:
                setattr(self, name, fn(tensor))
        for name in ("compressed_keys", "compressed_values"):
            parts = getattr(self, name)
            if parts is not None:
                setattr(self, name, parts.map(fn))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    # ---- memory --------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes this layer stores now (compressed parts at their packed size)."""
        total = 0
        for tensor in (
            self.keys,
            self.values,
            self.full_values,
            self.sink_keys,
            self.sink_values,
            self.recent_keys,
            self.recent_values,
        ):
            if isinstance(tensor, CompressedParts):  # a band kept as codes
                total += tensor.nbytes()
            elif tensor is not None:
                total += tensor.numel() * tensor.element_size()
        for parts in (self.compressed_keys, self.compressed_values):
            if parts is not None:
                total += parts.nbytes()
        return total

    # ---- attention -----------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        mask: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, Lq, Hq, d]`` of ``query`` over every token this layer holds.

        ``key`` must be the tensor this layer's latest ``update`` returned (proof that the model
        wrote to this cache); ``mask`` is the boolean ``[B, 1, Lq, S]`` mask (True = attend).
        """
        chunk = self._chunk
        if chunk is None or key is not chunk["key_states"]:
            raise RuntimeError(
                f"layer {self.layer_idx}: the attention received keys that this CompressedCache "
                "did not produce; pass the cache yielded by rqlib.hf.compress(...) to the model"
            )
        n_keys, length = self.length, query.shape[2]
        if mask.dtype != torch.bool or mask.shape[-1] != n_keys or mask.shape[-2] != length:
            raise RuntimeError(
                f"layer {self.layer_idx}: expected a boolean mask [B, 1, {length}, {n_keys}], got "
                f"{tuple(mask.shape)} {mask.dtype}; is the rqlib mask function registered?"
            )
        if self.exact:
            scores = _grouped_scores(query, self.keys)
            exact = None
        else:
            scores, exact = self._mixed_scores(query, chunk)
        scores = scores * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1)
        output = self._weighted_values(weights, exact, chunk)
        return output.to(query.dtype).transpose(1, 2).contiguous()

    def _exact_positions(self, length: int, device) -> torch.Tensor:
        """Boolean ``[Lq, S]``: which (query, key) pairs read exact keys and values."""
        queries = torch.arange(self.length - length, self.length, device=device)[:, None]
        keys = torch.arange(self.length, device=device)[None, :]
        exact = keys < self.n_sink
        if self.recent_window:
            exact = exact | ((keys <= queries) & (keys > queries - self.recent_window))
        return exact

    def _mixed_scores(self, query: torch.Tensor, chunk: dict):
        scores = self.key_codec.scores(query, self.compressed_keys)
        exact = self._exact_positions(query.shape[2], query.device)
        if self.recent_window:
            first = chunk["band_start"]
            band = _grouped_scores(query, chunk["band_keys"])
            scores[..., first:] = torch.where(exact[:, first:], band, scores[..., first:])
        if self.sink_keys is not None:  # after the band: a pair in both reads the exact sink
            n = self.sink_keys.shape[-2]
            sink = _grouped_scores(query, self.sink_keys)
            scores[..., :n] = torch.where(exact[:, :n], sink, scores[..., :n])
        return scores, exact

    def _weighted_values(self, weights: torch.Tensor, exact: torch.Tensor | None, chunk: dict):
        if self.exact:
            return _grouped_matmul(weights, self.values.float())
        if self.value_codec is None:
            return _grouped_matmul(weights, self.full_values.float())
        decoded = self.value_codec.decode(self.compressed_values)
        output = _grouped_matmul(weights.masked_fill(exact, 0.0), decoded)
        if self.sink_values is not None:
            n = self.sink_values.shape[-2]
            sink_weights = weights[..., :n] * exact[:, :n]
            output = output + _grouped_matmul(sink_weights, self.sink_values.float())
        if self.recent_window:
            first = chunk["band_start"]
            # a pair inside both the sink and the band is counted once: the sink took it
            band_exact = exact[:, first:].clone()
            if self.sink_values is not None and first < self.sink_values.shape[-2]:
                band_exact[:, : self.sink_values.shape[-2] - first] = False
            band_weights = weights[..., first:] * band_exact
            output = output + _grouped_matmul(band_weights, chunk["band_values"].float())
        return output


class CompressedCache(Cache):
    """A cache of :class:`CompressedLayer` objects, one per decoder layer; built by
    :func:`rqlib.hf.compress`, which also records the config it implements."""

    def __init__(self, layers: list[CompressedLayer], config, model_id: int) -> None:
        super().__init__(layers=layers)
        self.config = config
        self.model_id = model_id

    def set_active(self, active: bool) -> None:
        """Allow (or forbid) updates: only inside the compress() block that made the cache."""
        for layer in self.layers:
            layer.active = active

    def nbytes(self) -> int:
        """Bytes stored by all layers now."""
        return sum(layer.nbytes() for layer in self.layers)

    def bytes_per_token(self) -> float:
        """Stored bytes per token of one sequence (``nbytes / (batch * tokens)``)."""
        length = self.get_seq_length()
        if length == 0:
            raise ValueError("the cache is empty: bytes_per_token needs at least one token")
        batch = self._batch_size()
        return self.nbytes() / (batch * length)

    def _batch_size(self) -> int:
        for layer in self.layers:
            chunk = layer._chunk
            if chunk is not None:
                return chunk["key_states"].shape[0]
        raise ValueError("the cache is empty")
