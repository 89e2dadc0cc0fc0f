"""Bit-packing of b-bit codes, sign bits and wider fields into ``uint8`` along the last axis.

The layout is a little-endian bit stream: field j of width w occupies stream bits j·w … j·w + w − 1
(its least significant bit first), and stream bit t is bit ``t % 8`` of byte ``t // 8``.
n fields of w bits take exactly ceil(n·w/8) bytes; a field may straddle bytes. A kernel reads
field j as ``(byte[o//8] | byte[o//8 + 1] << 8 | ...) >> (o % 8)`` masked to w bits, ``o = j·w``.

- codes (1..8 bits): :func:`pack_bits` / :func:`unpack_bits`; eight codes fill exactly b bytes,
  so both work on 64-bit words of eight codes;
- sign bits are 1-bit codes, 1 standing for +1 and 0 for −1 (:func:`pack_signs`);
- wider fields (1..16 bits, e.g. 11-bit norms): :func:`pack_fields` / :func:`unpack_fields`;
  a float16 norm rounded to m mantissa bits is the field of its top 5 + m bits below the sign
  (:func:`norm_fields` / :func:`fields_norms`);
- :class:`CodeTable` turns packed codes straight into table values (e.g. codebook centroids)
  with a few wide integer operations and one table lookup per group of codes.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "CodeTable",
    "fields_norms",
    "norm_fields",
    "norm_table",
    "pack_bits",
    "pack_codes",
    "pack_fields",
    "pack_signs",
    "packed_size",
    "unpack_bits",
    "unpack_fields",
    "unpack_signs",
    "write_fields",
]

MAX_FIELD_BITS = 16


def packed_size(n: int, bits: int) -> int:
    """Bytes taken by ``n`` fields of ``bits`` bits: ceil(n·bits/8)."""
    _check_width(bits, MAX_FIELD_BITS, "bits")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (n * bits + 7) // 8


def _check_width(bits: int, largest: int, name: str) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= largest:
        raise ValueError(f"{name} must be an integer in 1..{largest}, got {bits!r}")


def _check_bits(bits: int) -> None:
    _check_width(bits, 8, "bits")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bits` for integer codes of any dtype, unchecked (the caller guarantees
    ``0 <= code < 2**bits``, e.g. codes from a bucketize over ``2**bits - 1`` boundaries)."""
    n = codes.shape[-1]
    groups = (n + 7) // 8
    padded = codes.to(torch.int64)
    if 8 * groups != n:
        padded = torch.nn.functional.pad(padded, (0, 8 * groups - n))
    shifts, byte_shifts = _pack_shifts(bits, str(codes.device))
    words = (padded.reshape(*codes.shape[:-1], groups, 8) << shifts).sum(-1)  # 8 codes a word
    stream = ((words[..., None] >> byte_shifts) & 255).to(torch.uint8)  # [..., groups, bits]
    return stream.reshape(*codes.shape[:-1], -1)[..., : packed_size(n, bits)]


