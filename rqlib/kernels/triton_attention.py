"""Triton kernels: attention over one layer of the compressed cache, fused (split + reduce).

``attention_kernel``: one program per (batch, KV head, block of BLOCK_ROWS query rows, split of
the keys). A row is a (query position, query head of the GQA group) pair, so a key tile is
decoded once for the whole group and any group size is served (a group of 40 heads is three row
blocks). The program walks its keys in tiles of BLOCK_S and, per tile:

1. scores from the stored keys: ``||k|| <R q', c[codes]> + ||r|| gamma/m <S R q', signs>`` plus
   ``<q, mu>`` (centering), with ``q' = q / a`` (channel scaling) rotated once on the host, or
   ``<q, k>`` for an exact layer; norms are read from their bit stream (``w``-bit fields);
2. the substitution: a pair (query ``i``, key ``j``) with ``i - band < j <= i`` takes its score
   from the recent band (codes of the band codec, or exact), a sink key (``j < n_sink``) from the
   exact sink (the sink wins); only tiles that hold such keys load them;
3. scale, logit softcap, the mask (causal, sliding window, and a padding or dense mask read per
   key), and an online softmax (running max m, running sum l);
4. values weighted in place: the main stream's codes accumulate ``p ||v|| c[codes]`` in the value
   quantizer's rotated space (``acc_main``), band codes in the band's (``acc_band``), exact band
   and sink values in the model's coordinates (``acc_exact``). Nothing is ever decoded to a
   value vector per key; the rotations back happen once per query after the reduce.

Each program writes (m, l, acc_main | acc_band | acc_exact); ``reduce_kernel`` merges the splits
of every row: ``M = max m_s``, ``out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s``. A row
that sees no key (a padding position) gets zeros.

Tokens live in ring buffers (:mod:`rqlib.kernels.store`): position ``p`` of a stream with
``C`` slots is slot ``p % C``, so an append-only stream and a window (the band, a sliding layer
that evicts old tokens) are read the same way.

Bytes read per key and KV head in a decode step, head_dim 128, 3-bit keys and values, 11-bit
norms: 2 * (48 + 1.375) = 98.75 bytes, against 512 for fp16 keys and values; the sink and band
tokens add a constant per step, and the partial results ``(2 + 3 * BLOCK_V)`` floats per row and
split.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rqlib.kernels.triton_common import code_scores, exact_scores, load_codes, sign_scores


@triton.jit
def load_norms(row_ptr, slots, width, valid, nbytes):
    """Float32 norms of ``slots`` from a bit stream of ``width``-bit fields (slot ``s`` at stream
    bits ``s * width ...``): float16 patterns without sign and dropped mantissa bits, or whole
    float16 values when ``width`` is 16."""
    bit = slots.to(tl.int64) * width
    byte = bit >> 3
    shift = (bit & 7).to(tl.int32)
    b0 = tl.load(row_ptr + byte, mask=valid, other=0).to(tl.int32)
    b1 = tl.load(row_ptr + byte + 1, mask=valid & (byte + 1 < nbytes), other=0).to(tl.int32)
    b2 = tl.load(row_ptr + byte + 2, mask=valid & (byte + 2 < nbytes), other=0).to(tl.int32)
    field = ((b0 | (b1 << 8) | (b2 << 16)) >> shift) & ((1 << width) - 1)
    pattern = field << tl.where(width < 16, 15 - width, 0)
    return pattern.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def code_values(
    codes_ptr, slots, stride_s, key_mask, bits, code_bytes, centroids_ptr, width, norms,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """``||v|| c[codes]`` of the keys' slots, ``[BLOCK_S, BLOCK_V]`` (rotated space)."""
    cols = tl.arange(0, BLOCK_V)
    v_mask = key_mask[:, None] & (cols < width)[None, :]
    rows_ptr = codes_ptr + slots.to(tl.int64)[:, None] * stride_s
    codes = load_codes(rows_ptr, cols, v_mask, bits, code_bytes)
    return tl.load(centroids_ptr + codes, mask=v_mask, other=0.0) * norms[:, None]


@triton.jit
def exact_values(x_ptr, slots, stride_s, key_mask, width, BLOCK_V: tl.constexpr):
    """Exact value vectors of the keys' slots, ``[BLOCK_S, BLOCK_V]`` float32."""
    cols = tl.arange(0, BLOCK_V)
    v_mask = key_mask[:, None] & (cols < width)[None, :]
    rows_ptr = x_ptr + slots.to(tl.int64)[:, None] * stride_s
    return tl.load(rows_ptr + cols[None, :], mask=v_mask, other=0.0).to(tl.float32)


