"""Triton kernels: attention over one layer of the compressed cache, fused (split + reduce).

``attention_kernel``: one program per (batch, KV head, block of query rows, split of the keys,
block of BLOCK_V value columns). A row is a (query position, query head of the GQA
group) pair, so a key tile is decoded once for the whole group and any group size is served (a
group of 40 heads is three row blocks). A pair (row ``i``, key ``j``) reads exactly one of
three streams:

- the **sink** when ``j < n_sink``: exact keys and values;
- the **recent band** when ``i - band < j <= i`` (and ``j`` is not a sink key): the band's codes,
  or exact vectors;
- the **main** stream otherwise: ``||k|| <R q', c[codes]> + ||r|| gamma/m <S R q', signs>`` plus
  ``<q, mu>`` (centering), with ``q' = q / a`` (channel scaling) rotated once on the host, or
  ``<q, k>`` for an exact layer; norms are read from their bit stream (``w``-bit fields).

The program walks each stream in its own loop over tiles of BLOCK_S keys (main, then band, then
sink), so a tile decodes only what it reads and a loop keeps one accumulator live. Per tile:
scale, logit softcap, the mask (causal, sliding window, a padding or dense mask read per key,
and the pairs that belong to another stream), an online softmax in base 2 (running max m,
running sum l; :data:`LOG2E`), and the values weighted in place: codes accumulate
``p ||v|| c[codes]`` in the value quantizer's rotated space, exact vectors in the model's
coordinates. Nothing is ever decoded to a value vector per key; the rotations back happen once
per query after the reduce.

Decode steps and prompts run the same program. A tile is ``BLOCK_ROWS`` = 16 rows by
``BLOCK_S`` keys, the smallest a tensor core multiplies: a decode step of a GQA group has only as
many rows as the group has heads (4 in Llama-3-8B's geometry), padded to 16 with masked rows, and
gets its parallelism from the splits of the keys instead (``limits.decode_splits``).

Precision: every product with codebook values (the scores of coded keys and the weighted coded
values) runs on fp16 tensor cores, to float32 accuracy on the kernel's codebook, the codebook
rounded to fp16 (:mod:`rqlib.kernels.numerics`): the other factor, the query rows (scaled into
fp16's range by a power of two on the host) or the weights ``p ||v||``, is split into two fp16
parts (:func:`~rqlib.kernels.triton_common.split_dot`). QJL signs and every product with exact
vectors are IEEE fp32 on the CUDA cores.

Formats are compile-time: the head dimension, which streams are exact or codes, code widths,
rotated dimensions and norm widths (:func:`rqlib.kernels.limits.attention_formats`), and so is
whether scores are softcapped (``SOFTCAP``). A specialization holds only the loads and
unpacking of the layer it serves, with its shifts and masks folded into constants, and reads
eight codes a load where the width allows
(:func:`~rqlib.kernels.triton_common.load_code_groups`). The QJL sketch dimension stays a
run-time argument: as a constant, its loop becomes straight-line code that needs one register
more than sm_90 has. So do causal order and whether a mask tensor is read: as constants they
save a few instructions per key but make the heaviest layouts spill.

A layer runs in one configuration, chosen from its format alone (``limits.attention_config``:
four warps with the scores on tensor cores, eight on the CUDA cores for the widest
accumulators; ``tests/test_kernels_aot.py`` compiles a covering set of formats for sm_80 and
sm_90 and reports their registers and spills). A run-time branch inside a loop keeps the
registers of both sides live, so the mask and the window are selected arithmetically.
Accumulators wider than 256 columns (a rotor's padded width at head_dim 256), or between 128
and 256 (at head_dim 128), are cut into blocks of BLOCK_V columns, one program each, which
recompute the same scores. A thread may take up to 255 registers
(``limits.ATTENTION_MAX_REGISTERS``), where ptxas would cap it at 128 to fit two blocks an SM,
and spill.

Each loop ends by writing its own partial result (m, l, acc) to its slot (0 main, 1 band,
2 sink) of its split. ``reduce_kernel`` merges every split and slot of a
row: ``M = max m``, ``L = sum
2^(m - M) l``, and per slot ``out_t = sum_s 2^(m_st - M) acc_st / L``: a slot is a part of the
softmax-weighted sum in its own coordinates. A row that sees no key (a padding position) gets
zeros.

Tokens live in ring buffers (:mod:`rqlib.kernels.store`): position ``p`` of a stream with
``C`` slots is slot ``p % C``, so an append-only stream and a window (the band, a sliding layer
that evicts old tokens) are read the same way. ``C`` is a multiple of BLOCK_S and tiles start at
multiples of BLOCK_S (:func:`aligned_start`), so a tile's slots are consecutive and inside the
ring, and its loads take no mask (:func:`every_key`).

Bytes read per key and KV head in a decode step, head_dim 128, 3-bit keys and values, 11-bit
norms: 2 * (48 + 1.375) = 98.75 bytes, against 512 for fp16 keys and values; the sink and band
tokens add a constant per step, and the partial results ``3 * (2 + width)`` floats per row
and split (``width``: the accumulator's columns over all value blocks).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rqlib.kernels.triton_common import (
    code_centroids,
    code_scores,
    exact_scores,
    group_loads,
    sign_scores,
    split_dot,
)

#: Logits are kept in base 2 inside the kernel: ``e^x = 2^(x log2 e)``, so the scale of the
#: scores is ``scale * LOG2E`` (folded into each stream's per-row factors) and the exponentials
#: are ``exp2``, the GPU's native one. The partial maxima ``m`` are in these units too.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def load_norms(row_ptr, slots, width):
    """Float32 norms of ``slots`` from a bit stream of ``width``-bit fields (slot ``s`` at stream
    bits ``s * width ...``): float16 patterns without sign and dropped mantissa bits, or whole
    float16 values when ``width`` is 16. A field is read as the three bytes from the one that
    holds its first bit, without a mask: a stream ends in two spare bytes
    (:data:`rqlib.kernels.store.NORM_TAIL`)."""
    bit = slots.to(tl.int64) * width
    byte = bit >> 3
    shift = (bit & 7).to(tl.int32)
    b0 = tl.load(row_ptr + byte).to(tl.int32)
    b1 = tl.load(row_ptr + byte + 1).to(tl.int32)
    b2 = tl.load(row_ptr + byte + 2).to(tl.int32)
    field = ((b0 | (b1 << 8) | (b2 << 16)) >> shift) & ((1 << width) - 1)
    pattern = field << tl.where(width < 16, 15 - width, 0)
    return pattern.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def code_values(
    codes_ptr, slots, stride_s, key_mask, bits: tl.constexpr, code_bytes: tl.constexpr,
    centroids_ptr, width: tl.constexpr, col0, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The centroids ``c[codes]`` of the keys' slots, columns ``col0 ..`` of the rotated space,
    ``[BLOCK_S, BLOCK_V]``, fp16, from the codebook ``centroids_ptr``
    (``triton_common.code_centroids``)."""
    rows_ptr = codes_ptr + slots.to(tl.int64)[:, None] * stride_s
    return code_centroids(
        rows_ptr, col0, key_mask, width, bits, code_bytes, centroids_ptr, BLOCK_V,
        group_loads(bits, width, BLOCK_V), False,
    )  # fmt: skip


