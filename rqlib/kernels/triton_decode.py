"""Triton kernels: one decode step of attention over a compressed KV cache (partition + reduce).

Phase 1 (``decode_partition_kernel``): one program per (batch, kv head, partition of the
sequence). It walks its partition in tiles of BLOCK_S = 16 keys, computes the scores of all
query heads of the GQA group (padded to 16 rows) straight from the packed keys as in
:mod:`rqlib.kernels.triton_scores`, replaces them by exact scores where the token is one of the
full-precision sink or recent tokens, and runs an online softmax: running max m, running sum l,
running P.V accumulator. Values are either full precision ([S, d] rows) or MSE-compressed; for
compressed values the accumulator is sum_s p_s * ||v_s|| * c[codes_s] in the value quantizer's
rotated space, and the rotation back (R^T) happens once, after the reduce. Each partition writes
(m, l, acc) for its rows.

Phase 2 (``decode_reduce_kernel``): one program per (batch, query head) merges the partitions:
M = max_p m_p, out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.

Bytes read per key, d = 128, 3-bit prod keys (2-bit codes + 128 QJL bits) and fp16 norms:

    keys     128 * 2 / 8 + 2 + 128 / 8 + 2   =  52 bytes
    values   fp16: 256 bytes   |   4-bit MSE: 128 * 4 / 8 + 2 = 66 bytes
    total    fp16 K+V (SDPA) 512 bytes  ->  3-bit K + 4-bit V 118 bytes (4.3x fewer)

plus, per partition and query head, (2 + d) floats of partial results written and read back
once (for 32k keys and 512-key partitions: 64 partitions, about 0.5% of the key bytes).

Causal and sliding-window limits: the decode query sits at position S-1 and sees keys at
positions >= lo = max(0, S - window) (all keys without a window). Partitions tile [lo, S), so
no partition is empty and every tile holds at least one visible key.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rqlib.kernels.triton_common import load_codes, load_signs


@triton.jit
def decode_partition_kernel(
    q_rot_ptr,  # fp32 [batch, q_heads, D]
    q_sketch_ptr,  # fp32 [batch, q_heads, m]
    q_raw_ptr,  # fp32 [batch, q_heads, d] (for exact keys)
    codes_ptr,
    norms_ptr,
    signs_ptr,
    rnorms_ptr,
    centroids_ptr,
    sink_k_ptr,  # fp32 [batch, kv_heads, n_sink, d], contiguous
    sink_v_ptr,  # fp32 [batch, kv_heads, n_sink, d], contiguous (compressed values only)
    recent_k_ptr,  # fp32 [batch, kv_heads, n_recent, d], contiguous
    recent_v_ptr,  # fp32 [batch, kv_heads, n_recent, d], contiguous (compressed values only)
    v_ptr,  # full-precision values [batch, kv_heads, S, d], or packed value codes
    v_norms_ptr,  # fp16 value norms [batch, kv_heads, S] (compressed values only)
    v_centroids_ptr,  # fp32 value centroids (compressed values only)
    part_m_ptr,  # fp32 [batch, q_heads, n_parts]
    part_l_ptr,  # fp32 [batch, q_heads, n_parts]
    part_acc_ptr,  # fp32 [batch, q_heads, n_parts, v_width]
    part_exact_ptr,  # fp32 [batch, q_heads, n_parts, d] (compressed values only)
    kv_heads,
    group,
    kv_len,
    lo,  # first visible key (sliding window)
    partition,  # keys per partition, a multiple of BLOCK_S
    n_parts,
    n_sink,
    n_recent,
    head_dim,
    rotated_dim,
    bits,
    code_bytes,
    qjl_dim,
    sign_bytes,
    qjl_scale,
    scale,
    v_width,  # d for full-precision values, the value rotated dim for compressed values
    v_bits,
    v_code_bytes,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_nb,
    stride_nh,
    stride_ns,
    stride_sb,
    stride_sh,
    stride_ss,
    stride_rb,
    stride_rh,
    stride_rs,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vnb,
    stride_vnh,
    stride_vns,
    V_COMPRESSED: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Online softmax over one partition of the keys for one GQA group; see the module doc."""
    pid_bh = tl.program_id(0)
    pid_part = tl.program_id(1)
    b = pid_bh // kv_heads
    kvh = pid_bh % kv_heads
    bh = b.to(tl.int64) * kv_heads + kvh

    rows = tl.arange(0, BLOCK_ROWS)  # query head kvh*group + row
    row_mask = rows < group
    q_rows = bh * group + rows  # index into [batch * q_heads]
    cols = tl.arange(0, CHUNK)
    vcols = tl.arange(0, BLOCK_V)

    code_base = codes_ptr + b.to(tl.int64) * stride_cb + kvh * stride_ch
    norm_base = norms_ptr + b.to(tl.int64) * stride_nb + kvh * stride_nh
    sign_base = signs_ptr + b.to(tl.int64) * stride_sb + kvh * stride_sh
    rnorm_base = rnorms_ptr + b.to(tl.int64) * stride_rb + kvh * stride_rh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh
    vnorm_base = v_norms_ptr + b.to(tl.int64) * stride_vnb + kvh * stride_vnh
    recent_start = kv_len - n_recent

    m_i = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_V), dtype=tl.float32)
    acc_exact = tl.zeros((BLOCK_ROWS, BLOCK_V), dtype=tl.float32)

    start = lo + pid_part * partition
    end = tl.minimum(start + partition, kv_len)
    for tile in range(start, end, BLOCK_S):
        keys = tile + tl.arange(0, BLOCK_S)
        visible = keys < end
        exact = (keys < n_sink) | (keys >= recent_start)
        compressed = visible & ~exact
        keys64 = keys.to(tl.int64)

        # Scores from the packed keys (MSE term + QJL term), as in triton_scores.
        mse = tl.zeros((BLOCK_ROWS, BLOCK_S), dtype=tl.float32)
        for c0 in range(0, rotated_dim, CHUNK):
            c = c0 + cols
            c_mask = c < rotated_dim
            q_tile = tl.load(
                q_rot_ptr + q_rows[:, None] * rotated_dim + c[None, :],
                mask=row_mask[:, None] & c_mask[None, :],
                other=0.0,
            )
            k_mask = compressed[:, None] & c_mask[None, :]
            codes = load_codes(code_base + keys64[:, None] * stride_cs, c, k_mask, bits, code_bytes)
            k_tile = tl.load(centroids_ptr + codes, mask=k_mask, other=0.0)
            mse += tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
        norms = tl.load(norm_base + keys64 * stride_ns, mask=compressed, other=0.0)
        scores = mse * norms.to(tl.float32)[None, :]

        qjl = tl.zeros((BLOCK_ROWS, BLOCK_S), dtype=tl.float32)
        for m0 in range(0, qjl_dim, CHUNK):
            m = m0 + cols
            m_mask = m < qjl_dim
            s_tile = tl.load(
                q_sketch_ptr + q_rows[:, None] * qjl_dim + m[None, :],
                mask=row_mask[:, None] & m_mask[None, :],
                other=0.0,
            )
            signs = load_signs(
                sign_base + keys64[:, None] * stride_ss, m, compressed[:, None] & m_mask[None, :]
            )
            qjl += tl.dot(s_tile, tl.trans(signs), input_precision="ieee")
        if qjl_dim > 0:
            rnorms = tl.load(rnorm_base + keys64 * stride_rs, mask=compressed, other=0.0)
            scores += qjl * (rnorms.to(tl.float32) * qjl_scale)[None, :]

        # Exact scores for sink / recent tokens, only in tiles that hold some.
        tile_has_exact = (tile < n_sink) | (tile + BLOCK_S > recent_start)
        sink_rows = (bh * n_sink + keys64)[:, None] * head_dim
        recent_rows = (bh * n_recent + (keys64 - recent_start))[:, None] * head_dim
        is_sink = visible & (keys < n_sink)
        is_recent = visible & (keys >= recent_start) & ~(keys < n_sink)
        if tile_has_exact:
            for d0 in range(0, head_dim, CHUNK):
                d = d0 + cols
                d_mask = d < head_dim
                q_tile = tl.load(
                    q_raw_ptr + q_rows[:, None] * head_dim + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :],
                    other=0.0,
                )
                k_sink = tl.load(
                    sink_k_ptr + sink_rows + d[None, :],
                    mask=is_sink[:, None] & d_mask[None, :],
                    other=0.0,
                )
                k_recent = tl.load(
                    recent_k_ptr + recent_rows + d[None, :],
                    mask=is_recent[:, None] & d_mask[None, :],
                    other=0.0,
                )
                scores += tl.dot(q_tile, tl.trans(k_sink + k_recent), input_precision="ieee")

        scores = tl.where(visible[None, :], scores * scale, float("-inf"))

        # Online softmax: every tile holds a visible key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc_exact = acc_exact * alpha[:, None]
        m_i = m_new

        v_mask = vcols[None, :] < v_width
        if V_COMPRESSED:
            vk_mask = compressed[:, None] & v_mask
            v_codes = load_codes(
                v_base + keys64[:, None] * stride_vs, vcols, vk_mask, v_bits, v_code_bytes
            )
            v_norms = tl.load(vnorm_base + keys64 * stride_vns, mask=compressed, other=0.0)
            v_tile = tl.load(v_centroids_ptr + v_codes, mask=vk_mask, other=0.0)
            v_tile = v_tile * v_norms.to(tl.float32)[:, None]
            acc += tl.dot(p, v_tile, input_precision="ieee")
            if tile_has_exact:
                e_mask = vcols[None, :] < head_dim
                v_sink = tl.load(
                    sink_v_ptr + sink_rows + vcols[None, :],
                    mask=is_sink[:, None] & e_mask,
                    other=0.0,
                )
                v_recent = tl.load(
                    recent_v_ptr + recent_rows + vcols[None, :],
                    mask=is_recent[:, None] & e_mask,
                    other=0.0,
                )
                acc_exact += tl.dot(p, v_sink + v_recent, input_precision="ieee")
        else:
            v_tile = tl.load(
                v_base + keys64[:, None] * stride_vs + vcols[None, :],
                mask=visible[:, None] & v_mask,
                other=0.0,
            )
            acc += tl.dot(p, v_tile.to(tl.float32), input_precision="ieee")

    out_rows = q_rows * n_parts + pid_part
    tl.store(part_m_ptr + out_rows, m_i, mask=row_mask)
    tl.store(part_l_ptr + out_rows, l_i, mask=row_mask)
    tl.store(
        part_acc_ptr + out_rows[:, None] * v_width + vcols[None, :],
        acc,
        mask=row_mask[:, None] & (vcols[None, :] < v_width),
    )
    if V_COMPRESSED:
        tl.store(
            part_exact_ptr + out_rows[:, None] * head_dim + vcols[None, :],
            acc_exact,
            mask=row_mask[:, None] & (vcols[None, :] < head_dim),
        )


@triton.jit
def decode_reduce_kernel(
    part_m_ptr,  # fp32 [rows, n_parts]
    part_l_ptr,  # fp32 [rows, n_parts]
    part_acc_ptr,  # fp32 [rows, n_parts, width]
    out_ptr,  # fp32 [rows, width]
    n_parts,
    width,
    BLOCK_V: tl.constexpr,
):
    """Merge the partitions of one query row: out = sum_p w_p acc_p / sum_p w_p l_p."""
    row = tl.program_id(0).to(tl.int64)
    vcols = tl.arange(0, BLOCK_V)
    v_mask = vcols < width

    m_max = tl.load(part_m_ptr + row * n_parts)
    for p in range(1, n_parts):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + row * n_parts + p))

    total = 0.0
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for p in range(0, n_parts):
        weight = tl.exp(tl.load(part_m_ptr + row * n_parts + p) - m_max)
        total += weight * tl.load(part_l_ptr + row * n_parts + p)
        part = tl.load(part_acc_ptr + (row * n_parts + p) * width + vcols, mask=v_mask, other=0.0)
        acc += weight * part
    tl.store(out_ptr + row * width + vcols, acc / total, mask=v_mask)
