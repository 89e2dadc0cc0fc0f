"""Triton kernel: attention scores straight from bit-packed TurboQuant / QJL keys.

For a key stored as codes (b bits per rotated coordinate), its norm, and for "prod" keys m QJL
sign bits and a residual norm, the score of a query q is

    scale * ( ||k|| * <R q, c[codes]>  +  ||r|| * gamma/m * <S R q, signs> ).

R q and S R q are computed once per call in torch (the query side is tiny); this kernel streams
the keys and never writes a decompressed key anywhere.

Bytes read per key, head_dim d = 128 (rotated dim D = 128, m = 128 signs, fp16 norms):

    fp16 key (SDPA)                     2 * 128            = 256 bytes
    one byte per code                   128 + 2            = 130 bytes
    packed b-bit codes + norm           128 * b / 8 + 2    =  50 bytes at b = 3
    packed (b-1)-bit codes + QJL        128 * (b-1) / 8 + 2 + 128 / 8 + 2
                                                           =  52 bytes at b = 3

so a memory-bound score pass over 3-bit keys reads about 5x fewer bytes than over fp16 keys
(the query side and the centroids are O(1)). It also writes 4 bytes per key and query row: 16
bytes per key at GQA 4 in decode, a third of what it reads; that is why decoding uses
:mod:`rqlib.kernels.triton_attention`, which never writes the scores out.

Work decomposition: one program per (batch, kv head, block of BLOCK_ROWS = 16 query rows,
block of BLOCK_S = 32 keys) (sizes in :mod:`rqlib.kernels.limits`).
The rows of a program are the query heads of one GQA group times the query positions (head h
reads kv head h // group), so a key tile is decoded once for the whole group. Both dot
products are ``tl.dot`` of the 16 rows against the decoded key tile, CHUNK = 32 coordinates at a
time, in IEEE fp32 (``input_precision="ieee"``: the tests demand 1e-5 relative error, which
TF32's 10-bit mantissa would not meet). A trellis code (compile-time ``trellis_state_bits``
and ``trellis_tail_biting``) reads its levels at the shift registers of its symbols
(``triton_common.trellis_states``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rqlib.kernels.triton_common import code_scores, sign_scores


@triton.jit
def fused_scores_kernel(
    q_rot_ptr,  # fp32 [batch, q_heads, q_len, D], contiguous
    q_sketch_ptr,  # fp32 [batch, q_heads, q_len, m], contiguous (unused when m == 0)
    codes_ptr,  # uint8 [batch, kv_heads, kv_len, code_bytes], last dim contiguous
    norms_ptr,  # fp16 [batch, kv_heads, kv_len]
    signs_ptr,  # uint8 [batch, kv_heads, kv_len, sign_bytes]
    rnorms_ptr,  # fp16 [batch, kv_heads, kv_len]
    centroids_ptr,  # fp32 [2**bits], or a trellis's 2**L levels
    out_ptr,  # fp32 [batch, q_heads, q_len, kv_len], contiguous
    kv_heads,
    group,
    q_len,
    kv_len,
    rotated_dim,  # D: number of coded coordinates (0 when the keys have no codes)
    bits,
    code_bytes,
    qjl_dim,  # m: number of sign bits (0 when the keys have no QJL term)
    sign_bytes,
    qjl_scale,  # gamma / m
    scale,
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
    BLOCK_ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
    trellis_state_bits: tl.constexpr,
    trellis_tail_biting: tl.constexpr,
):
    """Write scores for one (batch*kv head, row block, key block) tile; see the module doc."""
    pid_bh = tl.program_id(0)
    pid_rows = tl.program_id(1)
    pid_keys = tl.program_id(2)
    b = pid_bh // kv_heads
    kvh = pid_bh % kv_heads

    rows = pid_rows * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # row = g * q_len + t
    row_mask = rows < group * q_len
    keys = pid_keys * BLOCK_S + tl.arange(0, BLOCK_S)
    key_mask = keys < kv_len

    # Query rows of this kv head are contiguous: head kvh*group + g, position t.
    first_row = (b * kv_heads + kvh).to(tl.int64) * group * q_len
    q_rows = first_row + rows

    # MSE term <R q, c[codes]> and QJL term <S R q, signs>, CHUNK coordinates at a time.
    code_base = codes_ptr + b.to(tl.int64) * stride_cb + kvh * stride_ch
    mse = code_scores(
        q_rot_ptr, q_rows, row_mask, rotated_dim, code_base, keys, stride_cs, key_mask, bits,
        code_bytes, centroids_ptr, BLOCK_ROWS, BLOCK_S, CHUNK,
        trellis_state_bits=trellis_state_bits, trellis_tail_biting=trellis_tail_biting,
    )  # fmt: skip
    sign_base = signs_ptr + b.to(tl.int64) * stride_sb + kvh * stride_sh
    qjl = sign_scores(
        q_sketch_ptr, q_rows, row_mask, qjl_dim, sign_base, keys, stride_ss, key_mask,
        BLOCK_ROWS, BLOCK_S, CHUNK,
    )  # fmt: skip

    norm_offsets = b.to(tl.int64) * stride_nb + kvh * stride_nh + keys.to(tl.int64) * stride_ns
    norms = tl.load(norms_ptr + norm_offsets, mask=key_mask, other=0.0)
    scores = mse * norms.to(tl.float32)[None, :]
    if qjl_dim > 0:
        r_offsets = b.to(tl.int64) * stride_rb + kvh * stride_rh + keys.to(tl.int64) * stride_rs
        rnorms = tl.load(rnorms_ptr + r_offsets, mask=key_mask, other=0.0).to(tl.float32)
        scores += qjl * (rnorms * qjl_scale)[None, :]
    scores = scores * scale

    out = out_ptr + q_rows[:, None] * kv_len + keys[None, :]
    tl.store(out, scores, mask=row_mask[:, None] & key_mask[None, :])