@triton.jit
def exact_values(x_ptr, slots, stride_s, key_mask, width, col0, BLOCK_V: tl.constexpr):
    """Columns ``col0 ..`` of the exact value vectors of the keys' slots, ``[BLOCK_S, BLOCK_V]``
    float32."""
    cols = col0 + tl.arange(0, BLOCK_V)
    v_mask = key_mask[:, None] & (cols < width)[None, :]
    rows_ptr = x_ptr + slots.to(tl.int64)[:, None] * stride_s
    return tl.load(rows_ptr + cols[None, :], mask=v_mask, other=0.0).to(tl.float32)


@triton.jit
def wrap(slots, capacity):
    """``slots % capacity`` for ``0 <= slots < 2 * capacity``: one conditional subtraction
    instead of an integer division, which a GPU computes in a sequence of instructions per
    element."""
    return tl.where(slots >= capacity, slots - capacity, slots)


@triton.jit
def aligned_start(lo, hi, capacity, BLOCK_S: tl.constexpr):
    """``(tile_lo, slot_lo)``: the first key and ring slot of the loop over keys ``lo .. hi - 1``
    of a ring of ``capacity`` slots, a multiple of BLOCK_S. Tiles start at multiples of BLOCK_S,
    in positions and so in slots (``p % BLOCK_S == (p % capacity) % BLOCK_S``): no tile crosses
    the end of the ring, and a tile's slots are ``slot_lo + 0 .. BLOCK_S - 1`` with no per-key
    wrap. The keys before ``lo`` of the first tile are masked; an empty range stays empty
    (``tile_lo = hi``). One division before the loop, none per key."""
    tile_lo = tl.where(lo < hi, lo - lo % BLOCK_S, hi)
    return tile_lo, tile_lo % tl.maximum(capacity, 1)


