"""What the attention kernel computes on a GPU's tensor cores, stated once.

The attention kernel multiplies on fp16 tensor cores, which take fp16 inputs, multiply them
exactly (11 by 11 significant bits fit in the 24 of float32) and accumulate in float32. Three
choices make that an exact statement about what it computes:

- **The kernel's codebook is the codebook rounded to fp16** (:func:`kernel_centroids`): every
  centroid moves by at most ``2^-11`` of itself (:data:`CODEBOOK_ROUNDING`), a fixed change of
  the codebook, not a rounding of each product. The torch implementation reads the float32
  codebook. For a trellis code the codebook is the trellis's levels (:func:`code_levels`),
  indexed by the shift register instead of the code.
- **The attention kernel's scores read the keys' codebook from a table of centroid pairs**
  (:func:`kernel_table`): for codes of up to :data:`PAIR_MAX_BITS` bits, entry ``i + 2^b j``
  holds centroids ``i`` and ``j``, so the ``2b`` bits of two adjacent codes in a packed row
  index both at once. The same values as the codebook, in half the loads.
- **The other factor is split in two fp16 parts** (``triton_common.split_dot``): the rotated
  query rows and the weights ``p ||v||``. ``x = hi + lo + r`` with
  ``|r| <= 2^-22 |x| + 2^-25``: float32 accuracy, in two products.
- **Query rows are scaled into [-1, 1] by a power of two** (:func:`scaled_rows`), exactly, so
  that no rotated query overflows fp16 and every part keeps its relative accuracy; the scores
  are multiplied back by the same power. A weight ``p ||v||`` is at most ``||v||``, a float16
  norm, so it cannot overflow either.

So the kernel computes, to float32 accuracy, the attention of the cache read with the fp16
codebook: :func:`on_kernel_codebook` gives that state, for the torch implementation
(``rqlib.kernels.reference``) to compute in float64 as the kernel's oracle. Against the float32
codebook a score ``||k|| <R q, c>`` moves by at most ``2^-11 ||k|| sum_j |(R q)_j| |c_j|``.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "CODEBOOK_DTYPE",
    "code_levels",
    "CODEBOOK_ROUNDING",
    "PART_REMAINDER",
    "PAIR_DTYPES",
    "PAIR_CENTROID_DTYPES",
    "PAIR_MAX_BITS",
    "StreamConstants",
    "device_float",
    "kernel_centroids",
    "kernel_quantizer",
    "kernel_table",
    "on_kernel_codebook",
    "scaled_rows",
    "table_halves",
    "trellis_tables",
]

#: the dtype of the attention kernel's codebook (and of its tensor-core inputs)
CODEBOOK_DTYPE = torch.float16
#: how far a centroid moves, relative to itself, when rounded to fp16 (fp16 keeps 11
#: significant bits: half a unit of the last is at most 2^-11 of the number)
CODEBOOK_ROUNDING = 2.0**-11
#: ``(relative, absolute)``: ``|x - hi - lo| <= relative |x| + absolute`` for the fp16 parts of
#: a float32 ``x`` in fp16's range (``absolute``: half the spacing of fp16's subnormals)
PART_REMAINDER = (2.0**-22, 2.0**-25)


#: the widest codes whose centroids the kernel reads two at a time: a table of ``4^b`` pairs
#: (1 KB of fp16 pairs at 4 bits; 5 bits would take 4 KB of the L1 cache, 8 bits 256 KB)
PAIR_MAX_BITS = 4
#: the integer that holds a pair of centroids of each dtype, and the reverse
PAIR_DTYPES = {torch.float16: torch.int32, torch.float32: torch.int64}
PAIR_CENTROID_DTYPES = {pair: centroid for centroid, pair in PAIR_DTYPES.items()}
#: the integer as wide as one centroid, that holds its bits
_CENTROID_BITS = {torch.float16: torch.int16, torch.float32: torch.int32}

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # quantizer -> its tables


def code_levels(quantizer) -> torch.Tensor:
    """The float32 values a quantizer's stored codes read: its centroids (indexed by a code),
    or for a trellis code its levels (``trellis_levels``, ``2^L`` values indexed by the shift
    register at the code: ``triton_common.trellis_states``). Empty without codes."""
    if getattr(quantizer, "trellis", None) is not None:
        return quantizer.trellis_levels.to(torch.float32)
    return quantizer.centroids.to(torch.float32)


def kernel_centroids(quantizer, device, dtype: torch.dtype = CODEBOOK_DTYPE) -> torch.Tensor:
    """The attention kernel's codebook for ``quantizer``: its centroids rounded to fp16 (to
    nearest), on ``device``, held in ``dtype`` (fp16, or float32 for the scores on the CUDA
    cores: the same values); a one-element zero table for a quantizer without codes. Made once
    per quantizer, device and dtype: a launch reads it without converting anything."""
    tables = _TABLES.setdefault(quantizer, {})
    key = (torch.device(device), dtype)
    if key not in tables:
        centroids = code_levels(quantizer)
        if centroids.numel() == 0:
            table = torch.zeros(1, dtype=dtype, device=device)
        else:
            table = centroids.to(device=device, dtype=CODEBOOK_DTYPE).to(dtype).contiguous()
        tables[key] = table
    return tables[key]


def kernel_table(quantizer, device, dtype: torch.dtype = CODEBOOK_DTYPE) -> torch.Tensor:
    """The attention kernel's table of centroid pairs for ``quantizer``: the centroids of
    :func:`kernel_centroids` held in ``dtype`` (fp16 or float32), two to an entry of
    :data:`PAIR_DTYPES` ``[dtype]``, entry ``i + n j`` holding centroid ``i`` in its low half
    and ``j`` in its high half (``n`` centroids). Two adjacent ``b``-bit codes of a packed row,
    read as one ``2b``-bit field, are the index of their pair (``triton_common.
    load_centroid_pairs``), and entry ``c`` alone holds centroid ``c`` in its low half. For
    ``b > PAIR_MAX_BITS`` only the entries ``j = 0`` are made. Made once per quantizer, device
    and dtype."""
    if dtype not in PAIR_DTYPES:
        raise ValueError(f"centroid pairs are of {list(PAIR_DTYPES)}, not {dtype}")
    tables = _TABLES.setdefault(quantizer, {})
    key = ("pairs", torch.device(device), dtype)
    if key not in tables:
        width = torch.finfo(dtype).bits
        centroids = kernel_centroids(quantizer, "cpu", dtype).view(_CENTROID_BITS[dtype])
        low = centroids.long() & ((1 << width) - 1)  # each centroid's bits, unsigned
        high = low if len(low) <= 1 << PAIR_MAX_BITS else torch.zeros_like(low[:1])
        entries = low[None, :] | (high[:, None] << width)  # int64 arithmetic wraps, bit-exact
        tables[key] = entries.reshape(-1).to(PAIR_DTYPES[dtype]).to(device)
    return tables[key]


def trellis_tables(quantizer, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The trellis encoder kernel's tables for ``quantizer`` on ``device``, float64: the
    trellis's table (unit variance: what the search compares the scaled samples with) and its
    levels (``trellis_levels``: what the decoder reads). Made once per quantizer and device."""
    tables = _TABLES.setdefault(quantizer, {})
    key = ("trellis", torch.device(device))
    if key not in tables:
        tables[key] = (
            quantizer.trellis.table.to(device).contiguous(),
            quantizer.trellis_levels.to(device).contiguous(),
        )
    return tables[key]