@triton.jit
def attention_kernel(
    # query side, fp32, one row per (batch, KV head, position, head of the group)
    q_raw_ptr, q_main_ptr, q_sketch_ptr, q_band_ptr, mean_ptr, band_mean_ptr,
    # main keys: codes, norm stream, QJL signs and residual-norm stream, or exact vectors
    k_codes_ptr, k_norms_ptr, k_signs_ptr, k_rnorms_ptr, k_exact_ptr, k_centroids_ptr,
    # main values: codes and norm stream, or exact vectors
    v_codes_ptr, v_norms_ptr, v_exact_ptr, v_centroids_ptr,
    # recent band: keys and values, codes and norm streams or exact vectors
    bk_codes_ptr, bk_norms_ptr, bk_exact_ptr, bk_centroids_ptr,
    bv_codes_ptr, bv_norms_ptr, bv_exact_ptr, bv_centroids_ptr,
    # exact sink keys and values [B, KV, n_sink_slots, d]
    sink_k_ptr, sink_v_ptr,
    # mask tensor (uint8 view of a bool tensor) and partial results
    mask_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    # shapes and positions
    kv_heads, group, n_rows, head_dim, start, first, end, n_splits, partition, split_lo,
    n_sink, band, causal, window, has_mask, mask_len, mask_offset,
    stride_mb, stride_mt, stride_mk, scale, softcap,
    # main keys
    k_exact, k_cap, k_dim, k_bits, k_code_bytes, k_qjl, k_sign_bytes, k_qjl_scale, k_width,
    k_norm_bytes,
    stride_kcb, stride_kch, stride_kcs, stride_knb, stride_knh,
    stride_ksb, stride_ksh, stride_kss, stride_krb, stride_krh,
    stride_kxb, stride_kxh, stride_kxs,
    # main values
    v_exact, v_dim, v_bits, v_code_bytes, v_width, v_norm_bytes,
    stride_vcb, stride_vch, stride_vcs, stride_vnb, stride_vnh, stride_vxb, stride_vxh, stride_vxs,
    # band (mode 0: none, 1: exact, 2: codes) and band values (0: none, 1: exact, 2: codes)
    band_k_mode, band_v_mode, b_cap, bk_dim, bk_bits, bk_code_bytes, bk_width, bk_norm_bytes,
    bv_dim, bv_bits, bv_code_bytes, bv_width, bv_norm_bytes,
    stride_bkcb, stride_bkch, stride_bkcs, stride_bknb, stride_bknh,
    stride_bkxb, stride_bkxh, stride_bkxs,
    stride_bvcb, stride_bvch, stride_bvcs, stride_bvnb, stride_bvnh,
    stride_bvxb, stride_bvxh, stride_bvxs,
    stride_sb, stride_sh, stride_ss, sink_values,
    BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Online softmax over one split of the keys for one block of rows; see the module doc."""
    pid_bh = tl.program_id(0)
    pid_rows = tl.program_id(1)
    pid_split = tl.program_id(2)
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)

    rows = pid_rows * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    q_rows = pid_bh.to(tl.int64) * n_rows + rows  # index into the query-side arrays
    positions = start + rows // group  # query position of each row
    vcols = tl.arange(0, BLOCK_V)

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
    band_lo = tl.maximum(block_lo - band + 1, n_sink)  # first key a row may read from the band

    k_codes = k_codes_ptr + b * stride_kcb + kvh * stride_kch
    k_norms = k_norms_ptr + b * stride_knb + kvh * stride_knh
    k_signs = k_signs_ptr + b * stride_ksb + kvh * stride_ksh
    k_rnorms = k_rnorms_ptr + b * stride_krb + kvh * stride_krh
    k_x = k_exact_ptr + b * stride_kxb + kvh * stride_kxh
    v_codes = v_codes_ptr + b * stride_vcb + kvh * stride_vch
    v_norms = v_norms_ptr + b * stride_vnb + kvh * stride_vnh
    v_x = v_exact_ptr + b * stride_vxb + kvh * stride_vxh
    bk_codes = bk_codes_ptr + b * stride_bkcb + kvh * stride_bkch
    bk_norms = bk_norms_ptr + b * stride_bknb + kvh * stride_bknh
    bk_x = bk_exact_ptr + b * stride_bkxb + kvh * stride_bkxh
    bv_codes = bv_codes_ptr + b * stride_bvcb + kvh * stride_bvch
    bv_norms = bv_norms_ptr + b * stride_bvnb + kvh * stride_bvnh
    bv_x = bv_exact_ptr + b * stride_bvxb + kvh * stride_bvxh
    sink_k = sink_k_ptr + b * stride_sb + kvh * stride_sh
    sink_v = sink_v_ptr + b * stride_sb + kvh * stride_sh

    mean = tl.load(mean_ptr + q_rows, mask=row_mask, other=0.0)  # <q, mu> (zeros: no mean)
    band_mean = tl.load(band_mean_ptr + q_rows, mask=row_mask, other=0.0)

    m_i = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    acc_main = tl.zeros((BLOCK_ROWS, BLOCK_V), dtype=tl.float32)
    acc_band = tl.zeros((BLOCK_ROWS, BLOCK_V), dtype=tl.float32)
    acc_exact = tl.zeros((BLOCK_ROWS, BLOCK_V), dtype=tl.float32)

    for tile in range(k_begin, k_end, BLOCK_S):
        keys = tile + tl.arange(0, BLOCK_S)
        in_range = keys < k_end
        slots = keys % k_cap

        # 1. scores from the main stream
        if k_exact != 0:
            scores = exact_scores(
                q_raw_ptr, q_rows, row_mask, head_dim, k_x, slots, stride_kxs, in_range,
                BLOCK_ROWS, BLOCK_S, CHUNK,
            )  # fmt: skip
        else:
            norms = load_norms(k_norms, slots, k_width, in_range, k_norm_bytes)
            scores = code_scores(
                q_main_ptr, q_rows, row_mask, k_dim, k_codes, slots, stride_kcs, in_range,
                k_bits, k_code_bytes, k_centroids_ptr, BLOCK_ROWS, BLOCK_S, CHUNK,
            ) * norms[None, :]  # fmt: skip
            if k_qjl > 0:
                rnorms = load_norms(k_rnorms, slots, k_width, in_range, k_norm_bytes)
                qjl = sign_scores(
                    q_sketch_ptr, q_rows, row_mask, k_qjl, k_signs, slots, stride_kss, in_range,
                    BLOCK_ROWS, BLOCK_S, CHUNK,
                )  # fmt: skip
                scores += qjl * (rnorms * k_qjl_scale)[None, :]
            scores += mean[:, None]

        # 2. the substitution: band pairs read the band, sink keys the exact sink
        is_sink = keys < n_sink
        in_band = (  # empty when band == 0
            (keys[None, :] > positions[:, None] - band)
            & (keys[None, :] <= positions[:, None])
            & (keys[None, :] >= n_sink)
        )
        tile_band = (band_k_mode > 0) & (tile + BLOCK_S > band_lo) & (tile <= block_hi)
        if tile_band:
            band_slots = keys % b_cap
            band_keys = in_range & (keys >= band_lo)
            if band_k_mode == 2:
                band_norms = load_norms(bk_norms, band_slots, bk_width, band_keys, bk_norm_bytes)
                band_scores = code_scores(
                    q_band_ptr, q_rows, row_mask, bk_dim, bk_codes, band_slots, stride_bkcs,
                    band_keys, bk_bits, bk_code_bytes, bk_centroids_ptr, BLOCK_ROWS, BLOCK_S,
                    CHUNK,
                ) * band_norms[None, :] + band_mean[:, None]  # fmt: skip
            else:
                band_scores = exact_scores(
                    q_raw_ptr, q_rows, row_mask, head_dim, bk_x, band_slots, stride_bkxs,
                    band_keys, BLOCK_ROWS, BLOCK_S, CHUNK,
                )  # fmt: skip
            scores = tl.where(in_band, band_scores, scores)
        tile_sink = tile < n_sink
        if tile_sink:
            sink_scores = exact_scores(
                q_raw_ptr, q_rows, row_mask, head_dim, sink_k, keys, stride_ss,
                in_range & is_sink, BLOCK_ROWS, BLOCK_S, CHUNK,
            )  # fmt: skip
            scores = tl.where(is_sink[None, :], sink_scores, scores)

        # 3. scale, softcap, mask, online softmax
        scores = scores * scale
        if softcap > 0:
            scaled = scores / softcap
            scores = softcap * (2.0 / (1.0 + tl.exp(-2.0 * scaled)) - 1.0)  # tanh
        # visibility as int8: a boolean tensor must not leave an `if` (no 1-bit shared memory)
        visible = (row_mask[:, None] & in_range[None, :]).to(tl.int8)
        if causal != 0:
            visible = visible * (keys[None, :] <= positions[:, None]).to(tl.int8)
            if window > 0:
                visible = visible * (keys[None, :] > positions[:, None] - window).to(tl.int8)
        if has_mask != 0:
            column = keys - mask_offset
            inside = (column >= 0) & (column < mask_len)
            flags = tl.load(
                mask_ptr + b * stride_mb + (rows // group)[:, None].to(tl.int64) * stride_mt
                + column.to(tl.int64)[None, :] * stride_mk,
                mask=(visible != 0) & inside[None, :],
                other=0,
            )  # fmt: skip
            visible = visible * (flags != 0).to(tl.int8)
        scores = tl.where(visible != 0, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc_main = acc_main * alpha[:, None]
        acc_band = acc_band * alpha[:, None]
        acc_exact = acc_exact * alpha[:, None]
        m_i = m_new

        # 4. values: main pairs, band pairs, sink keys
        if v_exact != 0:  # exact values: every pair reads them
            v_tile = exact_values(v_x, slots, stride_vxs, in_range, head_dim, BLOCK_V)
            acc_main += tl.dot(p, v_tile, input_precision="ieee")
        else:
            weights = p
            if band_v_mode > 0:
                weights = tl.where(in_band, 0.0, weights)
            if sink_values != 0:
                weights = tl.where(is_sink[None, :], 0.0, weights)
            v_norms_tile = load_norms(v_norms, slots, v_width, in_range, v_norm_bytes)
            v_tile = code_values(
                v_codes, slots, stride_vcs, in_range, v_bits, v_code_bytes, v_centroids_ptr,
                v_dim, v_norms_tile, BLOCK_V,
            )  # fmt: skip
            acc_main += tl.dot(weights, v_tile, input_precision="ieee")
            if tile_band & (band_v_mode > 0):
                band_slots = keys % b_cap
                band_keys = in_range & (keys >= band_lo)
                band_weights = tl.where(in_band, p, 0.0)
                if band_v_mode == 2:
                    bv_norms_tile = load_norms(
                        bv_norms, band_slots, bv_width, band_keys, bv_norm_bytes
                    )
                    bv_tile = code_values(
                        bv_codes, band_slots, stride_bvcs, band_keys, bv_bits, bv_code_bytes,
                        bv_centroids_ptr, bv_dim, bv_norms_tile, BLOCK_V,
                    )  # fmt: skip
                    acc_band += tl.dot(band_weights, bv_tile, input_precision="ieee")
                else:
                    bv_tile = exact_values(
                        bv_x, band_slots, stride_bvxs, band_keys, head_dim, BLOCK_V
                    )
                    acc_exact += tl.dot(band_weights, bv_tile, input_precision="ieee")
            if tile_sink & (sink_values != 0):
                sink_tile = exact_values(
                    sink_v, keys, stride_ss, in_range & is_sink, head_dim, BLOCK_V
                )
                sink_weights = tl.where(is_sink[None, :], p, 0.0)
                acc_exact += tl.dot(sink_weights, sink_tile, input_precision="ieee")

    out_rows = q_rows * n_splits + pid_split
    tl.store(part_m_ptr + out_rows, m_i, mask=row_mask)
    tl.store(part_l_ptr + out_rows, l_i, mask=row_mask)
    acc_ptrs = part_acc_ptr + out_rows[:, None] * (3 * BLOCK_V) + vcols[None, :]
    tl.store(acc_ptrs, acc_main, mask=row_mask[:, None])
    tl.store(acc_ptrs + BLOCK_V, acc_band, mask=row_mask[:, None])
    tl.store(acc_ptrs + 2 * BLOCK_V, acc_exact, mask=row_mask[:, None])


@triton.jit
def reduce_kernel(
    part_m_ptr,  # fp32 [rows, n_splits]
    part_l_ptr,  # fp32 [rows, n_splits]
    part_acc_ptr,  # fp32 [rows, n_splits, width]
    out_ptr,  # fp32 [rows, width]
    n_splits,
    width,
    BLOCK: tl.constexpr,
):
    """Merge the splits of one row, BLOCK columns per program: out = sum_s w_s acc_s /
    sum_s w_s l_s with w_s = e^(m_s - M); zeros for a row that saw no key."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < width

    m_max = tl.load(part_m_ptr + row * n_splits)
    for s in range(1, n_splits):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + row * n_splits + s))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)

    total = 0.0
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, n_splits):
        weight = tl.exp(tl.load(part_m_ptr + row * n_splits + s) - m_safe)
        total += weight * tl.load(part_l_ptr + row * n_splits + s)
        part = tl.load(part_acc_ptr + (row * n_splits + s) * width + cols, mask=col_mask, other=0.0)
        acc += weight * part
    out = tl.where(total > 0.0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(out_ptr + row * width + cols, out, mask=col_mask)