@triton.jit
def ring_tile(tile, slot_lo, capacity, BLOCK_S: tl.constexpr):
    """``(slots, next_slot_lo)`` of the tile whose first key is ``tile`` and first slot
    ``slot_lo`` (from :func:`aligned_start`): the ring slots of its keys ``tile ..
    tile + BLOCK_S - 1``, and the first slot of the next tile."""
    slots = slot_lo + tl.arange(0, BLOCK_S)
    return slots, wrap(slot_lo + BLOCK_S, capacity)


@triton.jit
def tile_range(tile, lo, hi, BLOCK_S: tl.constexpr):
    """``(keys, in_range)``, ``[1, BLOCK_S]``: the keys of the tile that starts at key ``tile``
    and which of them the loop over keys ``lo .. hi - 1`` reads."""
    keys = (tile + tl.arange(0, BLOCK_S))[None, :]
    return keys, (keys >= lo) & (keys < hi)


@triton.jit
def every_key(BLOCK_S: tl.constexpr):
    """The load mask of a ring tile: all true. A tile from :func:`aligned_start` lies inside
    the ring, and every slot holds a stored token or the zeros it was allocated with
    (:mod:`rqlib.kernels.store`), finite either way; the keys of the tile outside the loop's
    range are read and then masked out of the softmax (``p = 0``), which costs fewer
    instructions than masking every load of a key."""
    return tl.full((BLOCK_S,), 1, tl.int1)


@triton.jit
def as_mask(condition):
    """``condition`` as a boolean tensor. Under ``TRITON_INTERPRET=1`` a condition that combines
    a tensor with a scalar comparison (``rows < n & (flag != 0)``) is not a boolean array, and a
    load or store refuses it as a mask."""
    return condition.to(tl.int8) != 0


@triton.jit
def visible_pairs(
    keys, in_range, rows, row_mask, positions, group, causal, window, has_mask, mask_ptr,
    stride_mt, stride_mk, mask_len, mask_offset,
):  # fmt: skip
    """Which (row, key) pairs of a tile may attend, as int8 ``[BLOCK_ROWS, BLOCK_S]``: valid
    rows and keys, causal and sliding-window order, and the padding or dense mask (``mask_ptr``
    already offset to the batch row)."""
    # Without branches: a run-time `if` here splits the loop body, and the registers live across
    # both sides spill. int8, not bool, is returned (no 1-bit shared memory).
    after = keys > positions[:, None]
    outside_window = (window > 0) & (keys <= positions[:, None] - window)
    hidden = (causal != 0) & (after | outside_window)
    visible = as_mask(row_mask[:, None] & in_range & ~hidden)
    column = keys - mask_offset
    inside = (column >= 0) & (column < mask_len)
    flags = tl.load(
        mask_ptr + (rows // group)[:, None].to(tl.int64) * stride_mt
        + column.to(tl.int64) * stride_mk,
        mask=as_mask(visible & inside & (has_mask != 0)),
        other=0,
    )  # fmt: skip
    return (visible & ((has_mask == 0) | (flags != 0))).to(tl.int8)


@triton.jit
def fresh_softmax(BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr):
    """``(m, l, acc)`` of an online softmax that has seen no key yet; ``l`` is kept per (row,
    key of a tile) and summed over the keys once, by :func:`store_partial`."""
    m_i = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_ROWS, BLOCK_S), dtype=tl.float32)
    return m_i, l_i, tl.zeros((BLOCK_ROWS, BLOCK_V), dtype=tl.float32)


