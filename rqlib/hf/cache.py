"""A ``transformers.Cache`` that stores keys and values compressed, and attends from them.

Each :class:`CompressedLayer` holds, for every token seen so far (prefill and decode alike),
in buffers written in place (:class:`rqlib.kernels.store.VectorRing`):

- the keys compressed and bit-packed, and the values compressed too, or kept in full precision
  when the config's value bits are ``None``; norms as bit fields of the width the bit accounting
  counts (11 bits for ``nm=6``);
- exact copies of the first ``n_sink`` tokens' keys and values (values only when compressed);
- the recent band, a window of the last tokens: a query at position ``i`` reads keys
  ``i-W+1..i`` from it. The band is exact, or, with band codecs (``wb=B``), B-bit codes.
  With ``band_once`` (spec token ``once``) a token gets its main codes only when it leaves the
  band, coded from the band's copy of it: the main streams lag ``W`` tokens behind, no query
  reads a main code inside its band, and the ``W`` newest tokens are stored once. Prefill and
  decode store the same codes, since both code a token from the band's copy.

Layers listed in ``exact_layers`` store plain keys and values. A sliding-window layer (Gemma 3)
keeps only the tokens its window can still see: older ones are evicted, not only masked.

A decode step appends one token to each stream (no copy that grows with the context) and runs
one fused attention over the stored state (:func:`rqlib.kernels.attention`: the Triton kernel
on CUDA, the torch implementation on CPU). A long prompt is attended in query and key blocks.
On CPU, :meth:`CompressedCache.keep_decoded` makes decode steps read a decoded copy of the
codes, written once per token, instead of decoding every stored code at every step: the same
numbers bit for bit, at the memory of a float32 cache (for evaluation; off by default).

Steps. Every forward is one step: the first layer update opens it, the last one completes it.
If a forward fails part-way (an exception in a layer, or outside the cache between two layers),
the step is rolled back (:meth:`CompressedCache.rollback`): at once when the failure happened in
the cache's own code, else at the next update, with a warning. Every layer therefore always
holds the same number of tokens, and :meth:`CompressedCache.get_seq_length` during an open step
is the length before it.

Copies. A cache is updated only inside the :func:`rqlib.hf.compress` block that made it; a copy
(``copy.copy``, ``copy.deepcopy``, pickle) keeps the stored tokens but is never installed on a
model, so updating it raises an error that says so (the model's own attention would otherwise
read only the new tokens).

Positions are cache slots: with left padding the sink is the first ``n_sink`` slots of each row
(pad slots for a padded row, which the mask hides), so a padded row keeps fewer real tokens
exact than the same sequence unpadded; results stay correct, only less exact.
"""

from __future__ import annotations

import copy
import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from rqlib import kernels
from rqlib.hf.codec import CompressedParts, VectorCodec
from rqlib.kernels.state import AttentionState, CausalMask, DenseMask, Part, Stream
from rqlib.kernels.store import VectorRing

__all__ = ["CompressedCache", "CompressedLayer"]

#: Query chunks of up to this many tokens are "short" (decode, speculative chunks): windows keep
#: this many slots more than they need, so that such chunks never reallocate them.
SHORT_QUERY = 16


