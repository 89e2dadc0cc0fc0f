"""Token storage written in place: one stream of vectors per buffer set, ring-addressed.

A :class:`VectorRing` holds one stream of one layer (the keys as codes of one quantizer, the
values kept exact, the recent band, ...) for ``[batch, kv_heads]`` along a token axis of
``capacity`` slots; the token at absolute position ``p`` lives in slot ``p % capacity``. An
append-only stream (all tokens kept) simply has ``capacity > p`` for every stored ``p``; a
window (the recent band, a sliding-window layer) keeps a few slots more than it needs and
overwrites the oldest.

Packed streams store exactly what the bit accounting counts (:mod:`rqlib.spec.bits`):

- ``codes``   ``uint8 [B, KV, C, ceil(D·b/8)]`` packed code rows (when the quantizer has codes);
- ``norms``   ``uint8 [B, KV, C·w/8 + 2]``: the norms as one bit stream of ``w``-bit fields along
  the token axis (``w = quantizer.norm_bits``: 11 bits for ``nm=6``, 16 for float16), slot ``s``
  at stream bits ``s·w .. s·w + w - 1`` (:func:`rqlib.core.packing.pack_fields`), and
  :data:`NORM_TAIL` spare bytes, so that the attention kernel reads any field as three whole
  bytes without a mask;
- ``signs`` / ``rnorms``: QJL sign rows and residual norms (``-prod`` quantizers), the same way.

Exact streams hold ``[B, KV, C, d]`` in the model's dtype. Capacities are multiples of
``limits.RING_GRANULE`` slots: a norm stream is a whole number of bytes, slot groups of eight
start on byte boundaries, and the attention kernel's key tiles (of at most
``limits.widest_tile()`` keys, which divides it) never cross the end of a ring.
Buffers are allocated as zeros, so every slot holds a stored token or zeros: the kernel reads
whole tiles without masks and masks the keys it does not need out of the softmax.

A packed stream can also keep a **decoded copy** (:meth:`VectorRing.keep_decoded`): the codebook
values of its codes (``float32 [B, KV, C, D]``) and its norms (``float32 [B, KV, C]``), written
once per token beside the codes, so that attention on CPU reads them instead of decoding every
stored code again at every step. They are what :meth:`VectorRing.decoded` would compute from the
codes, bit for bit; they are not part of the stored size (:meth:`VectorRing.nbytes`), and cost
``4·(D + 1)`` bytes per token and head, more than the codes save (see
:meth:`rqlib.hf.cache.CompressedCache.keep_decoded`).

Writing ``L`` tokens copies ``L`` tokens; :meth:`VectorRing.ensure` grows the buffers (doubling,
so appending costs amortized O(1) per token) or shrinks an oversized window before a write, and
keeps every position the caller still needs, so that the previous contents survive a write that
is later rolled back.
"""

from __future__ import annotations

import torch

from rqlib.core.estimator import centroid_values
from rqlib.core.packing import norm_fields, norm_table, unpack_fields, write_fields
from rqlib.core.quantizers import CompressedVectors
from rqlib.kernels.limits import RING_GRANULE

__all__ = ["NORM_TAIL", "VectorRing", "norm_stream_bytes", "round_capacity"]

NORM_TAIL = 2  # spare bytes after a norm stream: a field is read as 3 bytes from its first
DECODED_DTYPE = torch.float32  # the dtype of a decoded copy (the attention's dtype on CPU)
DECODED = ("decoded", "norm_values")  # its buffers