@triton.jit
def softmax_step(scores, visible, softcap, m_i, l_i, acc, SOFTCAP: tl.constexpr):
    """Softcap (when ``SOFTCAP``) and mask a tile of logits in base-2 units (times
    ``log2(e)``, ``softcap`` too: see :data:`LOG2E`); one online-softmax step. Returns the
    weights ``p`` of the tile and the updated ``(m, l)`` and rescaled accumulator. ``l``
    gathers ``p`` element by element: a sum over the keys per tile would cost a reduction
    across the threads of a row at every tile."""
    if SOFTCAP:  # c tanh(x / c), the same in base-2 units: (c log2 e) tanh(x log2 e / (c log2 e))
        scores = softcap * (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap)) - 1.0)
    scores = tl.where(visible != 0, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    return p, m_new, l_i * alpha[:, None] + p, acc * alpha[:, None]


@triton.jit
def store_partial(
    part_m_ptr, part_l_ptr, part_acc_ptr, q_rows, n_parts, part, slot, row_mask, m_i, l_i, acc,
    col0, acc_width, BLOCK_V: tl.constexpr, fence=0,
):  # fmt: skip
    """Write one stream's (m, l, acc) of the rows ``q_rows`` to their ``part`` (of ``n_parts``
    splits) and ``slot``: (m, l) by the first column block only (every block
    computes the same), ``m`` in base-2 units, ``l`` summed over its keys; the accumulator's
    columns ``col0 ..`` of ``acc_width`` only where the row saw a key (``m > -inf``: the reduce
    reads no other, so a split without band or sink keys writes no accumulator for them).

    ``fence`` is 0, computed from a value of the loop before the store that the compiler cannot
    prove is 0: without it the compiler computes the index once for the three streams' stores
    and keeps it in registers across the later loops, which spilled."""
    # computed here, not before the loops: an index live across them would take registers
    index = ((q_rows + fence) * n_parts + part) * 3 + slot
    first_block = as_mask(row_mask & (col0 == 0))
    tl.store(part_m_ptr + index, m_i, mask=first_block)
    tl.store(part_l_ptr + index, tl.sum(l_i, axis=1), mask=first_block)
    vcols = col0 + tl.arange(0, BLOCK_V)
    acc_ptrs = part_acc_ptr + index[:, None].to(tl.int64) * acc_width + vcols[None, :]
    tl.store(acc_ptrs, acc, mask=as_mask(row_mask & (m_i > float("-inf")))[:, None])


@triton.jit
def attention_kernel(
    # query side, fp32, one row per (batch, KV head, position, head of the group); the rows
    # read against codes scaled by a power of two per row (q_main_scale, q_band_scale)
    q_raw_ptr, q_main_ptr, q_main_scale_ptr, q_sketch_ptr, q_band_ptr, q_band_scale_ptr,
    mean_ptr, band_mean_ptr,
    # main keys: codes, norm stream, QJL signs and residual-norm stream, or exact vectors; the
    # keys' codebooks are tables of centroid pairs (*_table_ptr: rqlib.kernels.numerics.
    # kernel_table) of fp16 centroids, or float32 for the scores on the CUDA cores
    k_codes_ptr, k_norms_ptr, k_signs_ptr, k_rnorms_ptr, k_exact_ptr, k_table_ptr,
    # main values: codes and norm stream, or exact vectors; the values' centroids
    # (*_centroids_ptr) are an fp16 codebook (rqlib.kernels.numerics.kernel_centroids)
    v_codes_ptr, v_norms_ptr, v_exact_ptr, v_centroids_ptr,
    # recent band: keys (codes and norm stream, or exact), values (codes, or exact vectors:
    # the band's own or, for a layer whose values are exact, the main ones)
    bk_codes_ptr, bk_norms_ptr, bk_exact_ptr, bk_table_ptr,
    bv_codes_ptr, bv_norms_ptr, bv_exact_ptr, bv_centroids_ptr,
    # exact sink keys [B, KV, n_sink_slots, d] and their values (the sink's or the main ones)
    sink_k_ptr, sink_v_ptr,
    # mask tensor (uint8 view of a bool tensor) and partial results
    mask_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    # shapes and positions
    kv_heads, group, n_rows, start, first, end, n_splits, partition, split_lo, value_blocks,
    n_sink, band, causal, window, has_mask, mask_len, mask_offset, stride_mb, stride_mt, stride_mk,
    scale, softcap,
    # main keys: ring capacity, QJL sketch dimension and scale, strides
    k_cap, k_sketch_dim, k_qjl_scale,
    stride_kcb, stride_kch, stride_kcs, stride_knb, stride_knh,
    stride_ksb, stride_ksh, stride_kss, stride_krb, stride_krh,
    stride_kxb, stride_kxh, stride_kxs,
    # main values
    stride_vcb, stride_vch, stride_vcs, stride_vnb, stride_vnh, stride_vxb, stride_vxh, stride_vxs,
    # the band's keys and values
    b_cap, bv_cap,
    stride_bkcb, stride_bkch, stride_bkcs, stride_bknb, stride_bknh,
    stride_bkxb, stride_bkxh, stride_bkxs,
    stride_bvcb, stride_bvch, stride_bvcs, stride_bvnb, stride_bvnh,
    stride_bvxb, stride_bvxh, stride_bvxs,
    # sink keys and values: strides and the values' ring capacity
    stride_skb, stride_skh, stride_sks, stride_svb, stride_svh, stride_svs, sv_cap,
    # compile-time: whether the scores are softcapped (their cap: softcap)
    SOFTCAP: tl.constexpr,
    # compile-time: the layer's storage formats (rqlib.kernels.limits.attention_formats)
    head_dim: tl.constexpr,
    k_exact: tl.constexpr, k_dim: tl.constexpr, k_bits: tl.constexpr,
    k_code_bytes: tl.constexpr, k_qjl: tl.constexpr, k_width: tl.constexpr,
    v_exact: tl.constexpr, v_dim: tl.constexpr, v_bits: tl.constexpr,
    v_code_bytes: tl.constexpr, v_width: tl.constexpr,
    band_k_mode: tl.constexpr, bk_dim: tl.constexpr, bk_bits: tl.constexpr,
    bk_code_bytes: tl.constexpr, bk_width: tl.constexpr,
    BAND_VALUE_CODES: tl.constexpr, bv_dim: tl.constexpr, bv_bits: tl.constexpr,
    bv_code_bytes: tl.constexpr, bv_width: tl.constexpr,
    # compile-time: tiles, and whether the scores of codes run on tensor cores (the
    # configuration: limits.attention_config)
    BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    SCORE_TENSOR_CORES: tl.constexpr,
):  # fmt: skip
    """Online softmax over one split of the keys for one block of rows and one block of value
    columns, one loop per stream; see the module doc."""
    pid_bh = tl.program_id(0)
    pid_rows = tl.program_id(1)
    pid_split = tl.program_id(2) // value_blocks
    v_col0 = (tl.program_id(2) % value_blocks) * BLOCK_V  # first value column of the program
    acc_width = value_blocks * BLOCK_V
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)

    ROWS: tl.constexpr = BLOCK_ROWS  # query rows a program serves
    rows = pid_rows * ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    n_parts = n_splits
    part = pid_split
    q_rows = pid_bh.to(tl.int64) * n_rows + rows  # index into the query-side arrays
    positions = start + rows // group  # query position of each row
    mask_b = mask_ptr + b * stride_mb
    score_scale = scale * LOG2E  # logits in base-2 units (LOG2E)
    softcap_base2 = softcap * LOG2E

    # keys this program reads: its split, cut to what the rows of the block can see
    last_row = tl.minimum(pid_rows * ROWS + ROWS, n_rows) - 1
    block_lo = start + (pid_rows * ROWS) // group
    block_hi = start + last_row // group  # last query position of the block
    k_begin = tl.maximum(first, split_lo + pid_split * partition)
    k_end = tl.minimum(end, split_lo + (pid_split + 1) * partition)
    if causal != 0:
        k_end = tl.minimum(k_end, block_hi + 1)
        if window > 0:
            k_begin = tl.maximum(k_begin, block_lo - window + 1)

    # 1. the main stream: keys after the sink, pairs outside the band
    main_lo = tl.maximum(k_begin, n_sink)
    main_hi = k_end
    if (causal != 0) & (band_k_mode > 0):  # later keys are in every row's band (or masked)
        main_hi = tl.minimum(k_end, block_hi - band + 1)
    k_codes = k_codes_ptr + b * stride_kcb + kvh * stride_kch
    k_norms = k_norms_ptr + b * stride_knb + kvh * stride_knh
    k_signs = k_signs_ptr + b * stride_ksb + kvh * stride_ksh
    k_rnorms = k_rnorms_ptr + b * stride_krb + kvh * stride_krh
    k_x = k_exact_ptr + b * stride_kxb + kvh * stride_kxh
    v_codes = v_codes_ptr + b * stride_vcb + kvh * stride_vch
    v_norms = v_norms_ptr + b * stride_vnb + kvh * stride_vnh
    v_x = v_exact_ptr + b * stride_vxb + kvh * stride_vxh
    # <q, mu> (zeros: no mean), and the rows' scales, each times score_scale
    mean = tl.load(mean_ptr + q_rows, mask=row_mask, other=0.0) * score_scale
    q_main_scale = tl.load(q_main_scale_ptr + q_rows, mask=row_mask, other=0.0) * score_scale
    qjl_scale = k_qjl_scale * score_scale
    m_i, l_i, acc = fresh_softmax(BLOCK_ROWS, BLOCK_S, BLOCK_V)
    tile_lo, slot_lo = aligned_start(main_lo, main_hi, k_cap, BLOCK_S)
    loaded = every_key(BLOCK_S)
    for tile in range(tile_lo, main_hi, BLOCK_S):
        slots, slot_lo = ring_tile(tile, slot_lo, k_cap, BLOCK_S)
        keys, in_range = tile_range(tile, main_lo, main_hi, BLOCK_S)
        if k_exact != 0:
            scores = exact_scores(
                q_raw_ptr, q_rows, row_mask, head_dim, k_x, slots, stride_kxs, loaded,
                BLOCK_ROWS, BLOCK_S, CHUNK,
            )  # fmt: skip
            scores = scores * score_scale
        else:
            norms = load_norms(k_norms, slots, k_width)
            scores = code_scores(
                q_main_ptr, q_rows, row_mask, k_dim, k_codes, slots, stride_kcs, loaded,
                k_bits, k_code_bytes, k_table_ptr, BLOCK_ROWS, BLOCK_S, CHUNK,
                group_loads(k_bits, k_dim, CHUNK), SCORE_TENSOR_CORES, True,
            ) * norms[None, :]  # fmt: skip
            if k_qjl > 0:
                rnorms = load_norms(k_rnorms, slots, k_width)
                qjl = sign_scores(
                    q_sketch_ptr, q_rows, row_mask, k_sketch_dim, k_signs, slots, stride_kss,
                    loaded,
                    BLOCK_ROWS, BLOCK_S, CHUNK,
                )  # fmt: skip
                scores = scores * q_main_scale[:, None] + qjl * (rnorms * qjl_scale)[None, :]
                scores = scores + mean[:, None]
            else:
                scores = scores * q_main_scale[:, None] + mean[:, None]
        visible = visible_pairs(
            keys, in_range, rows, row_mask, positions, group, causal, window, has_mask, mask_b,
            stride_mt, stride_mk, mask_len, mask_offset,
        )  # fmt: skip
        # band pairs are read from the band (without a branch, as in visible_pairs)
        before_band = keys <= positions[:, None] - band
        not_band = before_band | (keys > positions[:, None]) | (band_k_mode == 0)
        visible = visible * not_band.to(tl.int8)
        p, m_i, l_i, acc = softmax_step(scores, visible, softcap_base2, m_i, l_i, acc, SOFTCAP)
        weights = p
        if v_exact != 0:
            v_tile = exact_values(v_x, slots, stride_vxs, loaded, head_dim, v_col0, BLOCK_V)
            acc = tl.dot(weights, v_tile, acc, input_precision="ieee")
        else:  # sum_j (p_j ||v_j||) c_j, the products on tensor cores
            v_norms_tile = load_norms(v_norms, slots, v_width)
            centroids = code_values(
                v_codes, slots, stride_vcs, loaded, v_bits, v_code_bytes, v_centroids_ptr,
                v_dim, v_col0, BLOCK_V,
            )  # fmt: skip
            acc = split_dot(weights * v_norms_tile[None, :], centroids, acc)
    store_partial(
        part_m_ptr, part_l_ptr, part_acc_ptr, q_rows, n_parts, part, 0, row_mask, m_i, l_i,
        acc, v_col0, acc_width, BLOCK_V,
    )  # fmt: skip

    # 2. the recent band: keys i - band < j <= i after the sink
    band_lo = tl.maximum(tl.maximum(k_begin, block_lo - band + 1), n_sink)
    band_hi = tl.minimum(k_end, block_hi + 1)
    if band_k_mode == 0:
        band_hi = band_lo  # no band: an empty loop
    bk_codes = bk_codes_ptr + b * stride_bkcb + kvh * stride_bkch
    bk_norms = bk_norms_ptr + b * stride_bknb + kvh * stride_bknh
    bk_x = bk_exact_ptr + b * stride_bkxb + kvh * stride_bkxh
    bv_codes = bv_codes_ptr + b * stride_bvcb + kvh * stride_bvch
    bv_norms = bv_norms_ptr + b * stride_bvnb + kvh * stride_bvnh
    bv_x = bv_exact_ptr + b * stride_bvxb + kvh * stride_bvxh
    band_mean = tl.load(band_mean_ptr + q_rows, mask=row_mask, other=0.0) * score_scale
    q_band_scale = tl.load(q_band_scale_ptr + q_rows, mask=row_mask, other=0.0) * score_scale
    m_i, l_i, acc = fresh_softmax(BLOCK_ROWS, BLOCK_S, BLOCK_V)
    tile_lo, slot_lo = aligned_start(band_lo, band_hi, b_cap, BLOCK_S)
    loaded = every_key(BLOCK_S)
    for tile in range(tile_lo, band_hi, BLOCK_S):
        slots, slot_lo = ring_tile(tile, slot_lo, b_cap, BLOCK_S)
        keys, in_range = tile_range(tile, band_lo, band_hi, BLOCK_S)
        if band_k_mode == 2:  # keys as codes
            norms = load_norms(bk_norms, slots, bk_width)
            scores = code_scores(
                q_band_ptr, q_rows, row_mask, bk_dim, bk_codes, slots, stride_bkcs, loaded,
                bk_bits, bk_code_bytes, bk_table_ptr, BLOCK_ROWS, BLOCK_S, CHUNK,
                group_loads(bk_bits, bk_dim, CHUNK), SCORE_TENSOR_CORES, True,
            ) * norms[None, :]  # fmt: skip
            scores = scores * q_band_scale[:, None] + band_mean[:, None]
        else:
            scores = exact_scores(
                q_raw_ptr, q_rows, row_mask, head_dim, bk_x, slots, stride_bkxs, loaded,
                BLOCK_ROWS, BLOCK_S, CHUNK,
            )  # fmt: skip
            scores = scores * score_scale
        visible = visible_pairs(
            keys, in_range, rows, row_mask, positions, group, causal, window, has_mask, mask_b,
            stride_mt, stride_mk, mask_len, mask_offset,
        )  # fmt: skip
        after_band_start = keys > positions[:, None] - band
        visible = visible * (after_band_start & (keys <= positions[:, None])).to(tl.int8)
        p, m_i, l_i, acc = softmax_step(scores, visible, softcap_base2, m_i, l_i, acc, SOFTCAP)
        weights = p
        if BAND_VALUE_CODES:
            v_norms_tile = load_norms(bv_norms, slots, bv_width)
            centroids = code_values(
                bv_codes, slots, stride_bvcs, loaded, bv_bits, bv_code_bytes, bv_centroids_ptr,
                bv_dim, v_col0, BLOCK_V,
            )  # fmt: skip
            acc = split_dot(weights * v_norms_tile[None, :], centroids, acc)
        else:
            tile_keys = tile + tl.arange(0, BLOCK_S)
            v_tile = exact_values(
                bv_x, tile_keys % bv_cap, stride_bvxs, loaded, head_dim, v_col0, BLOCK_V
            )
            acc = tl.dot(weights, v_tile, acc, input_precision="ieee")
    store_partial(
        part_m_ptr, part_l_ptr, part_acc_ptr, q_rows, n_parts, part, 1, row_mask, m_i, l_i,
        acc, v_col0, acc_width, BLOCK_V, tl.minimum(slot_lo, 0),  # a slot: >= 0
    )  # fmt: skip

    # 3. the sink: keys j < n_sink, exact
    sink_hi = tl.minimum(k_end, n_sink)
    sink_k = sink_k_ptr + b * stride_skb + kvh * stride_skh
    sink_v = sink_v_ptr + b * stride_svb + kvh * stride_svh
    m_i, l_i, acc = fresh_softmax(BLOCK_ROWS, BLOCK_S, BLOCK_V)
    for tile in range(k_begin, sink_hi, BLOCK_S):
        tile_keys = tile + tl.arange(0, BLOCK_S)
        stored = tile_keys < sink_hi
        scores = exact_scores(
            q_raw_ptr, q_rows, row_mask, head_dim, sink_k, tile_keys, stride_sks, stored,
            BLOCK_ROWS, BLOCK_S, CHUNK,
        )  # fmt: skip
        scores = scores * score_scale
        keys, in_range = tile_range(tile, k_begin, sink_hi, BLOCK_S)
        visible = visible_pairs(
            keys, in_range, rows, row_mask, positions, group, causal, window, has_mask, mask_b,
            stride_mt, stride_mk, mask_len, mask_offset,
        )  # fmt: skip
        p, m_i, l_i, acc = softmax_step(scores, visible, softcap_base2, m_i, l_i, acc, SOFTCAP)
        v_tile = exact_values(
            sink_v, tile_keys % sv_cap, stride_svs, stored, head_dim, v_col0, BLOCK_V
        )
        acc = tl.dot(p, v_tile, acc, input_precision="ieee")
    store_partial(
        part_m_ptr, part_l_ptr, part_acc_ptr, q_rows, n_parts, part, 2, row_mask, m_i, l_i,
        acc, v_col0, acc_width, BLOCK_V, tl.minimum(sink_hi, 0),  # a key: >= 0
    )  # fmt: skip


