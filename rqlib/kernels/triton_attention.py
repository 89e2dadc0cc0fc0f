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
rotated dimensions, norm widths and, for trellis codes, the trellis's state bits and whether
it is read tail-biting (:func:`rqlib.kernels.limits.attention_formats`), and so is whether
scores are softcapped (``SOFTCAP``). A specialization holds only the loads and
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
    trellis_state_bits: tl.constexpr, trellis_tail_biting: tl.constexpr,
):  # fmt: skip
    """The centroids ``c[codes]`` of the keys' slots, columns ``col0 ..`` of the rotated space,
    ``[BLOCK_S, BLOCK_V]``, fp16, from the codebook ``centroids_ptr``, or a trellis's levels
    at its shift registers (``triton_common.code_centroids``)."""
    rows_ptr = codes_ptr + slots.to(tl.int64)[:, None] * stride_s
    return code_centroids(
        rows_ptr, col0, key_mask, width, bits, code_bytes, centroids_ptr, BLOCK_V,
        group_loads(bits, width, BLOCK_V), False, trellis_state_bits, trellis_tail_biting,
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


#: what a stream's loop reads of each (row, key) pair (compile-time ``KIND`` of
#: :func:`stream_loop`): the main stream the pairs outside the recent band, the band the pairs
#: inside it, the sink every pair of its keys
MAIN = tl.constexpr(0)
BAND = tl.constexpr(1)
SINK = tl.constexpr(2)


@triton.jit
def stream_loop(
    # the loop's keys lo .. hi - 1, and what it reads of each (row, key) pair
    lo, hi, KIND: tl.constexpr, band, BAND_ON: tl.constexpr,
    # the program's rows: (position, head of the group) pairs
    rows, row_mask, positions, q_rows, group,
    # the query side: exact rows, rows rotated for this stream's codes with their per-row
    # scale, the QJL sketch of the rotated rows, and <q, mu>
    q_raw_ptr, q_ptr, q_scale_ptr, q_sketch_ptr, mean_ptr,
    # keys: codes, norm stream, signs, residual norms, exact vectors (pointers at this
    # program's batch row and KV head), the table of centroid pairs, the ring's capacity and
    # the slot strides
    k_codes, k_norms, k_signs, k_rnorms, k_vectors, k_table, k_cap,
    k_stride_cs, k_stride_ss, k_stride_xs, k_sketch_dim, k_qjl_scale,
    # values: codes, norm stream, exact vectors, codebook, and the capacity of the exact ring
    # they are read from (``V_OWN_SLOTS``: the keys' slots instead)
    v_codes, v_norms, v_vectors, v_centroids, v_cap, v_stride_cs, v_stride_xs,
    # masks
    causal, window, has_mask, mask_b, stride_mt, stride_mk, mask_len, mask_offset,
    score_scale, softcap_base2, v_col0,
    # compile-time: the stream's formats (0 for exact vectors), and how its keys are found
    k_exact: tl.constexpr, k_dim: tl.constexpr, k_bits: tl.constexpr,
    k_code_bytes: tl.constexpr, k_qjl: tl.constexpr, k_width: tl.constexpr,
    k_trellis_state_bits: tl.constexpr, k_trellis_tail_biting: tl.constexpr,
    v_exact: tl.constexpr, v_dim: tl.constexpr, v_bits: tl.constexpr,
    v_code_bytes: tl.constexpr, v_width: tl.constexpr,
    v_trellis_state_bits: tl.constexpr, v_trellis_tail_biting: tl.constexpr,
    V_OWN_SLOTS: tl.constexpr, RING: tl.constexpr, head_dim: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr, SCORE_TENSOR_CORES: tl.constexpr,
):  # fmt: skip
    """The online softmax of the rows over one stream's keys ``lo .. hi - 1``, tile by tile:
    scores (codes, with QJL signs, or exact), the masks, the softmax step, the values weighted in
    place. ``RING``: keys live in a ring (slot ``p % capacity``, whole aligned tiles read
    without load masks, :func:`aligned_start`); else at their positions (the sink). Returns
    ``(m, l, acc)``."""
    m_i, l_i, acc = fresh_softmax(BLOCK_ROWS, BLOCK_S, BLOCK_V)
    mean = tl.load(mean_ptr + q_rows, mask=row_mask, other=0.0) * score_scale
    q_scale = tl.load(q_scale_ptr + q_rows, mask=row_mask, other=0.0) * score_scale
    qjl_scale = k_qjl_scale * score_scale
    if RING:
        tile_lo, slot_lo = aligned_start(lo, hi, k_cap, BLOCK_S)
    else:
        tile_lo, slot_lo = lo, 0
    for tile in range(tile_lo, hi, BLOCK_S):
        tile_keys = tile + tl.arange(0, BLOCK_S)
        if RING:
            slots, slot_lo = ring_tile(tile, slot_lo, k_cap, BLOCK_S)
            loaded = every_key(BLOCK_S)
        else:
            slots, loaded = tile_keys, tile_keys < hi
        keys, in_range = tile_range(tile, lo, hi, BLOCK_S)
        if k_exact != 0:
            scores = exact_scores(
                q_raw_ptr, q_rows, row_mask, head_dim, k_vectors, slots, k_stride_xs, loaded,
                BLOCK_ROWS, BLOCK_S, CHUNK,
            ) * score_scale  # fmt: skip
        else:
            norms = load_norms(k_norms, slots, k_width)
            scores = code_scores(
                q_ptr, q_rows, row_mask, k_dim, k_codes, slots, k_stride_cs, loaded,
                k_bits, k_code_bytes, k_table, BLOCK_ROWS, BLOCK_S, CHUNK,
                group_loads(k_bits, k_dim, CHUNK), SCORE_TENSOR_CORES, True,
                k_trellis_state_bits, k_trellis_tail_biting,
            ) * norms[None, :]  # fmt: skip
            scores = scores * q_scale[:, None] + mean[:, None]
            if k_qjl > 0:
                rnorms = load_norms(k_rnorms, slots, k_width)
                qjl = sign_scores(
                    q_sketch_ptr, q_rows, row_mask, k_sketch_dim, k_signs, slots, k_stride_ss,
                    loaded, BLOCK_ROWS, BLOCK_S, CHUNK,
                )  # fmt: skip
                scores = scores + qjl * (rnorms * qjl_scale)[None, :]
        visible = visible_pairs(
            keys, in_range, rows, row_mask, positions, group, causal, window, has_mask, mask_b,
            stride_mt, stride_mk, mask_len, mask_offset,
        )  # fmt: skip
        # each pair is read from one stream (without a branch, as in visible_pairs)
        if KIND == MAIN:
            outside_band = (keys <= positions[:, None] - band) | (keys > positions[:, None])
            visible = visible * (outside_band | (not BAND_ON)).to(tl.int8)
        if KIND == BAND:
            inside_band = (keys > positions[:, None] - band) & (keys <= positions[:, None])
            visible = visible * inside_band.to(tl.int8)
        p, m_i, l_i, acc = softmax_step(scores, visible, softcap_base2, m_i, l_i, acc, SOFTCAP)
        v_slots = slots if V_OWN_SLOTS else tile_keys % v_cap
        if v_exact != 0:
            v_tile = exact_values(
                v_vectors, v_slots, v_stride_xs, loaded, head_dim, v_col0, BLOCK_V
            )
            acc = tl.dot(p, v_tile, acc, input_precision="ieee")
        else:  # sum_j (p_j ||v_j||) c_j, the products on tensor cores
            v_norms_tile = load_norms(v_norms, v_slots, v_width)
            centroids = code_values(
                v_codes, v_slots, v_stride_cs, loaded, v_bits, v_code_bytes, v_centroids,
                v_dim, v_col0, BLOCK_V, v_trellis_state_bits, v_trellis_tail_biting,
            )  # fmt: skip
            acc = split_dot(p * v_norms_tile[None, :], centroids, acc)
    return m_i, l_i, acc


#: the run-time integers that change from step to step (positions, lengths, the splits' keys):
#: Triton would otherwise compile a variant for each that is, or is not, a multiple of 16, so
#: that a generation compiled new kernels as its context grew
STEP_INTEGERS = (
    "start", "first", "end", "n_rows", "partition", "split_lo", "n_sink", "mask_len",
    "mask_offset", "k_cap", "v_cap", "bk_cap", "bv_cap", "sink_v_cap",
)  # fmt: skip


@triton.jit(do_not_specialize=STEP_INTEGERS)
def attention_kernel(
    # query side, fp32, one row per (batch, KV head, position, head of the group); the rows
    # read against codes scaled by a power of two per row (q_main_scale, q_band_scale)
    q_raw_ptr, q_main_ptr, q_main_scale_ptr, q_sketch_ptr, q_band_ptr, q_band_scale_ptr,
    mean_ptr, band_mean_ptr,
    # each stream (k main keys, v main values, bk the band's keys, bv its values): codes, norm
    # stream, exact vectors, the keys' tables of centroid pairs (*_table_ptr: rqlib.kernels.
    # numerics.kernel_table, fp16 centroids or float32 for the scores on the CUDA cores) or
    # the values' fp16 codebook (*_centroids_ptr), the ring's capacity and the strides of its
    # buffers (codes b/h/slot, norms b/h, exact b/h/slot)
    k_codes_ptr, k_norms_ptr, k_exact_ptr, k_table_ptr, k_cap,
    k_stride_cb, k_stride_ch, k_stride_cs, k_stride_nb, k_stride_nh,
    k_stride_xb, k_stride_xh, k_stride_xs,
    # the main keys' QJL signs and residual norms, sketch dimension and scale
    k_signs_ptr, k_rnorms_ptr, k_stride_sb, k_stride_sh, k_stride_ss, k_stride_rb, k_stride_rh,
    k_sketch_dim, k_qjl_scale,
    v_codes_ptr, v_norms_ptr, v_exact_ptr, v_centroids_ptr, v_cap,
    v_stride_cb, v_stride_ch, v_stride_cs, v_stride_nb, v_stride_nh,
    v_stride_xb, v_stride_xh, v_stride_xs,
    bk_codes_ptr, bk_norms_ptr, bk_exact_ptr, bk_table_ptr, bk_cap,
    bk_stride_cb, bk_stride_ch, bk_stride_cs, bk_stride_nb, bk_stride_nh,
    bk_stride_xb, bk_stride_xh, bk_stride_xs,
    # the band's values (codes, or exact vectors: the band's own or, for a layer whose values
    # are exact, the main ones)
    bv_codes_ptr, bv_norms_ptr, bv_exact_ptr, bv_centroids_ptr, bv_cap,
    bv_stride_cb, bv_stride_ch, bv_stride_cs, bv_stride_nb, bv_stride_nh,
    bv_stride_xb, bv_stride_xh, bv_stride_xs,
    # exact sink keys [B, KV, n_sink_slots, d] and their values (the sink's or the main ones)
    sink_k_ptr, sink_v_ptr, sink_stride_kb, sink_stride_kh, sink_stride_ks,
    sink_stride_vb, sink_stride_vh, sink_stride_vs, sink_v_cap,
    # mask tensor (uint8 view of a bool tensor) and partial results
    mask_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    # shapes and positions
    kv_heads, group, n_rows, start, first, end, n_splits, partition, split_lo, value_blocks,
    n_sink, band, causal, window, has_mask, mask_len, mask_offset, stride_mb, stride_mt, stride_mk,
    scale, softcap,
    # compile-time: whether the scores are softcapped (their cap: softcap)
    SOFTCAP: tl.constexpr,
    # compile-time: the layer's storage formats (rqlib.kernels.limits.attention_formats)
    head_dim: tl.constexpr,
    k_exact: tl.constexpr, k_dim: tl.constexpr, k_bits: tl.constexpr,
    k_code_bytes: tl.constexpr, k_qjl: tl.constexpr, k_width: tl.constexpr,
    k_trellis_state_bits: tl.constexpr, k_trellis_tail_biting: tl.constexpr,
    v_exact: tl.constexpr, v_dim: tl.constexpr, v_bits: tl.constexpr,
    v_code_bytes: tl.constexpr, v_width: tl.constexpr,
    v_trellis_state_bits: tl.constexpr, v_trellis_tail_biting: tl.constexpr,
    band_k_mode: tl.constexpr, bk_dim: tl.constexpr, bk_bits: tl.constexpr,
    bk_code_bytes: tl.constexpr, bk_width: tl.constexpr,
    bk_trellis_state_bits: tl.constexpr, bk_trellis_tail_biting: tl.constexpr,
    BAND_VALUE_CODES: tl.constexpr, bv_dim: tl.constexpr, bv_bits: tl.constexpr,
    bv_code_bytes: tl.constexpr, bv_width: tl.constexpr,
    bv_trellis_state_bits: tl.constexpr, bv_trellis_tail_biting: tl.constexpr,
    # compile-time: tiles, and whether the scores of codes run on tensor cores (the
    # configuration: limits.attention_config)
    BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    SCORE_TENSOR_CORES: tl.constexpr,
):  # fmt: skip
    """Online softmax over one split of the keys for one block of rows and one block of value
    columns: :func:`stream_loop` over the main stream, the band and the sink, each writing its
    partial result; see the module doc."""
    pid_bh = tl.program_id(0)
    pid_rows = tl.program_id(1)
    pid_split = tl.program_id(2) // value_blocks
    v_col0 = (tl.program_id(2) % value_blocks) * BLOCK_V  # first value column of the program
    acc_width = value_blocks * BLOCK_V
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)

    rows = pid_rows * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    q_rows = pid_bh.to(tl.int64) * n_rows + rows  # index into the query-side arrays
    positions = start + rows // group  # query position of each row
    mask_b = mask_ptr + b * stride_mb
    score_scale = scale * LOG2E  # logits in base-2 units (LOG2E)
    softcap_base2 = softcap * LOG2E

    # keys this program reads: its split, cut to what the rows of the block can see
    last_row = tl.minimum(pid_rows * BLOCK_ROWS + BLOCK_ROWS, n_rows) - 1
    block_lo = start + (pid_rows * BLOCK_ROWS) // group
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
    m_i, l_i, acc = stream_loop(
        main_lo, main_hi, MAIN, band, band_k_mode > 0,
        rows, row_mask, positions, q_rows, group,
        q_raw_ptr, q_main_ptr, q_main_scale_ptr, q_sketch_ptr, mean_ptr,
        k_codes_ptr + b * k_stride_cb + kvh * k_stride_ch,
        k_norms_ptr + b * k_stride_nb + kvh * k_stride_nh,
        k_signs_ptr + b * k_stride_sb + kvh * k_stride_sh,
        k_rnorms_ptr + b * k_stride_rb + kvh * k_stride_rh,
        k_exact_ptr + b * k_stride_xb + kvh * k_stride_xh,
        k_table_ptr, k_cap, k_stride_cs, k_stride_ss, k_stride_xs, k_sketch_dim, k_qjl_scale,
        v_codes_ptr + b * v_stride_cb + kvh * v_stride_ch,
        v_norms_ptr + b * v_stride_nb + kvh * v_stride_nh,
        v_exact_ptr + b * v_stride_xb + kvh * v_stride_xh,
        v_centroids_ptr, v_cap, v_stride_cs, v_stride_xs,
        causal, window, has_mask, mask_b, stride_mt, stride_mk, mask_len, mask_offset,
        score_scale, softcap_base2, v_col0,
        k_exact, k_dim, k_bits, k_code_bytes, k_qjl, k_width,
        k_trellis_state_bits, k_trellis_tail_biting,
        v_exact, v_dim, v_bits, v_code_bytes, v_width,
        v_trellis_state_bits, v_trellis_tail_biting, True,
        True, head_dim, SOFTCAP, BLOCK_ROWS, BLOCK_S, BLOCK_V, CHUNK, SCORE_TENSOR_CORES,
    )  # fmt: skip
    store_partial(
        part_m_ptr, part_l_ptr, part_acc_ptr, q_rows, n_splits, pid_split, 0, row_mask, m_i, l_i,
        acc, v_col0, acc_width, BLOCK_V,
    )  # fmt: skip

    # 2. the recent band: keys i - band < j <= i after the sink
    band_lo = tl.maximum(tl.maximum(k_begin, block_lo - band + 1), n_sink)
    band_hi = tl.minimum(k_end, block_hi + 1)
    if band_k_mode == 0:
        band_hi = band_lo  # no band: an empty loop
    m_i, l_i, acc = stream_loop(
        band_lo, band_hi, BAND, band, True,
        rows, row_mask, positions, q_rows, group,
        q_raw_ptr, q_band_ptr, q_band_scale_ptr, q_sketch_ptr, band_mean_ptr,
        bk_codes_ptr + b * bk_stride_cb + kvh * bk_stride_ch,
        bk_norms_ptr + b * bk_stride_nb + kvh * bk_stride_nh,
        k_signs_ptr, k_rnorms_ptr,
        bk_exact_ptr + b * bk_stride_xb + kvh * bk_stride_xh,
        bk_table_ptr, bk_cap, bk_stride_cs, 0, bk_stride_xs, 0, 0.0,
        bv_codes_ptr + b * bv_stride_cb + kvh * bv_stride_ch,
        bv_norms_ptr + b * bv_stride_nb + kvh * bv_stride_nh,
        bv_exact_ptr + b * bv_stride_xb + kvh * bv_stride_xh,
        bv_centroids_ptr, bv_cap, bv_stride_cs, bv_stride_xs,
        causal, window, has_mask, mask_b, stride_mt, stride_mk, mask_len, mask_offset,
        score_scale, softcap_base2, v_col0,
        band_k_mode != 2, bk_dim, bk_bits, bk_code_bytes, 0, bk_width,
        bk_trellis_state_bits, bk_trellis_tail_biting,
        not BAND_VALUE_CODES, bv_dim, bv_bits, bv_code_bytes, bv_width,
        bv_trellis_state_bits, bv_trellis_tail_biting, BAND_VALUE_CODES,
        True, head_dim, SOFTCAP, BLOCK_ROWS, BLOCK_S, BLOCK_V, CHUNK, SCORE_TENSOR_CORES,
    )  # fmt: skip
    store_partial(
        part_m_ptr, part_l_ptr, part_acc_ptr, q_rows, n_splits, pid_split, 1, row_mask, m_i, l_i,
        acc, v_col0, acc_width, BLOCK_V, tl.minimum(band_lo, 0),  # a key: >= 0
    )  # fmt: skip

    # 3. the sink: keys j < n_sink, exact
    sink_hi = tl.minimum(k_end, n_sink)
    m_i, l_i, acc = stream_loop(
        k_begin, sink_hi, SINK, band, False,
        rows, row_mask, positions, q_rows, group,
        q_raw_ptr, q_main_ptr, q_main_scale_ptr, q_sketch_ptr, mean_ptr,
        k_codes_ptr, k_norms_ptr, k_signs_ptr, k_rnorms_ptr,
        sink_k_ptr + b * sink_stride_kb + kvh * sink_stride_kh,
        k_table_ptr, 1, 0, 0, sink_stride_ks, 0, 0.0,
        v_codes_ptr, v_norms_ptr,
        sink_v_ptr + b * sink_stride_vb + kvh * sink_stride_vh,
        v_centroids_ptr, sink_v_cap, 0, sink_stride_vs,
        causal, window, has_mask, mask_b, stride_mt, stride_mk, mask_len, mask_offset,
        score_scale, softcap_base2, v_col0,
        True, 0, 0, 0, 0, 0, 0, False,
        True, 0, 0, 0, 0, 0, False, False,
        False, head_dim, SOFTCAP, BLOCK_ROWS, BLOCK_S, BLOCK_V, CHUNK, SCORE_TENSOR_CORES,
    )  # fmt: skip
    store_partial(
        part_m_ptr, part_l_ptr, part_acc_ptr, q_rows, n_splits, pid_split, 2, row_mask, m_i, l_i,
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
