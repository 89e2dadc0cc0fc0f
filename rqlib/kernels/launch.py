"""Host side of the Triton kernels: prepare the arguments, allocate the outputs, launch.

Inputs are validated by the public functions in :mod:`rqlib.kernels` before they get here.
Outputs and scratch buffers come from :func:`empty`; the tests set ``POISON_BUFFERS`` so that
every buffer starts as NaN (or 0xFF bytes) and an element a kernel forgets to write fails.
"""

from __future__ import annotations

import math

import torch

from rqlib.core.packing import packed_size
from rqlib.core.quantizers import CompressedVectors
from rqlib.kernels import limits as geo
from rqlib.kernels.triton_decode import decode_partition_kernel, decode_reduce_kernel
from rqlib.kernels.triton_quantize import quantize_kernel
from rqlib.kernels.triton_scores import fused_scores_kernel

POISON_BUFFERS = False  # tests: fill every output / scratch buffer with garbage before launch


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``, or a buffer full of NaN / 0xFF when ``POISON_BUFFERS`` is set."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    if POISON_BUFFERS:
        buffer.fill_(float("nan") if dtype.is_floating_point else 255)
    return buffer


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels index the last axis with stride 1; other strides are passed explicitly."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _key_arguments(keys):
    """Pointers, sizes and strides of a CompressedVectors [B, KV, S], in kernel order."""
    qz = keys.quantizer
    norms = keys.norms
    if qz.mse_bits > 0:
        codes = _last_dim_contiguous(keys.codes)
    else:  # signs only: a 1-byte stand-in with the key strides, never read
        codes = torch.zeros(1, dtype=torch.uint8, device=norms.device).expand(*keys.shape, 1)
    has_qjl = qz.has_qjl
    signs = _last_dim_contiguous(keys.qjl_signs) if has_qjl else codes
    rnorms = keys.residual_norms if has_qjl else norms
    centroids = qz.centroids.to(device=norms.device, dtype=torch.float32).contiguous()
    if centroids.numel() == 0:
        centroids = torch.zeros(1, dtype=torch.float32, device=norms.device)
    tensors = (codes, norms, signs, rnorms, centroids)
    sizes = (
        qz.rotated_dim if qz.mse_bits > 0 else 0,
        max(qz.mse_bits, 1),
        codes.shape[-1],
        qz.qjl_dim if has_qjl else 0,
        signs.shape[-1],
        float(qz.qjl_scale) if has_qjl else 0.0,
    )
    strides = (*codes.stride()[:3], *norms.stride(), *signs.stride()[:3], *rnorms.stride())
    return tensors, sizes, strides


def _query_sides(q: torch.Tensor, quantizer) -> tuple[torch.Tensor, torch.Tensor]:
    """R q and S R q in fp32, contiguous (S R q is a 1-element dummy without QJL)."""
    q_rot = quantizer.rotate_query(q).float().contiguous()
    if quantizer.has_qjl:
        q_sketch = quantizer.sketch_query(q).float().contiguous()
    else:
        q_sketch = q_rot.new_zeros(1)
    return q_rot, q_sketch


def fused_scores(q: torch.Tensor, keys, scale: float, out: torch.Tensor | None) -> torch.Tensor:
    """Launch :func:`fused_scores_kernel`; ``q`` [B, QH, Lq, d], keys [B, KV, S]."""
    batch, q_heads, q_len, _ = q.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    q_rot, q_sketch = _query_sides(q, keys.quantizer)
    if out is None:
        out = empty((batch, q_heads, q_len, kv_len), torch.float32, q.device)
    tensors, sizes, strides = _key_arguments(keys)
    grid = (
        batch * kv_heads,
        math.ceil(group * q_len / geo.BLOCK_ROWS),
        math.ceil(kv_len / geo.SCORES_BLOCK_S),
    )
    fused_scores_kernel[grid](
        q_rot,
        q_sketch,
        *tensors,
        out,
        kv_heads,
        group,
        q_len,
        kv_len,
        *sizes,
        float(scale),
        *strides,
        BLOCK_ROWS=geo.BLOCK_ROWS,
        BLOCK_S=geo.SCORES_BLOCK_S,
        CHUNK=geo.CHUNK,
        num_warps=geo.NUM_WARPS,
    )
    return out