def round_capacity(n: int) -> int:
    """The smallest capacity >= ``n`` (and >= ``limits.RING_GRANULE``) that is a multiple of
    ``RING_GRANULE``."""
    return max(RING_GRANULE, -(-n // RING_GRANULE) * RING_GRANULE)


def norm_stream_bytes(capacity: int, width: int) -> int:
    """Bytes of a norm stream of ``capacity`` fields of ``width`` bits and its
    :data:`NORM_TAIL` spare bytes."""
    return capacity * width // 8 + NORM_TAIL


def _runs(start: int, stop: int, capacity: int) -> list[tuple[int, int, int]]:
    """``(slot_lo, slot_hi, offset)`` runs covering positions ``start..stop-1`` of a ring
    (``offset``: index of the run's first position in ``start..stop-1``)."""
    runs, position = [], start
    while position < stop:
        slot = position % capacity
        n = min(stop - position, capacity - slot)
        runs.append((slot, slot + n, position - start))
        position += n
    return runs


class VectorRing:
    """One stream of vectors along a ring-addressed token axis (see the module docstring).

    ``quantizer`` set: packed codes of that quantizer (its norms must be float16); else exact
    vectors of ``dim`` coordinates in ``dtype``. ``end`` is one past the last position written.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        device: torch.device,
        *,
        quantizer=None,
        dim: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if (quantizer is None) == (dim is None):
            raise ValueError("a VectorRing stores either a quantizer's codes or exact vectors")
        if quantizer is not None and quantizer.norm_dtype != torch.float16:
            raise ValueError(
                f"the cache stores norms as float16 fields; {quantizer!r} stores "
                f"{quantizer.norm_dtype}"
            )
        self.batch, self.heads, self.device = batch, heads, torch.device(device)
        self.quantizer, self.dim, self.dtype = quantizer, dim, dtype
        self.capacity = 0
        self.end = 0
        self.buffers: dict[str, torch.Tensor] = {}
        self.has_decoded = False

    # ---- layout ------------------------------------------------------------------------------
    @property
    def packed(self) -> bool:
        return self.quantizer is not None

    @property
    def norm_width(self) -> int:
        return self.quantizer.norm_bits

    def _row_shapes(self, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        lead = (self.batch, self.heads)
        if not self.packed:
            return {"exact": ((*lead, capacity, self.dim), self.dtype)}
        qz = self.quantizer
        stream_bytes = norm_stream_bytes(capacity, self.norm_width)
        shapes = {"norms": ((*lead, stream_bytes), torch.uint8)}
        if qz.mse_bits:
            code_bytes = (qz.rotated_dim * qz.mse_bits + 7) // 8
            shapes["codes"] = ((*lead, capacity, code_bytes), torch.uint8)
        if qz.has_qjl:
            shapes["signs"] = ((*lead, capacity, (qz.qjl_dim + 7) // 8), torch.uint8)
            shapes["rnorms"] = ((*lead, stream_bytes), torch.uint8)
        if self.has_decoded:
            shapes.update(self._decoded_shapes(capacity))
        return shapes

    def _decoded_shapes(self, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        lead = (self.batch, self.heads)
        return {
            "decoded": ((*lead, capacity, self.quantizer.rotated_dim), DECODED_DTYPE),
            "norm_values": ((*lead, capacity), DECODED_DTYPE),
        }

    def bytes_per_token(self) -> float:
        """Stored bytes per token and (batch row, KV head): what the accounting counts."""
        if not self.packed:
            return self.dim * torch.finfo(self.dtype).bits / 8
        return self.quantizer.bits_per_vector / 8

    def nbytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` tokens of every (batch row, KV head) at their stored size: code
        and sign rows whole, norm fields as bits of one stream (``ceil(tokens·w/8)`` bytes)."""
        rows = self.batch * self.heads
        if not self.packed:
            return rows * tokens * self.dim * torch.finfo(self.dtype).bits // 8
        qz = self.quantizer
        per_row = (tokens * self.norm_width + 7) // 8
        if qz.mse_bits:
            per_row += tokens * ((qz.rotated_dim * qz.mse_bits + 7) // 8)
        if qz.has_qjl:
            per_row += tokens * ((qz.qjl_dim + 7) // 8) + (tokens * self.norm_width + 7) // 8
        return rows * per_row

    def reserved_nbytes(self) -> int:
        """Bytes the buffers hold now (spare capacity and a decoded copy included)."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    # ---- the decoded copy --------------------------------------------------------------------
    def keep_decoded(self, keep: bool = True) -> None:
        """Keep (or drop) a decoded copy of the codes and norms (see the module docstring);
        the tokens stored so far are decoded once now."""
        if not self.packed:
            raise ValueError("an exact stream has nothing to decode")
        if keep == self.has_decoded:
            return
        if not keep:
            for name in DECODED:
                self.buffers.pop(name, None)
            self.has_decoded = False
            return
        if self.buffers:  # decode the stored tokens; nothing changes if that fails
            first = max(0, self.end - self.capacity)
            fields = self._decoded_fields(self.read(first, self.end)) if first < self.end else {}
            try:
                for name, (shape, dtype) in self._decoded_shapes(self.capacity).items():
                    self.buffers[name] = torch.zeros(shape, dtype=dtype, device=self.device)
                if fields:
                    self._write(first, fields)
            except BaseException:
                for name in DECODED:
                    self.buffers.pop(name, None)
                raise
        self.has_decoded = True  # (nothing allocated yet: the first write allocates the copy)

    def _decoded_fields(self, data, fields: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The decoded copy of ``data`` (its norm ``fields`` if already at hand), computed as
        :meth:`decoded` computes it from a read."""
        if fields is None:
            fields = norm_fields(data.norms, self.norm_width)
        table = norm_table(self.norm_width, DECODED_DTYPE, str(self.device))
        return {"decoded": centroid_values(data, DECODED_DTYPE), "norm_values": table[fields]}

    def decoded(self, start: int, stop: int, dtype: torch.dtype = torch.float32):
        """``(c_hat [B, KV, n, D], norms [B, KV, n])`` of positions ``start .. stop - 1`` in
        ``dtype``: the codebook values of the codes and the stored norms, from the decoded copy
        when there is one (and ``dtype`` is its dtype), else decoded from the codes now."""
        if not (self.has_decoded and dtype == DECODED_DTYPE):
            stored = self.read(start, stop, dtype)
            return centroid_values(stored, dtype), stored.norms
        self._check_stored(start, stop)
        buffers = {name: self.buffers[name] for name in DECODED}
        fields = self._read(buffers, self.capacity, start, stop)
        return fields["decoded"], fields["norm_values"]

    # ---- capacity ----------------------------------------------------------------------------
    def ensure(self, keep_from: int, end: int, slack: int = 0) -> None:
        """Make room for positions up to ``end`` while keeping ``keep_from .. self.end - 1``.

        Grows to at least twice the capacity when it must grow (amortized appends); shrinks a
        buffer more than twice larger than ``end - keep_from + slack`` (a window after a long
        prompt). Either way the kept positions are copied once.
        """
        keep_from = max(0, keep_from)
        need = end - keep_from
        target = round_capacity(need + slack)
        if self.capacity >= need and self.capacity <= 2 * target:
            return
        capacity = round_capacity(max(need, 2 * self.capacity)) if self.capacity < need else target
        self._reallocate(capacity, keep_from)

    def _reallocate(self, capacity: int, keep_from: int) -> None:
        old, old_capacity = self.buffers, self.capacity
        self.buffers = {
            name: torch.zeros(shape, dtype=dtype, device=self.device)
            for name, (shape, dtype) in self._row_shapes(capacity).items()
        }
        self.capacity = capacity
        first = max(keep_from, self.end - old_capacity, 0)
        if old and first < self.end:
            kept = self._read(old, old_capacity, first, self.end)
            self._write(first, kept)

    # ---- writing and reading -----------------------------------------------------------------
    def write(self, start: int, data) -> None:
        """Store ``data`` (``CompressedVectors [B, KV, L]`` or a tensor ``[B, KV, L, d]``) at
        positions ``start .. start + L - 1``; the capacity must hold ``L`` tokens."""
        length = data.shape[2]
        if length > self.capacity:
            raise ValueError(f"{length} tokens do not fit a ring of {self.capacity} slots")
        self._write(start, self._fields(data))
        self.end = start + length

    def _fields(self, data) -> dict[str, torch.Tensor]:
        """The tensors to store, by buffer name (norms as int32 fields)."""
        if not self.packed:
            return {"exact": data}
        if data.quantizer is not self.quantizer:
            raise ValueError(
                f"vectors of {data.quantizer!r} written to a ring of {self.quantizer!r}"
            )
        fields = {"norms": norm_fields(data.norms, self.norm_width)}
        if self.quantizer.mse_bits:
            fields["codes"] = data.codes
        if self.quantizer.has_qjl:
            fields["signs"] = data.qjl_signs
            fields["rnorms"] = norm_fields(data.residual_norms, self.norm_width)
        if self.has_decoded:
            fields.update(self._decoded_fields(data, fields["norms"]))
        return fields

    def _write(self, start: int, fields: dict[str, torch.Tensor]) -> None:
        length = next(iter(fields.values())).shape[2]
        width = self.norm_width if self.packed else 0
        for lo, hi, offset in _runs(start, start + length, self.capacity):
            for name, values in fields.items():
                buffer = self.buffers[name]
                if name in ("norms", "rnorms"):  # bit fields: the neighbours' bits are kept
                    write_fields(buffer, lo, values[..., offset : offset + hi - lo], width)
                else:
                    buffer[:, :, lo:hi].copy_(values[:, :, offset : offset + hi - lo])

    def _read(self, buffers, capacity: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        width = self.norm_width if self.packed else 0
        pieces: dict[str, list[torch.Tensor]] = {name: [] for name in buffers}
        for lo, hi, _ in _runs(start, stop, capacity):
            for name, buffer in buffers.items():
                if name in ("norms", "rnorms"):
                    g_lo = lo // 8 * 8
                    region = buffer[..., g_lo * width // 8 : -(-hi * width // 8)]
                    pieces[name].append(unpack_fields(region, width, hi - g_lo)[..., lo - g_lo :])
                else:
                    pieces[name].append(buffer[:, :, lo:hi])
        return {
            name: parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
            for name, parts in pieces.items()
        }

    def read(self, start: int, stop: int, norm_dtype: torch.dtype = torch.float16):
        """Positions ``start .. stop - 1`` as ``CompressedVectors [B, KV, n]`` (norms in
        ``norm_dtype``, by one lookup of their fields) or a tensor ``[B, KV, n, d]``: views of the
        buffers when the slots are contiguous."""
        self._check_stored(start, stop)
        buffers = {k: v for k, v in self.buffers.items() if k not in DECODED}
        fields = self._read(buffers, self.capacity, start, stop)
        if not self.packed:
            return fields["exact"]
        qz = self.quantizer
        width = self.norm_width
        if "codes" in fields:
            codes = fields["codes"]
        else:
            codes = torch.zeros(
                self.batch, self.heads, stop - start, 0, dtype=torch.uint8, device=self.device
            )
        table = norm_table(width, norm_dtype, str(self.device))

        def norms(name: str) -> torch.Tensor:
            return table[fields[name]]

        return CompressedVectors(
            codes, norms("norms"), fields.get("signs"), norms("rnorms") if qz.has_qjl else None, qz
        )

    def _check_stored(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.end or stop - start > self.capacity:
            raise ValueError(
                f"positions {start}..{stop - 1} are not stored (ring holds up to {self.end - 1}, "
                f"{self.capacity} slots)"
            )

    def truncate(self, end: int) -> None:
        """Forget positions ``end`` and later (a rolled-back step); their slots stay as they
        are and are overwritten by the next write."""
        if end > self.end:
            raise ValueError(f"cannot truncate a ring holding {self.end} tokens to {end}")
        self.end = end

    def map_batch(self, fn) -> None:
        """Apply ``fn`` to every buffer along the batch axis (beam search, batch selection)."""
        self.buffers = {name: fn(t) for name, t in self.buffers.items()}
        if self.buffers:
            self.batch = next(iter(self.buffers.values())).shape[0]