@functools.lru_cache(maxsize=64)
def _pack_shifts(bits: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifts placing code k of a word at bit k·bits, and byte m of a word at bit 8m."""
    device = torch.device(device)
    return (
        torch.arange(0, 8 * bits, bits, device=device, dtype=torch.int64),
        torch.arange(0, 8 * bits, 8, device=device, dtype=torch.int64),
    )


def pack_bits(codes: torch.Tensor, bits: int, *, validate: bool = True) -> torch.Tensor:
    """Pack ``uint8`` codes ``[..., n]`` (each < 2**bits) into ``uint8 [..., ceil(n·bits/8)]``.

    ``validate=False`` skips the range check (it reads the codes back to the host): for codes
    that come from a bucketize over ``2**bits - 1`` boundaries, which are in range by
    construction.
    """
    _check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 torch.Tensor, got {getattr(codes, 'dtype', codes)}")
    if validate and codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"codes must be < 2**bits = {2**bits}, got a code {int(codes.max())}")
    return pack_codes(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``uint8 [..., nbytes]`` back to ``uint8 [..., n]`` codes."""
    _check_bits(bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError("packed must be a uint8 torch.Tensor")
    nbytes = packed_size(n, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(
            f"{n} codes of {bits} bits take {nbytes} bytes, "
            f"but packed has last dimension {packed.shape[-1]}"
        )
    groups = (n + 7) // 8
    padded = torch.nn.functional.pad(packed.to(torch.int64), (0, groups * bits - nbytes))
    shifts = torch.arange(0, 8 * bits, 8, device=packed.device, dtype=torch.int64)
    words = (padded.reshape(*packed.shape[:-1], groups, bits) << shifts).sum(-1)
    code_shifts = torch.arange(0, 8 * bits, bits, device=packed.device, dtype=torch.int64)
    codes = (words[..., None] >> code_shifts) & (2**bits - 1)
    return codes.reshape(*packed.shape[:-1], 8 * groups)[..., :n].to(torch.uint8)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor ``[..., m]`` (True for +1) into ``uint8 [..., ceil(m/8)]``."""
    if not isinstance(positive, torch.Tensor) or positive.dtype != torch.bool:
        raise TypeError("positive must be a bool torch.Tensor (True for +1, False for -1)")
    return pack_bits(positive.to(torch.uint8), 1, validate=False)


def unpack_signs(packed: torch.Tensor, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Signs ``±1`` of shape ``[..., m]`` in ``dtype`` from :func:`pack_signs` output."""
    return unpack_bits(packed, 1, m).to(dtype) * 2 - 1


# ---- wider fields ----------------------------------------------------------------------------
def pack_fields(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Pack integer fields ``[..., n]`` (each < 2**width, width 1..16) into ``uint8`` bytes.

    The caller guarantees the range (no check: it would read the values back to the host).
    """
    _check_width(width, MAX_FIELD_BITS, "width")
    n = fields.shape[-1]
    nbytes = packed_size(n, width)
    shifts = torch.arange(width, device=fields.device, dtype=torch.int32)
    stream = (fields.to(torch.int32)[..., None] >> shifts) & 1  # [..., n, width] stream bits
    stream = torch.nn.functional.pad(
        stream.reshape(*fields.shape[:-1], n * width), (0, 8 * nbytes - n * width)
    )
    weights = 1 << torch.arange(8, device=fields.device, dtype=torch.int32)
    byte_bits = stream.reshape(*fields.shape[:-1], nbytes, 8)
    return (byte_bits * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


@functools.lru_cache(maxsize=64)
def _group_index(width: int, device: str) -> tuple[torch.Tensor, ...]:
    """Eight ``width``-bit fields fill ``width`` bytes: for field k of a group, the (at most
    three) bytes it touches within the group, their weights and the field's bit shift."""
    offsets = torch.arange(8) * width
    span = (7 + width + 7) // 8
    index = (offsets >> 3)[:, None] + torch.arange(span)
    inside = index < width
    weights = (1 << (8 * torch.arange(span))) * inside  # bytes past the group count zero
    device = torch.device(device)
    return (
        index.clamp_max(width - 1).reshape(-1).to(device),
        weights.to(torch.int32).to(device),
        (offsets & 7).to(torch.int32).to(device),
    )


def unpack_fields(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_fields`: ``uint8 [..., nbytes]`` -> int32 fields ``[..., n]``.

    Fields are read by whole groups of eight (``width`` bytes): one gather of the bytes each
    field touches and a few wide integer operations, whatever ``n``.
    """
    _check_width(width, MAX_FIELD_BITS, "width")
    if packed.shape[-1] < packed_size(n, width):
        raise ValueError(
            f"{n} fields of {width} bits take {packed_size(n, width)} bytes, "
            f"but packed has last dimension {packed.shape[-1]}"
        )
    groups = (n + 7) // 8
    region = packed[..., : groups * width]
    if region.shape[-1] < groups * width:  # the last group is cut short
        region = torch.nn.functional.pad(region, (0, groups * width - region.shape[-1]))
    index, weights, shifts = _group_index(width, str(packed.device))
    span = weights.shape[-1]
    lead = packed.shape[:-1]
    gathered = region.reshape(*lead, groups, width).index_select(-1, index)
    words = (gathered.reshape(*lead, groups, 8, span).to(torch.int32) * weights).sum(-1)
    fields = (words >> shifts) & ((1 << width) - 1)
    return fields.reshape(*lead, 8 * groups)[..., :n]


def write_fields(packed: torch.Tensor, start: int, fields: torch.Tensor, width: int) -> None:
    """Write int ``fields [..., n]`` (each < 2**width) in place as fields ``start .. start + n - 1``
    of the packed streams ``packed [..., nbytes]``, leaving every other bit as it was.

    Only the bytes the new fields touch are read and written (a handful of wide integer
    operations); a few fields are placed with one 64-bit word, more by expanding their bits."""
    n = fields.shape[-1]
    bit0, bit1 = start * width, (start + n) * width
    b0, b1 = bit0 // 8, -(-bit1 // 8)
    offset, nbytes = bit0 - 8 * b0, b1 - b0
    device = str(packed.device)
    if offset + n * width <= 63:
        shifts, byte_shifts = _place_shifts(n, width, offset, nbytes, device)
        word = (fields.to(torch.int64) << shifts).sum(-1, keepdim=True)
        new = ((word >> byte_shifts) & 255).to(torch.uint8)
    else:
        bits = (fields.to(torch.int32)[..., None] >> _bit_range(width, device)) & 1
        bits = bits.reshape(*fields.shape[:-1], n * width)
        bits = torch.nn.functional.pad(bits, (offset, 8 * nbytes - offset - n * width))
        byte_weights = _bit_range(8, device).new_ones(8) << _bit_range(8, device)
        new = (bits.reshape(*bits.shape[:-1], nbytes, 8) * byte_weights).sum(-1)
        new = new.to(torch.uint8)
    region = packed[..., b0:b1]
    region.copy_((region & _keep_mask(offset, n * width, nbytes, device)) | new)


@functools.lru_cache(maxsize=256)
def _place_shifts(n: int, width: int, offset: int, nbytes: int, device: str):
    device = torch.device(device)
    return (
        offset + width * torch.arange(n, device=device, dtype=torch.int64),
        8 * torch.arange(nbytes, device=device, dtype=torch.int64),
    )


@functools.lru_cache(maxsize=64)
def _bit_range(n: int, device: str) -> torch.Tensor:
    return torch.arange(n, device=torch.device(device), dtype=torch.int32)


@functools.lru_cache(maxsize=256)
def _keep_mask(offset: int, nbits: int, nbytes: int, device: str) -> torch.Tensor:
    """Bytes with the bits ``offset .. offset + nbits - 1`` cleared, the others set."""
    keep = [255] * nbytes
    for bit in range(offset, offset + nbits):
        keep[bit // 8] &= ~(1 << (bit % 8)) & 255
    return torch.tensor(keep, dtype=torch.uint8, device=torch.device(device))


def _norm_format(width: int) -> tuple[int, int]:
    """(shift, mask) from a float16 bit pattern to a ``width``-bit norm field."""
    _check_width(width, MAX_FIELD_BITS, "width")
    if width < 6:
        raise ValueError(f"a norm field needs 5 exponent bits and >= 1 mantissa bit, got {width}")
    if width == 16:  # the whole float16, sign included
        return 0, 0xFFFF
    return 15 - width, 0x7FFF  # sign-free e5m(width-5): the sign bit must be 0


def norm_fields(norms: torch.Tensor, width: int) -> torch.Tensor:
    """float16 norms (rounded to ``width - 5`` mantissa bits, non-negative when ``width`` < 16)
    as int32 fields of ``width`` bits: their bit pattern without the sign and the dropped bits."""
    if norms.dtype != torch.float16:
        raise TypeError(f"norms must be float16, got {norms.dtype}")
    shift, mask = _norm_format(width)
    return ((norms.view(torch.int16).to(torch.int32) & mask) >> shift).to(torch.int32)


def fields_norms(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`norm_fields`: int fields -> float16 norms."""
    shift, _ = _norm_format(width)
    return (fields.to(torch.int32) << shift).to(torch.int16).view(torch.float16)


@functools.lru_cache(maxsize=32)
def norm_table(width: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Every ``width``-bit norm field's value in ``dtype``: ``norm_table(...)[fields]`` is
    ``fields_norms(fields).to(dtype)`` in one lookup."""
    fields = torch.arange(2**width, dtype=torch.int32)
    return fields_norms(fields, width).to(dtype).to(torch.device(device))


# ---- packed codes straight to table values -------------------------------------------------
@functools.lru_cache(maxsize=64)
def _word_constants(bits: int, field_bits: int, dtype: torch.dtype, device: str):
    """Byte weights building a word from ``bits`` bytes, and the shifts of its fields."""
    device = torch.device(device)
    weights = (1 << (8 * torch.arange(bits, dtype=torch.int64))).to(dtype).to(device)
    shifts = torch.arange(0, 8 * bits, field_bits, dtype=dtype, device=device)
    return weights, shifts


class CodeTable:
    """Read packed ``bits``-bit codes as values of a table (e.g. a codebook's centroids).

    Codes are read in groups of ``k`` (``k * bits <= 12`` and ``k`` divides 8), so one lookup
    in a ``[2**(k*bits), k]`` table returns ``k`` values at once. For 1, 2, 4 and 8 bits a group
    is one byte; for 3, 5, 6 and 7 bits the groups are cut from 64-bit words of eight codes.
    """

    def __init__(self, values: torch.Tensor, bits: int) -> None:
        _check_bits(bits)
        if values.dim() != 1 or values.shape[0] != 2**bits:
            raise ValueError(f"a table for {bits}-bit codes needs {2**bits} values")
        self.bits = bits
        self.k = max(k for k in (1, 2, 4, 8) if k * bits <= 12)
        self.field_bits = self.k * bits
        index = torch.arange(2**self.field_bits)
        shifts = torch.arange(self.k) * bits
        self.table = values[(index[:, None] >> shifts) & (2**bits - 1)]  # [2**(k b), k]
        self._moved: dict = {}

    def _on(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (str(device), dtype)
        if key not in self._moved:
            self._moved[key] = self.table.to(device=device, dtype=dtype).contiguous()
        return self._moved[key]

    def lookup(self, packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32):
        """``uint8 [..., ceil(n·bits/8)]`` packed codes -> table values ``[..., n]``."""
        bits = self.bits
        if n % 8 or packed.shape[-1] != n * bits // 8:
            raise ValueError(f"CodeTable reads whole groups of 8 codes, got n = {n}")
        lead = packed.shape[:-1]
        if self.field_bits == 8:  # one group per byte
            fields = packed.reshape(-1).to(torch.int32)
        else:  # words of eight codes (bits bytes): int32 up to 4 bytes, else int64
            word_dtype = torch.int32 if bits <= 3 else torch.int64
            byte_weights, field_shifts = _word_constants(
                bits, self.field_bits, word_dtype, str(packed.device)
            )
            words = (packed.reshape(-1, bits).to(word_dtype) * byte_weights).sum(
                -1, keepdim=True, dtype=word_dtype
            )
            fields = ((words >> field_shifts) & (2**self.field_bits - 1)).reshape(-1)
        table = self._on(packed.device, dtype)
        return table.index_select(0, fields).reshape(*lead, n)
