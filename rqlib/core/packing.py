"""Bit-packing of b-bit codes and sign bits into ``uint8`` along the last axis.

The layout is a little-endian bit stream: code j occupies stream bits j·b … j·b + b − 1
(its least significant bit first), and stream bit t is bit ``t % 8`` of byte ``t // 8``.
n codes of b bits take exactly ceil(n·b/8) bytes; for b = 3, 5, 6, 7 a code may straddle two
bytes. A kernel reads code j as ``((byte[o//8] | byte[o//8 + 1] << 8) >> (o % 8)) & (2^b − 1)``
with ``o = j·b``.

Sign bits are 1-bit codes: 1 stands for +1 and 0 for −1.
"""

from __future__ import annotations

import torch


def packed_size(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits: ceil(n·bits/8)."""
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes ``[..., n]`` (each < 2**bits) into ``uint8 [..., ceil(n·bits/8)]``."""
    _check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 torch.Tensor, got {getattr(codes, 'dtype', codes)}")
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"codes must be < 2**bits = {2**bits}, got a code {int(codes.max())}")
    n = codes.shape[-1]
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], n * bits)
    nbytes = packed_size(n, bits)
    stream = torch.nn.functional.pad(stream, (0, 8 * nbytes - n * bits))
    weights = (1 << torch.arange(8, device=codes.device)).to(torch.uint8)
    byte_bits = stream.reshape(*codes.shape[:-1], nbytes, 8)
    return (byte_bits * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


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
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], 8 * nbytes)
    code_bits = stream[..., : n * bits].reshape(*packed.shape[:-1], n, bits)
    weights = (1 << torch.arange(bits, device=packed.device)).to(torch.uint8)
    return (code_bits * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor ``[..., m]`` (True for +1) into ``uint8 [..., ceil(m/8)]``."""
    if not isinstance(positive, torch.Tensor) or positive.dtype != torch.bool:
        raise TypeError("positive must be a bool torch.Tensor (True for +1, False for -1)")
    return pack_bits(positive.to(torch.uint8), 1)


def unpack_signs(packed: torch.Tensor, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Signs ``±1`` of shape ``[..., m]`` in ``dtype`` from :func:`pack_signs` output."""
    return unpack_bits(packed, 1, m).to(dtype) * 2 - 1