#: tensor -> its copies, by identity (tensors compare element by element)
_DEVICE_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def device_float(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` as a contiguous float32 tensor on ``device``, made once per tensor and device
    (the copy is kept as long as ``tensor`` lives): a launch that reads a layer's constants
    (rotations, sketches, channel scales, means) copies nothing from the host. ``tensor`` must
    not change in place afterwards."""
    copies = _DEVICE_COPIES.setdefault(tensor, {})
    key = torch.device(device)
    if key not in copies:
        copies[key] = tensor.to(device=device, dtype=torch.float32).contiguous()
    return copies[key]


@dataclasses.dataclass(frozen=True)
class StreamConstants:
    """What the attention's host side reads of a stream of codes, float32 on one device: the
    quantizer's ``rotation`` matrix ``[D, d]`` and QJL ``sketch`` ``[m, D]`` (``None``
    without QJL), and the stream's channel ``scale`` and ``mean`` ``[KV, d]`` (``None`` where
    it has none)."""

    rotation: torch.Tensor
    sketch: torch.Tensor | None
    scale: torch.Tensor | None
    mean: torch.Tensor | None


def stream_constants(stream, device) -> StreamConstants:
    """The :class:`StreamConstants` of a :class:`~rqlib.kernels.state.Stream` of codes on
    ``device``, each made once (:func:`device_float`)."""
    quantizer = stream.parts[0].quantizer
    return StreamConstants(
        rotation=device_float(quantizer.rotation.matrix, device),
        sketch=device_float(quantizer.sketch, device) if quantizer.has_qjl else None,
        scale=None if stream.scale is None else device_float(stream.scale, device),
        mean=None if stream.mean is None else device_float(stream.mean, device),
    )


def table_halves(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)``: the two centroids that entries of a table of centroid pairs
    (:func:`kernel_table`) hold, fp16 from int32 entries and float32 from int64 ones, as the
    kernel splits them (``triton_common.pair_halves``)."""
    dtype = PAIR_CENTROID_DTYPES.get(entries.dtype)
    if dtype is None:
        raise ValueError(
            f"tables of centroid pairs are of {list(PAIR_CENTROID_DTYPES)}, not {entries.dtype}"
        )
    halves, width = _CENTROID_BITS[dtype], torch.finfo(dtype).bits
    return entries.to(halves).view(dtype), (entries >> width).to(halves).view(dtype)


def kernel_quantizer(quantizer):
    """A copy of ``quantizer`` that decodes with the kernel's codebook (its float32 centroids,
    or a trellis's levels, replaced by the values of :func:`kernel_centroids`); it stores codes
    exactly as ``quantizer`` does (same boundaries, rotation and sketch)."""
    rounded = copy.copy(quantizer)
    if getattr(quantizer, "trellis", None) is not None:
        levels = kernel_centroids(quantizer, quantizer.trellis_levels.device)
        rounded.trellis_levels = levels.to(torch.float64)
    elif quantizer.centroids.numel():
        device = quantizer.centroids.device
        rounded.centroids = kernel_centroids(quantizer, device).to(torch.float32)
    return rounded


def _on_kernel_codebook_stream(stream, rounded: dict):
    if stream is None or stream.is_exact:
        return stream
    parts = []
    for part in stream.parts:
        qz = part.quantizer
        if id(qz) not in rounded:
            rounded[id(qz)] = kernel_quantizer(qz)
        ring = copy.copy(part.ring)  # shares the stored buffers; decodes with the copy
        ring.quantizer, ring.has_decoded = rounded[id(qz)], False
        parts.append(dataclasses.replace(part, quantizer=rounded[id(qz)], ring=ring))
    return dataclasses.replace(stream, parts=tuple(parts))


def on_kernel_codebook(state):
    """The :class:`~rqlib.kernels.state.AttentionState` ``state`` read with the kernel's
    codebook: the same stored bytes, decoded with :func:`kernel_quantizer` of each quantizer.
    The torch implementation of the attention computes, on it, what the kernel computes."""
    rounded: dict = {}
    streams = ("keys", "values", "band_keys", "band_values")
    return dataclasses.replace(
        state,
        **{name: _on_kernel_codebook_stream(getattr(state, name), rounded) for name in streams},
    )


def scaled_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows / s, s)`` for float32 ``rows [..., n]``: ``s [...]`` the power of two above the
    largest magnitude of its row, at most twice it (1 for a row of zeros), so that the scaled
    rows lie in ``(-1, 1)``, within fp16's range, and dividing by ``s`` is exact. Both
    contiguous."""
    largest = rows.abs().amax(dim=-1)
    _, exponent = torch.frexp(largest)  # largest = f 2^e, 0.5 <= f < 1, so largest < 2^e
    scale = torch.ldexp(torch.ones_like(largest), exponent)
    scale = torch.where(largest > 0, scale, torch.ones_like(scale))
    return (rows / scale[..., None]).contiguous(), scale.contiguous()
