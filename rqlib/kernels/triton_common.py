"""Triton building blocks shared by the kernels: read b-bit codes and sign bits from packed rows,
and the dot products of rows of queries with a tile of keys: from codes and QJL signs (the
estimator's two terms) and from exact vectors.

Storage layout (rqlib.core.packing): an LSB-first bit stream per vector; code j occupies stream bits
j*b .. j*b+b-1, stream bit t is bit t % 8 of byte t // 8. A code of b <= 8 bits therefore lies
in byte t // 8 and, when (t % 8) + b > 8, also in the next byte: the unpack below reads the
first byte always and the second only where the code straddles, so widths that divide 8
(1, 2, 4, 8) read each byte once. Where the width and the dimension are compile-time (the
attention kernel), :func:`load_code_groups` reads eight codes a load instead of one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rqlib.kernels.interpreter import TF32_DROPPED_BITS

#: clears the float32 mantissa bits that tf32 drops (as an int32 mask of the bit pattern)
TF32_MASK = tl.constexpr(-(1 << TF32_DROPPED_BITS))


@triton.jit
def load_codes(row_ptrs, cols, col_mask, bits, row_bytes):
    """Unpack codes ``cols`` (a [CHUNK] vector) of the packed rows ``row_ptrs`` ([ROWS, 1]).

    Returns int32 codes [ROWS, CHUNK]; masked-out entries are 0.
    """
    bit = cols * bits
    byte = bit >> 3
    shift = bit & 7
    lo = tl.load(row_ptrs + byte[None, :], mask=col_mask, other=0).to(tl.int32)
    straddles = col_mask & ((shift + bits) > 8)[None, :] & ((byte + 1) < row_bytes)[None, :]
    hi = tl.load(row_ptrs + byte[None, :] + 1, mask=straddles, other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> shift[None, :]) & ((1 << bits) - 1)


#: the unsigned integer of ``bits`` bytes: eight codes of a width that divides 8
UNIT_TYPES = tl.constexpr((None, tl.uint8, tl.uint16, None, tl.uint32, None, None, None, tl.uint64))


@triton.jit
def group_loads(bits, dim, chunk):
    """Whether :func:`load_code_groups` serves ``dim`` codes of ``bits`` bits a row
    (compile-time), ``chunk`` codes at a time: rows of whole groups of eight codes, and eight
    codes held in at most 32 bits or in one 64-bit word. Widths of 5 to 7 bits would join a
    64-bit word from bytes, which the compile counts as more instructions than
    :func:`load_codes`; rows that end in a part group (a rotor's padded dimension) made the
    kernel spill."""
    return (bits > 0) & ((bits <= 4) | (bits == 8)) & (dim % 8 == 0) & (chunk % 8 == 0)


@triton.jit
def load_code_groups(row_ptrs, col0, key_mask, bits: tl.constexpr, row_bytes: tl.constexpr,
                     CHUNK: tl.constexpr):  # fmt: skip
    """Codes ``col0 .. col0 + CHUNK - 1`` of the packed rows ``row_ptrs`` ([ROWS, 1]) read
    eight at a time: eight codes fill ``bits`` bytes, one aligned load of them when ``bits``
    divides 8, else ``bits`` byte loads joined into a word. Code ``i`` of a group is then
    ``(word >> i * bits) & (2^bits - 1)``, where :func:`load_codes` loads a byte per code and
    a second where one straddles. For the layouts :func:`group_loads` accepts (``col0`` a
    multiple of 8; rows of whole groups keep every group aligned to its size). Returns int32
    [ROWS, CHUNK]; codes past the row are 0."""
    GROUPS: tl.constexpr = CHUNK // 8
    WORD: tl.constexpr = tl.uint32 if bits <= 4 else tl.uint64
    group = col0 // 8 + tl.arange(0, GROUPS)
    if 8 % bits == 0:
        words = tl.load(
            row_ptrs.to(tl.pointer_type(UNIT_TYPES[bits])) + group[None, :],
            mask=key_mask[:, None] & (group < row_bytes // bits)[None, :],
            other=0,
        ).to(WORD)
    else:
        lane = tl.arange(0, 4)  # 3 bytes a group
        byte = group[:, None] * bits + lane[None, :]
        in_row = (lane < bits)[None, :] & (byte < row_bytes)
        parts = tl.load(
            row_ptrs[:, :, None] + byte[None, :, :],
            mask=key_mask[:, None, None] & in_row[None, :, :],
            other=0,
        ).to(WORD)
        words = tl.sum(parts << (lane * 8).to(WORD)[None, None, :], axis=2)
    shifts = (tl.arange(0, 8) * bits).to(WORD)
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return tl.reshape(codes, (key_mask.shape[0], CHUNK)).to(tl.int32)


@triton.jit
def load_signs(row_ptrs, cols, col_mask):
    """Unpack sign bits ``cols`` of the packed rows ``row_ptrs``: +1.0 (bit 1), -1.0 (bit 0).

    Masked-out entries are 0.0, so they drop out of any dot product.
    """
    byte = tl.load(row_ptrs + (cols >> 3)[None, :], mask=col_mask, other=0).to(tl.int32)
    bit = (byte >> (cols & 7)[None, :]) & 1
    return tl.where(col_mask, bit.to(tl.float32) * 2.0 - 1.0, 0.0)


@triton.jit
def pack_store(
    out_row_ptrs,
    codes,
    first_code,
    bits,
    row_bytes,
    row_mask,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Pack int codes [ROWS, CHUNK] (codes first_code ..) into the rows ``out_row_ptrs`` [ROWS].

    Eight b-bit codes fill exactly b bytes, so each group of eight is summed into one 64-bit
    word (code i shifted by i*b) whose first b bytes are the packed bytes of that group.
    ``first_code`` must be a multiple of 8; bytes at or beyond ``row_bytes`` are not written.
    """
    GROUPS: tl.constexpr = CHUNK // 8
    groups = tl.reshape(codes.to(tl.int64), (ROWS, GROUPS, 8))
    lane = tl.arange(0, 8)
    word = tl.sum(groups << (lane * bits).to(tl.int64)[None, None, :], axis=2)  # [ROWS, GROUPS]
    byte_values = (word[:, :, None] >> (lane * 8).to(tl.int64)[None, None, :]) & 255
    group_byte0 = (first_code // 8 + tl.arange(0, GROUPS)) * bits  # first byte of each group
    byte_index = group_byte0[:, None] + lane[None, :]  # [GROUPS, 8 bytes]
    mask = (lane[None, :] < bits) & (byte_index < row_bytes)
    tl.store(
        out_row_ptrs[:, None, None] + byte_index[None, :, :],
        byte_values.to(tl.uint8),
        mask=row_mask[:, None, None] & mask[None, :, :],
    )


@triton.jit
def query_chunk(q_ptr, q_rows, row_mask, dim, cols, col_mask):
    """Rows x chunk of a query-side array ``[rows, dim]`` (zeros outside rows and columns)."""
    return tl.load(
        q_ptr + q_rows[:, None] * dim + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    )


@triton.jit
def tf32_parts(x):
    """``(hi, lo)``, float32 tensors of tf32 numbers (10 mantissa bits, the low 13 cleared) with
    ``|x - hi - lo| < 2^-20 |x|``: ``hi`` keeps the leading 11 significant bits of ``x``, ``lo``
    those of the rest (tf32 as :func:`rqlib.kernels.interpreter.round_to_tf32` defines it)."""
    hi = (x.to(tl.int32, bitcast=True) & TF32_MASK).to(tl.float32, bitcast=True)
    lo = ((x - hi).to(tl.int32, bitcast=True) & TF32_MASK).to(tl.float32, bitcast=True)
    return hi, lo


@triton.jit
def exact_dot(x, y, acc):
    """``acc + x @ y`` of float32 tensors on tf32 tensor cores, to float32 accuracy: both split
    into their :func:`tf32_parts`, three products ``hi hi + lo hi + hi lo``. A tensor core reads
    the parts without rounding them and multiplies them exactly (11 x 11 significant bits fit in
    float32's 24); only ``lo lo`` and the bits beyond the parts are lost, less than
    ``3 * 2^-20 |x||y|`` a product, where one tf32 product loses up to ``2^-10``."""
    x_hi, x_lo = tf32_parts(x)
    y_hi, y_lo = tf32_parts(y)
    acc = tl.dot(x_hi, y_hi, acc, input_precision="tf32")
    acc = tl.dot(x_lo, y_hi, acc, input_precision="tf32")
    return tl.dot(x_hi, y_lo, acc, input_precision="tf32")


@triton.jit
def code_scores(
    q_ptr, q_rows, row_mask, dim, codes_ptr, slots, stride_s, key_mask, bits, code_bytes,
    centroids_ptr, BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    GROUPS: tl.constexpr = False,
):  # fmt: skip
    """``<q_row, c[codes_key]>`` for rows x keys, CHUNK coordinates at a time (codes read
    eight at a time with ``GROUPS``: compile-time ``bits`` and ``dim`` that
    :func:`group_loads` accepts)."""
    cols = tl.arange(0, CHUNK)
    rows_ptr = codes_ptr + slots.to(tl.int64)[:, None] * stride_s
    acc = tl.zeros((BLOCK_ROWS, BLOCK_S), dtype=tl.float32)
    for c0 in range(0, dim, CHUNK):
        c = c0 + cols
        c_mask = c < dim
        q_tile = query_chunk(q_ptr, q_rows, row_mask, dim, c, c_mask)
        k_mask = key_mask[:, None] & c_mask[None, :]
        if GROUPS:
            codes = load_code_groups(rows_ptr, c0, key_mask, bits, code_bytes, CHUNK)
        else:
            codes = load_codes(rows_ptr, c, k_mask, bits, code_bytes)
        k_tile = tl.load(centroids_ptr + codes, mask=k_mask, other=0.0)
        acc += tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
    return acc


@triton.jit
def sign_scores(
    q_ptr, q_rows, row_mask, m_dim, signs_ptr, slots, stride_s, key_mask,
    BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """``<S R q_row, signs_key>`` for rows x keys (QJL), CHUNK sign bits at a time."""
    cols = tl.arange(0, CHUNK)
    rows_ptr = signs_ptr + slots.to(tl.int64)[:, None] * stride_s
    acc = tl.zeros((BLOCK_ROWS, BLOCK_S), dtype=tl.float32)
    for m0 in range(0, m_dim, CHUNK):
        m = m0 + cols
        m_mask = m < m_dim
        s_tile = query_chunk(q_ptr, q_rows, row_mask, m_dim, m, m_mask)
        signs = load_signs(rows_ptr, m, key_mask[:, None] & m_mask[None, :])
        acc += tl.dot(s_tile, tl.trans(signs), input_precision="ieee")
    return acc


@triton.jit
def exact_scores(
    q_ptr, q_rows, row_mask, dim, x_ptr, slots, stride_s, key_mask,
    BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """``<q_row, x_key>`` for rows x keys from exact vectors ``x`` (any float dtype)."""
    cols = tl.arange(0, CHUNK)
    rows_ptr = x_ptr + slots.to(tl.int64)[:, None] * stride_s
    acc = tl.zeros((BLOCK_ROWS, BLOCK_S), dtype=tl.float32)
    for c0 in range(0, dim, CHUNK):
        c = c0 + cols
        c_mask = c < dim
        q_tile = query_chunk(q_ptr, q_rows, row_mask, dim, c, c_mask)
        x_tile = tl.load(
            rows_ptr + c[None, :], mask=key_mask[:, None] & c_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.dot(q_tile, tl.trans(x_tile), input_precision="ieee")
    return acc