@triton.jit
def reduce_kernel(
    part_m_ptr,  # fp32 [rows, n_parts, 3]
    part_l_ptr,  # fp32 [rows, n_parts, 3]
    part_acc_ptr,  # fp32 [rows, n_parts, 3, width]
    out_ptr,  # fp32 [rows, 3, width]
    n_parts,
    width,
    BLOCK: tl.constexpr,
):
    """Merge the splits and streams of one row, BLOCK columns of one slot per
    program: ``out_t = sum_s w_st acc_st / sum_st w_st l_st`` with ``w_st = 2^(m_st - M)``
    (the maxima are in base-2 units, :data:`LOG2E`), reading only the accumulators of weight
    ``w_st > 0``; zeros for a row that saw no key."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < width
    entries = n_parts * 3  # (part, slot) entries of the row

    m_max = tl.load(part_m_ptr + row * entries)
    for s in range(1, entries):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + row * entries + s))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)

    total = 0.0
    for s in range(0, entries):
        weight = tl.exp2(tl.load(part_m_ptr + row * entries + s) - m_safe)
        total += weight * tl.load(part_l_ptr + row * entries + s)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for part in range(0, n_parts):
        s = part * 3 + slot
        weight = tl.exp2(tl.load(part_m_ptr + row * entries + s) - m_safe)
        # an entry whose row saw no key was not written (store_partial): weight 0, not read
        read = col_mask & ((tl.zeros((BLOCK,), dtype=tl.float32) + weight) > 0.0)
        partial = tl.load(part_acc_ptr + (row * entries + s) * width + cols, mask=read, other=0.0)
        acc += weight * partial
    out = tl.where(total > 0.0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(out_ptr + (row * 3 + slot) * width + cols, out, mask=col_mask)
