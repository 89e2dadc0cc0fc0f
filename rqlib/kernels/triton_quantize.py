"""Triton kernel: fused bucketize + pack (+ QJL residual, sketch, sign pack, residual norm).

The torch side normalizes and rotates (y = R x / ||x||) with exactly the operations the torch
quantizer uses, because a rotation matmul evaluated in another summation order rounds
differently, and a coordinate that lands within one rounding error of a codebook boundary would
then get the neighbouring code: bit-identical codes need bit-identical y. From y on, everything
is in this kernel, one program per 16 vectors:

    codes  = #(boundaries < y)                      compared in fp32, exactly as torch does
    packed = LSB-first b-bit stream                 eight codes -> b bytes
    r      = y - c[codes],  ||r||                   (prod only)
    signs  = [S r >= 0]   packed 1 bit each         (prod only; S r as an IEEE fp32 tl.dot)

The sign of a projection within a rounding error of zero depends on the summation order; the
tests measure how often that differs from torch (only where |S r| is below 1e-5 ||r||).

Bytes per vector, d = 128, 3-bit prod: read y 512 (fp32) + the sketch once per program
(m*D*4 / 16 vectors = 4 KiB per vector at m = D = 128: the sketch is read from L2, not HBM,
after the first program); write 32 + 16 + 4 bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rqlib.kernels.triton_common import pack_store


@triton.jit
def _codes_and_residual(
    y_ptr, rows, row_mask, c, c_mask, rotated_dim, boundaries_ptr, n_bound, centroids_ptr
):
    """Codes (int32) and residual y - c[codes] of coordinates ``c`` of ``rows``.

    Without codes (bits = 0) the host passes no boundaries and a one-entry zero centroid table,
    so the codes are 0 and the residual is y itself.
    """
    mask = row_mask[:, None] & c_mask[None, :]
    y = tl.load(y_ptr + rows[:, None] * rotated_dim + c[None, :], mask=mask, other=0.0)
    codes = tl.zeros(y.shape, dtype=tl.int32)
    for k in range(0, n_bound):
        codes += (tl.load(boundaries_ptr + k) < y).to(tl.int32)
    codes = tl.where(mask, codes, 0)  # padding coordinates pack as zero bits
    c_hat = tl.load(centroids_ptr + codes, mask=mask, other=0.0)
    return codes, tl.where(mask, y - c_hat, 0.0)


@triton.jit
def quantize_kernel(
    y_ptr,  # fp32 [n, D] unit vectors in the rotated space, contiguous
    boundaries_ptr,  # fp32 [2**bits - 1]
    centroids_ptr,  # fp32 [2**bits]
    sketch_ptr,  # fp32 [m, D] contiguous
    codes_ptr,  # uint8 [n, code_bytes] out
    signs_ptr,  # uint8 [n, sign_bytes] out
    residual_ptr,  # fp32 [n] out: ||r|| (prod only)
    n,
    rotated_dim,
    bits,  # 0 for a 1-bit prod quantizer (signs only)
    code_bytes,
    qjl_dim,  # 0 without QJL
    sign_bytes,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Quantize BLOCK_N rotated unit vectors; see the module doc."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n
    cols = tl.arange(0, CHUNK)
    n_bound = (1 << bits) - 1
    has_codes = bits > 0

    # Codes, packed CHUNK coordinates at a time, and the squared residual norm.
    residual_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c0 in range(0, rotated_dim, CHUNK):
        c = c0 + cols
        c_mask = c < rotated_dim
        codes, residual = _codes_and_residual(
            y_ptr,
            rows,
            row_mask,
            c,
            c_mask,
            rotated_dim,
            boundaries_ptr,
            n_bound,
            centroids_ptr,
        )
        if has_codes:
            pack_store(
                codes_ptr + rows * code_bytes, codes, c0, bits, code_bytes, row_mask, BLOCK_N, CHUNK
            )
        residual_sq += tl.sum(residual * residual, axis=1)

    if qjl_dim > 0:
        tl.store(residual_ptr + rows, tl.sqrt(residual_sq), mask=row_mask)
        # Signs of S r, CHUNK sketch rows at a time; r is recomputed per chunk of S.
        for m0 in range(0, qjl_dim, CHUNK):
            m = m0 + cols
            m_mask = m < qjl_dim
            projection = tl.zeros((BLOCK_N, CHUNK), dtype=tl.float32)
            for c0 in range(0, rotated_dim, CHUNK):
                c = c0 + cols
                c_mask = c < rotated_dim
                _, residual = _codes_and_residual(
                    y_ptr,
                    rows,
                    row_mask,
                    c,
                    c_mask,
                    rotated_dim,
                    boundaries_ptr,
                    n_bound,
                    centroids_ptr,
                )
                s_tile = tl.load(
                    sketch_ptr + m[:, None] * rotated_dim + c[None, :],
                    mask=m_mask[:, None] & c_mask[None, :],
                    other=0.0,
                )
                projection += tl.dot(residual, tl.trans(s_tile), input_precision="ieee")
            sign_bits = tl.where(m_mask[None, :] & (projection >= 0.0), 1, 0)
            pack_store(
                signs_ptr + rows * sign_bytes,
                sign_bits,
                m0,
                1,
                sign_bytes,
                row_mask,
                BLOCK_N,
                CHUNK,
            )
