"""Triton building blocks shared by the kernels: read b-bit codes and sign bits from packed rows,
and the dot products of rows of queries with a tile of keys: from codes and QJL signs (the
estimator's two terms) and from exact vectors.

Storage layout (rqlib.core.packing): an LSB-first bit stream per vector; code j occupies stream bits
j*b .. j*b+b-1, stream bit t is bit t % 8 of byte t // 8. A code of b <= 8 bits therefore lies
in byte t // 8 and, when (t % 8) + b > 8, also in the next byte: the unpack below reads the
first byte always and the second only where the code straddles, so widths that divide 8
(1, 2, 4, 8) read each byte once. Where the width and the dimension are compile-time (the
attention kernel), :func:`load_code_groups` reads eight codes a load instead of one.

A trellis code (:mod:`rqlib.core.trellis`) is stored the same way, one ``b``-bit symbol a
coordinate, but a coordinate's value is read at the shift register that ends at its symbol:
``state_c = sum_j code_{c - j} 2^(j b) mod 2^L``, the codes before the first read as 0 or, in a
tail-biting trellis, from the end of the row (:func:`trellis_states`): ``ceil(L / b)`` code
reads a coordinate instead of one, the levels read from a table of ``2^L``.

Products: IEEE fp32 on the CUDA cores, or on fp16 tensor cores to float32 accuracy with
:func:`split_dot` (the attention kernel's products with codebook values).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rqlib.kernels.numerics import PAIR_MAX_BITS


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


#: the widest codes read two at a time (:func:`load_centroid_pairs`)
PAIR_BITS = tl.constexpr(PAIR_MAX_BITS)
#: the unsigned integer of ``bits`` bytes: eight codes of a width that divides 8
UNIT_TYPES = tl.constexpr((None, tl.uint8, tl.uint16, None, tl.uint32, None, None, None, tl.uint64))


@triton.jit
def group_loads(bits, dim, chunk):
    """Whether :func:`load_code_groups` serves ``dim`` codes of ``bits`` bits a row
    (compile-time), ``chunk`` codes at a time: rows of whole groups of eight codes, and eight
    codes held in at most 32 bits or in one 64-bit word. Widths of 5 to 7 bits would join a
    64-bit word from bytes, which the compile counts as more instructions than
    :func:`load_codes`; rows that end in a part group (a rotor's padded dimension) made the
    kernel spill. 3-bit rows are read as aligned 32-bit words, so they must be a whole number
    of words (``dim`` a multiple of 32)."""
    # one expression: a local variable would make the result a run-time value, not a constant
    return (
        (bits > 0)
        & ((bits <= 4) | (bits == 8))
        & (dim % 8 == 0)
        & ((bits != 3) | (dim % 32 == 0))
        & (chunk % 8 == 0)
    )


@triton.jit
def load_code_words(row_ptrs, col0, key_mask, bits: tl.constexpr, row_bytes: tl.constexpr,
                    CHUNK: tl.constexpr):  # fmt: skip
    """The words of eight codes that hold codes ``col0 .. col0 + CHUNK - 1`` of the packed rows
    ``row_ptrs`` ([ROWS, 1]), ``[ROWS, CHUNK // 8]``, unsigned (32 bits for ``bits <= 4``, else
    64): eight codes fill ``bits`` bytes, one aligned load of them when ``bits`` divides 8;
    3-bit groups (24 bits at stream bit ``24 g``) from the one or two aligned 32-bit words
    they lie in. Code ``i`` of a group lies at bits ``i * bits ..`` of its word. For the
    layouts :func:`group_loads` accepts (``col0`` a multiple of 8; rows of whole groups keep
    every group aligned to its size); words past the row are 0."""
    GROUPS: tl.constexpr = CHUNK // 8
    WORD: tl.constexpr = tl.uint32 if bits <= 4 else tl.uint64
    group = col0 // 8 + tl.arange(0, GROUPS)
    if 8 % bits == 0:
        words = tl.load(
            row_ptrs.to(tl.pointer_type(UNIT_TYPES[bits])) + group[None, :],
            mask=key_mask[:, None] & (group < row_bytes // bits)[None, :],
            other=0,
        ).to(WORD)
    else:  # 3 bits: group g is stream bits 24 g .., in one or two aligned 32-bit words
        bit = group * 24
        word = bit >> 5
        shift = (bit & 31).to(tl.uint32)
        word_ptrs = row_ptrs.to(tl.pointer_type(tl.uint32)) + word[None, :]
        in_row = key_mask[:, None] & (group < row_bytes // 3)[None, :]
        low = tl.load(word_ptrs, mask=in_row, other=0)
        straddles = in_row & (shift > 8)[None, :]
        high = tl.load(word_ptrs + 1, mask=straddles, other=0)
        words = ((low >> shift[None, :]) | (high << ((32 - shift) & 31)[None, :])) & 0xFFFFFF
    return words


@triton.jit
def load_code_groups(row_ptrs, col0, key_mask, bits: tl.constexpr, row_bytes: tl.constexpr,
                     CHUNK: tl.constexpr):  # fmt: skip
    """Codes ``col0 .. col0 + CHUNK - 1`` of the packed rows ``row_ptrs`` ([ROWS, 1]) read
    eight at a time (:func:`load_code_words`): code ``i`` of a group is
    ``(word >> i * bits) & (2^bits - 1)``, where :func:`load_codes` loads a byte per code and
    a second where one straddles. Returns int32 [ROWS, CHUNK]; codes past the row are 0."""
    words = load_code_words(row_ptrs, col0, key_mask, bits, row_bytes, CHUNK)
    shifts = (tl.arange(0, 8) * bits).to(words.dtype)
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return tl.reshape(codes, (key_mask.shape[0], CHUNK)).to(tl.int32)


@triton.jit
def pair_halves(entries):
    """``(low, high)``: the two centroids of entries of a table of centroid pairs
    (:func:`rqlib.kernels.numerics.kernel_table`), fp16 from int32 entries, float32 from int64
    ones."""
    if entries.dtype == tl.int64:
        low = entries.to(tl.int32).to(tl.float32, bitcast=True)
        high = (entries >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        low = entries.to(tl.int16).to(tl.float16, bitcast=True)
        high = (entries >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return low, high


@triton.jit
def load_centroids(table_ptr, codes, mask):
    """The centroids ``c[codes]`` from a table of centroid pairs: entry ``c`` holds centroid
    ``c`` in its low half, the half at the lower address (GPUs and the host are
    little-endian), read alone as a centroid: a load as narrow as from a codebook. Masked-out
    entries are 0."""
    if table_ptr.dtype.element_ty == tl.int64:
        halves = table_ptr.to(tl.pointer_type(tl.float32))
    else:
        halves = table_ptr.to(tl.pointer_type(tl.float16))
    return tl.load(halves + 2 * codes, mask=mask, other=0.0)


@triton.jit
def load_centroid_pairs(row_ptrs, col0, key_mask, bits: tl.constexpr, row_bytes: tl.constexpr,
                        table_ptr, CHUNK: tl.constexpr):  # fmt: skip
    """The centroids of codes ``col0 .. col0 + CHUNK - 1`` of the packed rows ``row_ptrs``
    ([ROWS, 1]), two a load: the ``2 * bits`` bits of codes ``2i`` and ``2i + 1`` are
    ``c_2i + 2^bits c_2i+1``, the index of their pair in the table ``table_ptr``
    (:func:`rqlib.kernels.numerics.kernel_table`, ``4^bits`` entries). Half the loads, address
    computations and unpacking of :func:`load_code_groups` followed by a load per code. For
    ``bits <= PAIR_BITS`` and the layouts :func:`group_loads` accepts. Returns [ROWS, CHUNK]
    in the table's centroid dtype; centroids past the row are 0."""
    HALF: tl.constexpr = CHUNK // 2
    words = load_code_words(row_ptrs, col0, key_mask, bits, row_bytes, CHUNK)
    shifts = (tl.arange(0, 4) * 2 * bits).to(words.dtype)
    index = (words[:, :, None] >> shifts[None, None, :]) & ((1 << 2 * bits) - 1)
    index = tl.reshape(index, (key_mask.shape[0], HALF)).to(tl.int32)
    pair_cols = col0 // 2 + tl.arange(0, HALF)
    in_row = key_mask[:, None] & (pair_cols < row_bytes * 4 // bits)[None, :]
    low, high = pair_halves(tl.load(table_ptr + index, mask=in_row, other=0))
    return tl.reshape(tl.join(low, high), (key_mask.shape[0], CHUNK))


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
def fp16_parts(x):
    """``(hi, lo)``, fp16 tensors with ``x = hi + lo + r``, ``|r| <= 2^-22 |x| + 2^-25``, for a
    float32 ``x`` within fp16's range: ``hi`` is ``x`` rounded to fp16, ``lo`` the remainder
    rounded (:data:`rqlib.kernels.numerics.PART_REMAINDER`)."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


@triton.jit
def split_dot(x, y, acc):
    """``acc + x @ y`` for a float32 ``x`` within fp16's range and an fp16 ``y``, on fp16
    tensor cores, to float32 accuracy: ``x`` split into its :func:`fp16_parts`, two products
    ``hi y + lo y``. A tensor core multiplies fp16 numbers exactly (11 by 11 significant bits
    fit in float32's 24) and accumulates in float32; only the remainder of the split is lost,
    where one fp16 product would round every ``x`` to 2^-11 of itself."""
    hi, lo = fp16_parts(x)
    acc = tl.dot(hi, y, acc)
    return tl.dot(lo, y, acc)


@triton.jit
def trellis_states(
    rows_ptr, cols, mask, dim, bits, code_bytes, trellis_state_bits: tl.constexpr,
    trellis_tail_biting: tl.constexpr,
):  # fmt: skip
    """The shift registers of a trellis code at coordinates ``cols`` of the packed rows
    ``rows_ptr`` ([ROWS, 1]) of ``dim`` symbols: ``state_c = sum_j code_{c - j} 2^(j bits)``
    over the ``ceil(L / bits)`` symbols that end at ``c``, kept to ``L`` bits. Symbols before the
    first are 0, or with ``trellis_tail_biting`` those at the end of the row (the register read
    as a circle). Int32 [ROWS, CHUNK]; 0 outside ``mask``."""
    states = tl.zeros(mask.shape, dtype=tl.int32)
    for lag in range(0, (trellis_state_bits + bits - 1) // bits):
        source = cols - lag
        if trellis_tail_biting:
            source = tl.where(source < 0, source + dim, source)
        read = mask & (source >= 0)[None, :]
        states = states | (load_codes(rows_ptr, source, read, bits, code_bytes) << (lag * bits))
    return states & ((1 << trellis_state_bits) - 1)


@triton.jit
def code_centroids(
    rows_ptr, col0, key_mask, dim, bits, code_bytes, table_ptr, CHUNK: tl.constexpr,
    GROUPS: tl.constexpr, PAIRS: tl.constexpr, trellis_state_bits: tl.constexpr = 0,
    trellis_tail_biting: tl.constexpr = False,
):  # fmt: skip
    """The centroids of codes ``col0 .. col0 + CHUNK - 1`` of the packed rows ``rows_ptr``
    ([ROWS, 1]) of ``dim`` codes, [ROWS, CHUNK] (0 past the row and for masked keys). With
    ``PAIRS`` ``table_ptr`` is a table of centroid pairs
    (:func:`rqlib.kernels.numerics.kernel_table`), read two centroids a load where ``GROUPS``
    (the codes read eight at a time: compile-time ``bits`` and ``dim`` that
    :func:`group_loads` accepts) and ``bits <= PAIR_BITS``; without, a codebook. A trellis code
    (``trellis_state_bits`` ``L`` > 0) reads the table's first ``2^L`` entries at the shift
    registers (:func:`trellis_states`)."""
    cols = col0 + tl.arange(0, CHUNK)
    mask = key_mask[:, None] & (cols < dim)[None, :]
    if trellis_state_bits > 0:
        states = trellis_states(
            rows_ptr, cols, mask, dim, bits, code_bytes, trellis_state_bits, trellis_tail_biting
        )
        if PAIRS:
            centroids = load_centroids(table_ptr, states, mask)
        else:
            centroids = tl.load(table_ptr + states, mask=mask, other=0.0)
    elif PAIRS:
        if GROUPS and bits <= PAIR_BITS:
            centroids = load_centroid_pairs(
                rows_ptr, col0, key_mask, bits, code_bytes, table_ptr, CHUNK
            )
        else:
            codes = unpacked_codes(rows_ptr, col0, key_mask, mask, bits, code_bytes, CHUNK, GROUPS)
            centroids = load_centroids(table_ptr, codes, mask)
    else:
        codes = unpacked_codes(rows_ptr, col0, key_mask, mask, bits, code_bytes, CHUNK, GROUPS)
        centroids = tl.load(table_ptr + codes, mask=mask, other=0.0)
    return centroids


@triton.jit
def unpacked_codes(
    rows_ptr, col0, key_mask, mask, bits, code_bytes, CHUNK: tl.constexpr, GROUPS: tl.constexpr
):  # fmt: skip
    """Codes ``col0 .. col0 + CHUNK - 1`` of the packed rows ``rows_ptr``, int32 [ROWS, CHUNK]:
    eight a load with ``GROUPS`` (:func:`load_code_groups`), else one (:func:`load_codes`, the
    entries outside ``mask`` 0)."""
    if GROUPS:
        codes = load_code_groups(rows_ptr, col0, key_mask, bits, code_bytes, CHUNK)
    else:
        codes = load_codes(rows_ptr, col0 + tl.arange(0, CHUNK), mask, bits, code_bytes)
    return codes


@triton.jit
def code_scores(
    q_ptr, q_rows, row_mask, dim, codes_ptr, slots, stride_s, key_mask, bits, code_bytes,
    centroids_ptr, BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    GROUPS: tl.constexpr = False, TENSOR_CORES: tl.constexpr = False, PAIRS: tl.constexpr = False,
    trellis_state_bits: tl.constexpr = 0, trellis_tail_biting: tl.constexpr = False,
):  # fmt: skip
    """``<q_row, c[codes_key]>`` for rows x keys, CHUNK coordinates at a time (codes read
    eight at a time with ``GROUPS``: compile-time ``bits`` and ``dim`` that
    :func:`group_loads` accepts). ``centroids_ptr`` is a codebook, float32 or fp16, or with
    ``PAIRS`` a table of centroid pairs of either (:func:`code_centroids`). IEEE fp32
    on the CUDA cores, or with ``TENSOR_CORES`` :func:`split_dot` on fp16 tensor cores, for an
    fp16 codebook and query rows within fp16's range
    (:func:`rqlib.kernels.numerics.scaled_rows`): the same sums to float32 accuracy. A trellis
    code (``trellis_state_bits`` > 0) reads its levels at the shift registers."""
    cols = tl.arange(0, CHUNK)
    rows_ptr = codes_ptr + slots.to(tl.int64)[:, None] * stride_s
    acc = tl.zeros((BLOCK_ROWS, BLOCK_S), dtype=tl.float32)
    for c0 in range(0, dim, CHUNK):
        c = c0 + cols
        c_mask = c < dim
        q_tile = query_chunk(q_ptr, q_rows, row_mask, dim, c, c_mask)
        k_tile = code_centroids(
            rows_ptr, c0, key_mask, dim, bits, code_bytes, centroids_ptr, CHUNK, GROUPS, PAIRS,
            trellis_state_bits, trellis_tail_biting,
        )  # fmt: skip
        if TENSOR_CORES:
            acc = split_dot(q_tile, tl.trans(k_tile), acc)
        else:
            k_tile = k_tile.to(tl.float32)
            acc = tl.dot(q_tile, tl.trans(k_tile), acc, input_precision="ieee")
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