class CompressedLayer(CacheLayerMixin):
    """One layer of a :class:`CompressedCache` (see the module docstring for what it stores).

    ``sliding_window`` (``None`` for global layers): query ``i`` sees keys ``i-w+1..i`` only;
    older tokens are evicted from storage.
    """

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
        sliding_window: int | None = None,
        band_once: bool = False,
    ) -> None:
        super().__init__()
        if band_codecs[0] is not None and not recent_window:
            raise ValueError("band codecs need a recent band (recent_window > 0)")
        if band_once and not recent_window:
            raise ValueError("band_once needs a recent band (recent_window > 0)")
        if key_codec is None and value_codec is not None:
            raise ValueError("an exact layer (no key codec) keeps its values exact too")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window!r}")
        self.layer_idx = layer_idx
        self.key_codec = key_codec
        self.value_codec = value_codec
        self.n_sink = n_sink if key_codec is not None else 0
        self.recent_window = recent_window if key_codec is not None else 0
        self.band_once = band_once and key_codec is not None
        self.key_band_codec, self.value_band_codec = band_codecs
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.backend = "auto"
        self.decoded_copy = False  # see CompressedCache.keep_decoded
        self.active = False  # set by rqlib.hf.compress for the duration of its block
        self.reset()

    @property
    def exact(self) -> bool:
        """Whether this layer keeps keys and values exact (no key codec)."""
        return self.key_codec is None

    # ---- copies --------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """Copies and pickles keep the tokens but are not installed on any model."""
        state = self.__dict__.copy()
        state["active"] = False
        state["copied"] = True
        return state

    # ---- the CacheLayerMixin interface -----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the (empty) streams for this batch, head count, dtype and device."""
        batch, heads, _, dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.shape = (batch, heads, dim)

        def ring(codec: VectorCodec | None, exact: bool = True):
            if codec is None:
                return Stream(
                    exact=VectorRing(batch, heads, self.device, dim=dim, dtype=self.dtype)
                )
            parts = tuple(
                Part(
                    p.quantizer,
                    p.channels,
                    VectorRing(batch, heads, self.device, quantizer=p.quantizer),
                )
                for p in codec.parts
            )
            return Stream(
                parts=parts, mean=codec.mean, scale=codec.scale, transform=codec.transform
            )

        self.streams = {"keys": ring(self.key_codec), "values": ring(self.value_codec)}
        if self.recent_window:
            self.streams["band_keys"] = ring(self.key_band_codec)
            if self.value_codec is not None:
                self.streams["band_values"] = ring(self.value_band_codec)
        self.keep_decoded(self.decoded_copy)
        self.sink_keys = self.sink_values = None
        if self.n_sink:
            shape = (batch, heads, self.n_sink, dim)
            self.sink_keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.value_codec is not None:
                self.sink_values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def keep_decoded(self, keep: bool = True) -> None:
        """Keep (or drop) a decoded copy of every packed stream (see
        :meth:`CompressedCache.keep_decoded`); if building a copy fails, the rings already
        given one drop it again, so that every ring is left as it was."""
        rings = [r for stream in self.streams.values() for r in stream.rings if r.packed]
        switched = []
        try:
            for ring in rings:
                if ring.has_decoded != keep:
                    ring.keep_decoded(keep)
                    switched.append(ring)
        except BaseException:
            for ring in switched:  # only turning a copy on can fail; dropping one cannot
                ring.keep_decoded(not keep)
            raise
        self.decoded_copy = keep

    def reset(self) -> None:
        """Forget every token (the codecs stay)."""
        self.is_initialized = False
        self.length = 0
        self.keys = self.values = None  # transformers' attributes: this layer stores streams
        self.streams: dict[str, Stream] = {}
        self.sink_keys = self.sink_values = None
        self._last: tuple[int, int] | None = None  # (start, length) of the last update
        self._chunk_keys: torch.Tensor | None = None
        self._deferred_check: torch.Tensor | None = None

    def _window(self, name: str) -> int | None:
        """Tokens before a chunk that stream ``name`` must keep (``None``: all of them)."""
        if name.startswith("band"):  # with band_once, also the token the chunk codes first
            return self.recent_window - (not self.band_once)
        return None if self.sliding_window is None else self.sliding_window - 1

    def _lag(self, name: str) -> int:
        """How many tokens stream ``name`` lags behind the chunk: ``W`` for a main stream whose
        tokens are coded when they leave the band (``band_once``), else 0."""
        if self.band_once and f"band_{name}" in self.streams:
            return self.recent_window
        return 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append a chunk of new tokens; return it unchanged (attention reads this layer)."""
        if not self.active:
            why = (
                "it is a copy (copy, deepcopy or pickle), which no model uses"
                if getattr(self, "copied", False)
                else "it is used outside its rqlib.hf.compress(...) block"
            )
            raise RuntimeError(
                f"layer {self.layer_idx}: this CompressedCache cannot be updated: {why}; the "
                "model's own attention would read only the new tokens. Run the model inside "
                "`with rqlib.hf.compress(model, config) as cache:` and pass that cache"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_chunk(key_states, value_states)
        start, new = self.length, key_states.shape[-2]
        end = start + new
        try:
            self._store(start, end, key_states, value_states)
        except BaseException:
            for name, stream in self.streams.items():
                for ring in stream.rings:
                    ring.truncate(min(ring.end, max(0, start - self._lag(name))))
            raise
        self.length = end
        self._last = (start, new)
        self._chunk_keys = key_states
        return key_states, value_states

    def _check_chunk(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, dim = self.shape
        for name, t in (("keys", key_states), ("values", value_states)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (batch, heads, dim):
                raise ValueError(
                    f"layer {self.layer_idx}: {name} of shape {tuple(t.shape)} do not match this "
                    f"cache's [batch={batch}, kv_heads={heads}, S, head_dim={dim}]"
                )
            if t.device != self.device or t.dtype != self.dtype:
                raise ValueError(
                    f"layer {self.layer_idx}: {name} are {t.dtype} on {t.device}; this cache holds "
                    f"{self.dtype} on {self.device} (call reset() before a different model)"
                )

    def _store(self, start: int, end: int, key_states, value_states) -> None:
        """Encode the chunk and write every stream: positions ``start .. end - 1``, or for a
        lagging main stream (:meth:`_lag`) the tokens that leave the band with this chunk."""
        backend = self._backend()
        encoded, norms, spans = {}, [], {}
        names = sorted(self.streams, key=self._lag)  # the bands before the streams that read them
        for name in names:
            lag = self._lag(name)
            lo, hi = max(0, start - lag), max(0, end - lag)
            spans[name] = (lo, hi)
            if lag and hi == lo:
                continue  # no token leaves the band with this chunk
            if lag:
                band = "band_" + name
                states = self._band_copy(band, encoded[band], lo, hi, start)
            else:
                states = key_states if "keys" in name else value_states
            codec = self._codec(name)
            if codec is None:
                encoded[name] = (states,)
                norms.append(states)
            else:
                parts = codec.encode(states, backend=backend, validate=False).parts
                encoded[name] = parts
                norms.extend(part.norms for part in parts)
        self._check_finite(norms)
        for name, stream in self.streams.items():
            lo, hi = spans[name]
            window = self._window(name)
            keep_from = 0 if window is None else min(lo, start - window)
            slack = 0 if window is None else SHORT_QUERY - 1
            for index, ring in enumerate(stream.rings):
                # sized for the chunk's end even when the stream lags: the kernel reads a
                # layer's main keys and values at the same slots, so their rings keep one
                # capacity (and a stream no token has reached yet has its buffers)
                ring.ensure(keep_from, end, slack)
                if hi > lo:
                    ring.write(lo, encoded[name][index])
        if start < self.n_sink:
            take = min(self.n_sink, end) - start
            self.sink_keys[:, :, start : start + take] = key_states[:, :, :take]
            if self.sink_values is not None:
                self.sink_values[:, :, start : start + take] = value_states[:, :, :take]

    def _band_copy(self, band: str, chunk: tuple, lo: int, hi: int, start: int) -> torch.Tensor:
        """The band's copy ``[B, KV, hi - lo, d]`` of positions ``lo .. hi - 1``: those before
        ``start`` read from band stream ``band``, the others from ``chunk``, its encoding of the
        new tokens (codes are decoded; an exact band is its own copy)."""
        codec = self._codec(band)
        pieces = []
        if lo < start:
            stored = tuple(ring.read(lo, min(start, hi)) for ring in self.streams[band].rings)
            pieces.append(stored[0] if codec is None else codec.decode(CompressedParts(stored)))
        if hi > start:
            if codec is None:
                pieces.append(chunk[0][:, :, : hi - start])
            else:
                new = CompressedParts(chunk).map(lambda t: t[:, :, : hi - start])
                pieces.append(codec.decode(new))
        dtype = pieces[0].dtype if codec is None else torch.float32
        return torch.cat([p.to(dtype) for p in pieces], dim=2) if len(pieces) > 1 else pieces[0]

    def _codec(self, name: str) -> VectorCodec | None:
        return {
            "keys": self.key_codec,
            "values": self.value_codec,
            "band_keys": self.key_band_codec,
            "band_values": self.value_band_codec,
        }[name]

    def _check_finite(self, tensors: list[torch.Tensor]) -> None:
        """Refuse non-finite keys or values (and norms that overflow float16).

        The stored norms (or the exact states) are finite exactly when the inputs are. On the
        torch path the check runs now. On the Triton path (CUDA, or the interpreter) reading
        the flag would make the host wait for the device, and a decode step must not (a CUDA
        graph captures it), so the flag is kept on the device, combined over the steps, and read
        after a prompt (at the next step boundary), by :meth:`CompressedCache.check_finite`,
        and when the ``compress()`` block ends (:meth:`check_deferred`)."""
        same = all(t.shape == tensors[0].shape for t in tensors)
        if same:  # the norms of every codec: one check
            finite = torch.isfinite(torch.stack(tensors)).all()
        else:
            finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all()
        if self._backend() == "triton":
            self._deferred_check = (
                finite if self._deferred_check is None else self._deferred_check & finite
            )
            return
        if not bool(finite):
            raise ValueError(
                f"layer {self.layer_idx}: the new keys or values contain NaN or infinite values "
                "(or a norm overflows float16); nothing was stored"
            )

    def check_deferred(self) -> None:
        """Raise if the deferred finiteness check (Triton path) of the updates since the last
        check failed."""
        flag, self._deferred_check = self._deferred_check, None
        if flag is not None and not bool(flag):
            raise ValueError(
                f"layer {self.layer_idx}: the new keys or values contain NaN or infinite values "
                "(or a norm overflows float16): stored by a step since the last check"
            )

    def rollback(self) -> None:
        """Undo the last update (the previous contents of every stream survive one update)."""
        if self._last is None:
            raise RuntimeError(f"layer {self.layer_idx}: there is no update to roll back")
        start, _ = self._last
        for name, stream in self.streams.items():
            for ring in stream.rings:
                ring.truncate(min(ring.end, max(0, start - self._lag(name))))
        self.length = start
        self._last = None
        self._chunk_keys = None

    def mask_sizes(self, length: int, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask for a chunk after ``length`` tokens."""
        if self.sliding_window is None:
            return length + query_length, 0
        offset = max(0, length - self.sliding_window + 1)
        return length + query_length - offset, offset

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.mask_sizes(self.length, query_length)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a CompressedCache cannot be cropped (no assisted decoding)")

    def _map_batch(self, fn) -> None:
        for stream in self.streams.values():
            for ring in stream.rings:
                ring.map_batch(fn)
        for name in ("sink_keys", "sink_values"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))
        if self.is_initialized:
            self.shape = (self.streams["keys"].rings[0].batch, *self.shape[1:])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    # ---- memory --------------------------------------------------------------------------------
    def stored_tokens(self) -> dict[str, int]:
        """Tokens of one sequence each stream must hold now: all of them (a sliding layer: at most
        its window), the band at most ``W``, the sink at most ``n_sink``."""
        n = self.length
        counts = {}
        for name in self.streams:
            if name.startswith("band"):
                counts[name] = min(n, self.recent_window)
            elif self.sliding_window is not None:
                counts[name] = max(0, min(n, self.sliding_window) - self._lag(name))
            else:
                counts[name] = max(0, n - self._lag(name))
        counts["sink"] = min(n, self.n_sink)
        return counts

    def nbytes(self) -> int:
        """Bytes of the stored state (every batch row): the tokens of :meth:`stored_tokens` at
        their stored size (packed codes, norm bit fields, exact vectors in the model's dtype)."""
        if not self.is_initialized:
            return 0
        counts = self.stored_tokens()
        total = sum(
            ring.nbytes(counts[name])
            for name, stream in self.streams.items()
            for ring in stream.rings
        )
        for tensor in (self.sink_keys, self.sink_values):
            if tensor is not None:
                total += tensor[:, :, : counts["sink"]].numel() * tensor.element_size()
        return total

    def reserved_nbytes(self) -> int:
        """Bytes the buffers hold now, spare capacity included."""
        total = sum(ring.reserved_nbytes() for s in self.streams.values() for ring in s.rings)
        for tensor in (self.sink_keys, self.sink_values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total

    def constant_nbytes(self) -> int:
        """Bytes of this layer's calibrated constants (key means, channel scales, outlier
        channel indices, transforms), shared by every sequence."""
        total = 0
        for codec in (self.key_codec, self.value_codec, self.key_band_codec, self.value_band_codec):
            if codec is None:
                continue
            matrix = None if codec.transform is None else codec.transform.matrix
            for tensor in (codec.mean, codec.scale, matrix, *(p.channels for p in codec.parts)):
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
        return total

    def reserve(self, tokens: int) -> None:
        """Size the append-only streams for ``tokens`` tokens now (e.g. a prompt plus
        ``max_new_tokens``), so that no step in between reallocates them."""
        if not self.is_initialized:
            raise RuntimeError(f"layer {self.layer_idx}: reserve() needs a first update")
        for name, stream in self.streams.items():
            if self._window(name) is None:
                for ring in stream.rings:
                    ring.ensure(0, tokens)

    # ---- attention -----------------------------------------------------------------------------
    def _backend(self) -> str:
        return kernels.select_attention_backend(self.device, self.backend)

    def state(self) -> AttentionState:
        """What the attention of the last chunk reads (see :class:`AttentionState`)."""
        start, new = self._last
        end = start + new
        first = 0
        if self.sliding_window is not None:
            first = max(0, start - self.sliding_window + 1)
        return AttentionState(
            keys=self.streams["keys"],
            values=self.streams["values"],
            band_keys=self.streams.get("band_keys"),
            band_values=self.streams.get("band_values"),
            sink_keys=self.sink_keys,
            sink_values=self.sink_values,
            n_sink=min(self.n_sink, end),
            band=self.recent_window,
            start=start,
            end=end,
            first=first,
        )

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        mask,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, Lq, Hq, d]`` of ``query`` over every token this layer holds.

        ``key`` must be the tensor this layer's latest ``update`` returned (proof that the model
        wrote to this cache); ``mask`` a :class:`~rqlib.kernels.state.CausalMask` or a boolean
        ``[B, 1, Lq, kv_length]`` tensor (True = attend) sized by :meth:`get_mask_sizes`.
        """
        if self._last is None or key is not self._chunk_keys:
            raise RuntimeError(
                f"layer {self.layer_idx}: the attention received keys that this CompressedCache "
                "did not produce; pass the cache yielded by rqlib.hf.compress(...) to the model"
            )
        start, new = self._last
        if query.dim() != 4 or query.shape[2] != new or query.shape[0] != self.shape[0]:
            raise RuntimeError(
                f"layer {self.layer_idx}: expected queries [B={self.shape[0]}, Hq, {new}, d], "
                f"got {tuple(query.shape)}"
            )
        mask = self._checked_mask(mask, start, new)
        output = kernels.attention(
            self.state(), query, mask, scale=scaling, softcap=softcap, backend=self._backend()
        )
        return output.to(query.dtype).transpose(1, 2).contiguous()

    def _checked_mask(self, mask, start: int, new: int):
        """The mask as a CausalMask / DenseMask, checked against this chunk (no host sync)."""
        kv_length, kv_offset = self.mask_sizes(start, new)
        if isinstance(mask, CausalMask):
            expected = (self.shape[0], start, new, kv_offset, kv_length)
            got = (mask.batch, mask.q_offset, mask.q_length, mask.kv_offset, mask.kv_length)
            window_ok = mask.window == self.sliding_window or (
                mask.window is not None and self.sliding_window is None
            )
            if got != expected or not window_ok:
                raise RuntimeError(
                    f"layer {self.layer_idx}: the mask covers (batch, first query, queries, "
                    f"first key, keys) = {got} with window {mask.window}; this chunk needs "
                    f"{expected} with window {self.sliding_window}; is the rqlib mask function "
                    "registered?"
                )
            return mask
        if (
            not isinstance(mask, torch.Tensor)
            or mask.dtype != torch.bool
            or mask.dim() != 4
            or mask.shape[-2:] != (new, kv_length)
        ):
            raise RuntimeError(
                f"layer {self.layer_idx}: expected a boolean mask [B, 1, {new}, {kv_length}] or a "
                f"CausalMask, got {getattr(mask, 'shape', type(mask).__name__)}; is the rqlib mask "
                "function registered?"
            )
        if self.band_once:
            raise RuntimeError(
                f"layer {self.layer_idx}: the recent band stored once (spec token once) needs a "
                "causal mask, and this forward passes an explicit one (an extra mask function or "
                "packed sequences), under which a query may read a token that has no main codes yet"
            )
        return DenseMask(mask, kv_offset)


class CompressedCache(Cache):
    """A cache of :class:`CompressedLayer` objects, one per decoder layer; built by
    :func:`rqlib.hf.compress`, which also records the config it implements.

    Step protocol (see the module docstring): :meth:`begin_step`, :meth:`commit` and
    :meth:`rollback` are called by :meth:`update` and :meth:`attend`; callers may also call
    them directly, e.g. to abandon a forward they stopped themselves.
    """

    def __init__(self, layers: list[CompressedLayer], config, model_id: int) -> None:
        super().__init__(layers=layers)
        self.config = config
        self.model_id = model_id
        self._step_start: int | None = None  # length before the open step (None: no step)
        self._updated: list[int] = []  # layers updated in the open (or last) step

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_step_start"], state["_updated"] = None, []
        return state

    def __copy__(self) -> CompressedCache:
        """A copy is independent (as a deep copy): sharing layers would share their tokens."""
        return copy.deepcopy(self)

    def set_active(self, active: bool) -> None:
        """Allow (or forbid) updates: only inside the compress() block that made the cache."""
        for layer in self.layers:
            layer.active = active
            if active:
                layer.copied = False

    def set_backend(self, backend: str) -> None:
        """Run the attention with ``"triton"``, ``"torch"`` or ``"auto"`` (Triton on CUDA,
        torch on CPU). ``"triton"`` on CPU needs ``TRITON_INTERPRET=1`` (the tests use it)."""
        if backend not in kernels.BACKENDS:
            raise ValueError(f"backend must be one of {kernels.BACKENDS}, got {backend!r}")
        for layer in self.layers:
            layer.backend = backend

    def keep_decoded(self, keep: bool = True) -> None:
        """Keep a decoded copy of the codes beside them (``keep=False`` drops it), to make decode
        steps fast on CPU: attention then reads each stored key's and value's codebook values
        and norm from the copy instead of decoding every code again at every step. Results are
        the same bit for bit; memory is not: the copy takes ``4·(D + 1)`` bytes per token, KV
        head and stream (float32), more than a float16 cache. :meth:`nbytes` still counts what is
        stored compressed; :meth:`reserved_nbytes` includes the copy. Meant for evaluation on
        CPU (``rqlib eval --mode decode`` uses it); the Triton kernels never read it. Tokens
        already stored are decoded once now."""
        if not isinstance(keep, bool):
            raise TypeError(f"keep must be True or False, got {keep!r}")
        before = [layer.decoded_copy for layer in self.layers]
        try:
            for layer in self.layers:
                layer.keep_decoded(keep)
        except BaseException:  # a copy that fails to build leaves every layer as it was
            for layer, had_copy in zip(self.layers, before):
                if had_copy != keep:  # dropping a copy cannot fail
                    layer.keep_decoded(had_copy)
            raise

    # ---- steps ---------------------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        """Whether a forward is under way (some layers updated, not all)."""
        return self._step_start is not None

    def begin_step(self) -> None:
        """Open a step. An incomplete previous step is rolled back first, with a warning; a
        previous step that stored non-finite values (checked here on CUDA) is rolled back and
        reported as an error."""
        if self.in_step:
            updated = list(self._updated)
            self.rollback()
            warnings.warn(
                f"the previous forward stopped after updating layers {updated} of "
                f"{len(self.layers)}; those tokens were rolled back so that every layer holds "
                f"{self.get_seq_length()} tokens",
                RuntimeWarning,
                stacklevel=3,
            )
        prompt = any(layer._last is not None and layer._last[1] > 1 for layer in self.layers)
        if prompt:  # after a decode step the flags stay on the device (check_finite)
            for layer in self.layers:
                try:
                    layer.check_deferred()
                except ValueError as error:
                    self.rollback()
                    error.add_note(f"that step was rolled back to {self.get_seq_length()} tokens")
                    raise
        lengths = {layer.length for layer in self.layers}
        if len(lengths) != 1:
            raise RuntimeError(
                f"the layers of this cache hold different numbers of tokens {sorted(lengths)}; "
                "reset() it"
            )
        self._step_start = lengths.pop()
        self._updated = []

    def check_finite(self) -> None:
        """Raise ``ValueError`` if a step since the last check stored non-finite keys or values
        (on the Triton path decode steps check on the device and are read here, by the next
        prompt, and when the ``compress()`` block ends). Reads a device value: the host waits
        for the device."""
        for layer in self.layers:
            layer.check_deferred()

    def commit(self) -> None:
        """Close the open step (every layer was updated); it can still be rolled back until the
        next step begins."""
        self._step_start = None

    def rollback(self) -> bool:
        """Undo the open step, or the last complete one if none is open: every layer updated in
        it goes back to the length before it. Returns whether anything was undone."""
        undone = False
        for index in self._updated:
            layer = self.layers[index]
            if layer._last is not None:
                layer.rollback()
                undone = True
        self._step_start = None
        self._updated = []
        return undone

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """``CompressedLayer.update`` of ``layer_idx`` within the step protocol."""
        if not self.in_step or layer_idx in self._updated:
            self.begin_step()
        try:
            result = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        except BaseException as error:
            if self.rollback():
                error.add_note(f"the cache was rolled back to {self.get_seq_length()} tokens")
            raise
        self._updated.append(layer_idx)
        if len(self._updated) == len(self.layers):
            self.commit()
        return result

    def attend(self, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        """``CompressedLayer.attend`` of ``layer_idx``; a failure rolls the step back."""
        try:
            return self.layers[layer_idx].attend(*args, **kwargs)
        except BaseException as error:
            if self.rollback():
                error.add_note(f"the cache was rolled back to {self.get_seq_length()} tokens")
            raise

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held (during an open step: before it, as the model saw when it started)."""
        if self.in_step:
            return self._step_start
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        layer = self.layers[layer_idx]
        return layer.mask_sizes(self.get_seq_length(layer_idx), query_length)

    def reset(self) -> None:
        super().reset()
        self._step_start, self._updated = None, []

    # ---- memory --------------------------------------------------------------------------------
    def reserve(self, tokens: int) -> None:
        """:meth:`CompressedLayer.reserve` on every layer."""
        for layer in self.layers:
            layer.reserve(tokens)

    def nbytes(self) -> int:
        """Bytes of the stored state of all layers (see :meth:`CompressedLayer.nbytes`)."""
        return sum(layer.nbytes() for layer in self.layers)

    def reserved_nbytes(self) -> int:
        """Bytes all buffers hold now, spare capacity included."""
        return sum(layer.reserved_nbytes() for layer in self.layers)

    def constant_nbytes(self) -> int:
        """Bytes of the calibrated constants of all layers."""
        return sum(layer.constant_nbytes() for layer in self.layers)

    def bytes_per_token(self) -> float:
        """Stored bytes per token of one sequence (``nbytes / (batch * tokens)``)."""
        length = self.get_seq_length()
        if length == 0:
            raise ValueError("the cache is empty: bytes_per_token needs at least one token")
        return self.nbytes() / (self._batch_size() * length)

    def _batch_size(self) -> int:
        for layer in self.layers:
            if layer.is_initialized:
                return layer.shape[0]
        raise ValueError("the cache is empty")