def decode_attention(
    q: torch.Tensor,
    keys,
    values,
    *,
    scale: float,
    sink_keys: torch.Tensor | None,
    sink_values: torch.Tensor | None,
    recent_keys: torch.Tensor | None,
    recent_values: torch.Tensor | None,
    window: int | None,
    partition_size: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Launch the partition and reduce kernels; returns float32 [B, QH, 1, d]."""
    batch, q_heads, _, head_dim = q.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    device = q.device
    lo = 0 if window is None else max(0, kv_len - window)
    n_parts = math.ceil((kv_len - lo) / partition_size)

    q_rot, q_sketch = _query_sides(q, keys.quantizer)
    q_raw = q.float().contiguous()
    tensors, sizes, strides = _key_arguments(keys)

    def exact(t: torch.Tensor | None) -> torch.Tensor:
        return q_raw.new_zeros(1) if t is None else t.float().contiguous()

    n_sink = 0 if sink_keys is None else sink_keys.shape[2]
    n_recent = 0 if recent_keys is None else recent_keys.shape[2]
    compressed_values = not isinstance(values, torch.Tensor)
    if compressed_values:
        vq = values.quantizer
        v_data = _last_dim_contiguous(values.codes)
        v_norms = values.norms
        v_centroids = vq.centroids.to(device=device, dtype=torch.float32).contiguous()
        v_width, v_bits, v_code_bytes = vq.rotated_dim, vq.mse_bits, v_data.shape[-1]
        v_strides = (*v_data.stride()[:3], *v_norms.stride())
        block_v = geo.value_block(max(v_width, head_dim))
    else:
        v_data = _last_dim_contiguous(values)
        v_norms = torch.zeros(1, dtype=torch.float16, device=device)  # unused stand-ins
        v_centroids = q_raw.new_zeros(1)
        v_width, v_bits, v_code_bytes = head_dim, 1, 0
        v_strides = (*v_data.stride()[:3], 0, 0, 0)
        block_v = geo.value_block(head_dim)

    rows = batch * q_heads
    part_m = empty((rows, n_parts), torch.float32, device)
    part_l = empty((rows, n_parts), torch.float32, device)
    part_acc = empty((rows, n_parts, v_width), torch.float32, device)
    if compressed_values:
        part_exact = empty((rows, n_parts, head_dim), torch.float32, device)
    else:
        part_exact = part_m  # unused: full-precision values have a single accumulator
    decode_partition_kernel[(batch * kv_heads, n_parts)](
        q_rot,
        q_sketch,
        q_raw,
        *tensors,
        exact(sink_keys),
        exact(sink_values),
        exact(recent_keys),
        exact(recent_values),
        v_data,
        v_norms,
        v_centroids,
        part_m,
        part_l,
        part_acc,
        part_exact,
        kv_heads,
        group,
        kv_len,
        lo,
        partition_size,
        n_parts,
        n_sink,
        n_recent,
        head_dim,
        *sizes,
        float(scale),
        v_width,
        v_bits,
        v_code_bytes,
        *strides,
        *v_strides,
        V_COMPRESSED=compressed_values,
        BLOCK_V=block_v,
        BLOCK_ROWS=geo.BLOCK_ROWS,
        BLOCK_S=geo.DECODE_BLOCK_S,
        CHUNK=geo.CHUNK,
        num_warps=geo.NUM_WARPS,
    )
    result = empty((rows, v_width), torch.float32, device)
    decode_reduce_kernel[(rows,)](
        part_m,
        part_l,
        part_acc,
        result,
        n_parts,
        v_width,
        BLOCK_V=geo.value_block(v_width),
        num_warps=geo.REDUCE_NUM_WARPS,
    )
    if compressed_values:
        exact_part = empty((rows, head_dim), torch.float32, device)
        decode_reduce_kernel[(rows,)](
            part_m,
            part_l,
            part_exact,
            exact_part,
            n_parts,
            head_dim,
            BLOCK_V=geo.value_block(head_dim),
            num_warps=geo.REDUCE_NUM_WARPS,
        )
        result = values.quantizer.rotation.inverse(result) + exact_part
    result = result.reshape(batch, q_heads, 1, head_dim)
    if out is not None:
        out.copy_(result)
        return out
    return result


def quantize(quantizer, x: torch.Tensor):
    """Quantize ``x [..., d]``: torch normalizes and rotates, the kernel does the rest."""
    norms, y = quantizer.rotated_unit(x)
    batch_shape = x.shape[:-1]
    y = y.reshape(-1, quantizer.rotated_dim).float().contiguous()
    n = y.shape[0]
    device = x.device
    mse_bits = quantizer.mse_bits
    code_bytes = packed_size(quantizer.rotated_dim, mse_bits) if mse_bits else 0
    codes = empty((n, max(code_bytes, 1)), torch.uint8, device)  # no 0-size launch arguments
    has_qjl = quantizer.has_qjl
    m = quantizer.qjl_dim if has_qjl else 0
    sign_bytes = packed_size(m, 1) if has_qjl else 0
    signs = empty((n, max(sign_bytes, 1)), torch.uint8, device)
    residual = empty((n,), torch.float32, device)
    f32 = dict(device=device, dtype=torch.float32)
    boundaries = quantizer.boundaries.to(**f32).contiguous()
    centroids = quantizer.centroids.to(**f32).contiguous()
    if centroids.numel() == 0:
        boundaries = centroids = torch.zeros(1, **f32)
    sketch = quantizer.sketch.to(**f32).contiguous() if has_qjl else torch.zeros(1, **f32)
    quantize_kernel[(math.ceil(n / geo.BLOCK_N),)](
        y,
        boundaries,
        centroids,
        sketch,
        codes,
        signs,
        residual,
        n,
        quantizer.rotated_dim,
        mse_bits,
        code_bytes,
        m,
        sign_bytes,
        BLOCK_N=geo.BLOCK_N,
        CHUNK=geo.CHUNK,
        num_warps=geo.NUM_WARPS,
    )
    residual_norms = None
    if has_qjl:
        residual_norms = quantizer.store_norms(
            norms * residual.reshape(batch_shape), "residual norm"
        )
    return CompressedVectors(
        codes[:, :code_bytes].reshape(*batch_shape, code_bytes),
        quantizer.store_norms(norms),
        signs[:, :sign_bytes].reshape(*batch_shape, sign_bytes) if has_qjl else None,
        residual_norms,
        quantizer,
    )
