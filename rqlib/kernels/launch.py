"""Host side of the Triton kernels: prepare the arguments, allocate the outputs, launch.

Inputs are validated by the public functions in :mod:`rqlib.kernels` before they get here.
Outputs and scratch buffers come from :func:`empty`; the tests set ``POISON_BUFFERS`` so that
every buffer starts as NaN (or 0xFF bytes) and an element a kernel forgets to write fails.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from rqlib.core.packing import packed_size
from rqlib.core.quantizers import CompressedVectors
from rqlib.kernels import limits as geo
from rqlib.kernels import numerics, store
from rqlib.kernels.triton_attention import attention_kernel, reduce_kernel
from rqlib.kernels.triton_quantize import quantize_kernel
from rqlib.kernels.triton_scores import fused_scores_kernel
from rqlib.kernels.triton_trellis import trellis_encode_kernel

POISON_BUFFERS = False  # tests: fill every output / scratch buffer with garbage before launch
#: Buffers made once and reused by every launch: one-element stand-ins for pointers a kernel
#: never reads, per (device, dtype), and a decode step's partial results, per (device, shape)
#: (:func:`decode_partials`).
_DUMMIES: dict = {}
_PARTIALS: dict = {}


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
    centroids = numerics.code_levels(qz).to(norms.device).contiguous()
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
        **geo.trellis_constexprs(keys.quantizer),
        num_warps=geo.NUM_WARPS,
    )
    return out


def _dummy(device, dtype=torch.uint8) -> torch.Tensor:
    """A one-element stand-in for a pointer the kernel never reads, made once per device and
    dtype."""
    key = (torch.device(device), dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(1, dtype=dtype, device=device)
    return _DUMMIES[key]


def stream_arguments(prefix: str, stream, device, exact_dtype, table=None) -> dict:
    """The attention kernel's run-time arguments of one stream, by keyword: ``<prefix>_codes_ptr``,
    ``_norms_ptr``, ``_exact_ptr``, the codebook (``_table_ptr`` given as ``table`` for keys,
    ``_centroids_ptr`` for values), the ring's capacity ``_cap`` and the strides of its buffers
    (``_stride_cb/ch/cs`` codes, ``_stride_nb/nh`` norms, ``_stride_xb/xh/xs`` exact vectors);
    for the main keys (``prefix`` ``"k"``) also their QJL signs and residual norms. ``None`` (no
    such stream) gives stand-ins the kernel never reads. The stream's format is compile-time
    (:func:`rqlib.kernels.limits.attention_formats`)."""
    u8, exact_dummy = _dummy(device), _dummy(device, exact_dtype)
    codebook = "_table_ptr" if prefix in ("k", "bk") else "_centroids_ptr"
    args = {
        f"{prefix}_codes_ptr": u8,
        f"{prefix}_norms_ptr": u8,
        f"{prefix}_exact_ptr": exact_dummy,
        f"{prefix}{codebook}": table
        if table is not None
        else _dummy(device, numerics.CODEBOOK_DTYPE),
        f"{prefix}_cap": 1,
        **{
            f"{prefix}_stride_{axis}": 0
            for axis in ("cb", "ch", "cs", "nb", "nh", "xb", "xh", "xs")
        },
    }
    if prefix == "k":
        args.update(k_signs_ptr=u8, k_rnorms_ptr=u8, k_sketch_dim=0, k_qjl_scale=0.0)
        args.update({f"k_stride_{axis}": 0 for axis in ("sb", "sh", "ss", "rb", "rh")})
    if stream is None:
        return args
    if stream.is_exact:
        ring = stream.exact
        x = ring.buffers["exact"]
        args[f"{prefix}_exact_ptr"] = x
        args[f"{prefix}_cap"] = ring.capacity
        args.update(zip((f"{prefix}_stride_{a}" for a in ("xb", "xh", "xs")), x.stride()[:3]))
        return args
    part = stream.parts[0]
    ring, qz = part.ring, part.quantizer
    buffers = ring.buffers
    norms = buffers["norms"]
    args[f"{prefix}_norms_ptr"] = norms
    args[f"{prefix}_cap"] = ring.capacity
    args.update(zip((f"{prefix}_stride_{a}" for a in ("nb", "nh")), norms.stride()[:2]))
    if "codes" in buffers:
        codes = buffers["codes"]
        args[f"{prefix}_codes_ptr"] = codes
        args.update(zip((f"{prefix}_stride_{a}" for a in ("cb", "ch", "cs")), codes.stride()[:3]))
    if table is None:
        args[f"{prefix}{codebook}"] = numerics.kernel_centroids(qz, device)
    if prefix == "k" and qz.has_qjl:
        signs, rnorms = buffers["signs"], buffers["rnorms"]
        args.update(k_signs_ptr=signs, k_rnorms_ptr=rnorms)
        args.update(k_sketch_dim=qz.qjl_dim, k_qjl_scale=float(qz.qjl_scale))
        args.update(zip(("k_stride_sb", "k_stride_sh", "k_stride_ss"), signs.stride()[:3]))
        args.update(zip(("k_stride_rb", "k_stride_rh"), rnorms.stride()[:2]))
    return args


def _exact_source(prefix: str, args: dict) -> dict:
    """The exact values of ``args`` (a :func:`stream_arguments` of exact values) renamed to
    ``prefix``: what the band and the sink read where the layer keeps no values of their own."""
    keys = ("exact_ptr", "cap", "stride_xb", "stride_xh", "stride_xs")
    source = (
        args["v_exact_ptr"],
        args["v_cap"],
        *(args[f"v_stride_{a}"] for a in ("xb", "xh", "xs")),
    )
    return dict(zip((f"{prefix}_{key}" for key in keys), source))


def sink_arguments(state, v_args: dict, device, exact_dtype) -> dict:
    """The attention kernel's arguments of the exact sink, by keyword: its keys, and its values
    (the sink's own, or the main exact values of ``v_args`` for a layer whose values are exact:
    ``limits.check_state``), with their strides and the values' ring capacity."""
    dummy = _dummy(device, exact_dtype)
    keys = state.sink_keys if state.sink_keys is not None else dummy
    key_strides = keys.stride()[:3] if state.sink_keys is not None else (0, 0, 0)
    if state.sink_values is not None:
        values, capacity = state.sink_values, state.sink_values.shape[2]
        value_strides = state.sink_values.stride()[:3]
    elif state.n_sink:
        values, capacity = v_args["v_exact_ptr"], v_args["v_cap"]
        value_strides = tuple(v_args[f"v_stride_{axis}"] for axis in ("xb", "xh", "xs"))
    else:
        values, capacity, value_strides = dummy, 1, (0, 0, 0)
    return {
        "sink_k_ptr": keys,
        "sink_v_ptr": values,
        "sink_v_cap": capacity,
        **dict(zip(("sink_stride_kb", "sink_stride_kh", "sink_stride_ks"), key_strides)),
        **dict(zip(("sink_stride_vb", "sink_stride_vh", "sink_stride_vs"), value_strides)),
    }


def _check_tiles(stream, name: str) -> None:
    """Refuse a stream the kernel would read past: its rings must have capacities that are
    multiples of its widest key tile, and norm streams the spare bytes
    :mod:`rqlib.kernels.store` gives them (the kernel reads whole tiles of a ring without
    masks)."""
    if stream is None:
        return
    tile = geo.ATTENTION_BLOCK_S
    for ring in stream.rings:
        if ring.capacity % tile:
            raise ValueError(
                f"the {name} ring has {ring.capacity} slots; the attention kernel reads "
                f"tiles of {tile} keys and needs a multiple of {tile} "
                f"(store.round_capacity rounds to {geo.RING_GRANULE})"
            )
        for buffer in ("norms", "rnorms"):
            if buffer in ring.buffers:
                need = store.norm_stream_bytes(ring.capacity, ring.norm_width)
                if ring.buffers[buffer].shape[-1] < need:
                    raise ValueError(
                        f"the {name} ring's {buffer} stream has "
                        f"{ring.buffers[buffer].shape[-1]} bytes; the kernel reads {need} "
                        f"({ring.capacity} fields of {ring.norm_width} bits and "
                        f"{store.NORM_TAIL} spare bytes)"
                    )


def _exact_dtype(state, default: torch.dtype) -> torch.dtype:
    """The one dtype of a layer's exact vectors (sink, exact band, exact keys or values)."""
    dtypes = {t.dtype for t in (state.sink_keys, state.sink_values) if t is not None}
    for stream in (state.keys, state.values, state.band_keys, state.band_values):
        if stream is not None and stream.is_exact:
            dtypes.add(stream.exact.dtype)
    if len(dtypes) > 1:
        raise ValueError(
            f"a layer's exact vectors must share one dtype, got {sorted(map(str, dtypes))}"
        )
    return dtypes.pop() if dtypes else default


def _mask_arguments(mask, device):
    """(tensor, has_mask, causal, window, length, offset, strides b/t/k) for the kernel."""
    if mask.__class__.__name__ == "CausalMask":
        window = mask.window or 0
        if mask.padding is None:
            return _dummy(device), 0, 1, window, 0, 0, (0, 0, 0)
        padding = mask.padding.view(torch.uint8)
        sb, sk = padding.stride()
        return padding, 1, 1, window, padding.shape[-1], 0, (sb, 0, sk)
    tensor = mask.tensor.view(torch.uint8)
    sb, _, st, sk = tensor.stride()
    return tensor, 1, 0, 0, tensor.shape[-1], mask.kv_offset, (sb, st, sk)


@functools.lru_cache(maxsize=16)
def _sm_count(device_type: str, index: int | None) -> int | None:
    """Streaming multiprocessors of a CUDA device; ``None`` elsewhere (the interpreter)."""
    if device_type != "cuda":
        return None
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


class SplitPlan(NamedTuple):
    """How a launch cuts its keys: its ``grid``, ``n_splits`` splits of ``partition`` keys from
    position ``split_lo`` (all on whole key tiles)."""

    grid: tuple[int, int, int]
    n_splits: int
    partition: int
    split_lo: int


def split_plan(span: int, programs: int, device, partition: int | None) -> tuple[int, int]:
    """``(splits, partition)`` of a decode step over ``span`` keys for ``programs`` = batch x KV
    heads groups of rows: at most ``partition`` keys a split when given (a multiple of the key
    tile; the tests use it to force many splits), else the fixed number of splits of
    :func:`rqlib.kernels.limits.decode_splits` for the device, which does not change as the
    context grows."""
    span = max(1, span)
    block = geo.ATTENTION_BLOCK_S
    if partition is not None:
        return geo.even_partition(span, math.ceil(span / partition), block)
    splits = geo.decode_splits(programs, _sm_count(device.type, device.index))
    return splits, geo.split_partition(span, splits, block)


def _zeros(device, n: int) -> torch.Tensor:
    """``n`` float32 zeros on ``device``, made once per size and never written: a ``<q, mu>``
    of a stream without a mean, read by the kernel without a fill at every step."""
    key = (torch.device(device), "zeros", n)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(n, dtype=torch.float32, device=device)
    return _DUMMIES[key]


def decode_partials(device, total_rows: int, n_splits: int, acc_width: int):
    """``m``, ``l`` and the accumulators of ``n_splits`` splits of ``total_rows`` rows, which
    the reduce merges: made once per device and shape and reused by every launch (a decode
    step's splits do not change with the context, :func:`split_plan`), so that a step
    allocates nothing. With ``POISON_BUFFERS`` they are filled with NaN before every launch."""
    key = (torch.device(device), total_rows, n_splits, acc_width)
    if key not in _PARTIALS:
        f32 = torch.float32
        _PARTIALS[key] = (
            torch.empty((total_rows, n_splits, 3), dtype=f32, device=device),
            torch.empty((total_rows, n_splits, 3), dtype=f32, device=device),
            torch.empty((total_rows, n_splits, 3, acc_width), dtype=f32, device=device),
        )
    buffers = _PARTIALS[key]
    if POISON_BUFFERS:
        for buffer in buffers:
            buffer.fill_(float("nan"))
    return buffers


def attention(
    state,
    q: torch.Tensor,
    mask,
    scale: float,
    softcap: float | None,
    partition: int | None,
) -> torch.Tensor:
    """Launch :func:`attention_kernel` and :func:`reduce_kernel`; float32 ``[B, Hq, Lq, d]``.

    The host does only work independent of the context: the query side (rotations of the
    queries, scaled into fp16's range for the tensor cores by
    :func:`rqlib.kernels.numerics.scaled_rows`, and ``<q, mu>``), views of the buffers, and
    the rotation of the accumulators back. A decode step's keys are cut into a fixed number of
    splits (:func:`split_plan`), whose partial results are allocated once
    (:func:`decode_partials`); the layer runs in the one configuration of its format
    (:func:`rqlib.kernels.limits.attention_config`)."""
    batch, q_heads, length, head_dim = q.shape
    device = q.device
    keys, values = state.keys, state.values
    kv_heads = keys.rings[0].heads
    group = q_heads // kv_heads
    n_rows = length * group
    exact_dtype = _exact_dtype(state, q.dtype)
    if state.band_keys is not None and state.band_values is not None:
        if state.band_keys.rings[0].capacity != state.band_values.rings[0].capacity:
            raise ValueError("the band's key and value rings must have the same capacity")
    if keys.rings[0].capacity != values.rings[0].capacity:
        raise ValueError("the key and value rings must have the same capacity")
    for name in ("keys", "values", "band_keys", "band_values"):
        _check_tiles(getattr(state, name), name)

    # the query side: rows ordered (batch, KV head, position, head of the group)
    rows = q.float().reshape(batch, kv_heads, group, length, head_dim).transpose(2, 3)
    rows = rows.reshape(batch, kv_heads, n_rows, head_dim)
    zeros = _dummy(device, torch.float32)
    q_main, q_main_scale, q_sketch = zeros, zeros, zeros
    mean = no_mean = _zeros(device, batch * kv_heads * n_rows)  # <q, mu>: none
    if not keys.is_exact:
        qz = keys.parts[0].quantizer
        constants = numerics.stream_constants(keys, device)
        scaled = rows if constants.scale is None else rows / constants.scale[None, :, None]
        rotated = scaled @ constants.rotation.T
        q_main, q_main_scale = numerics.scaled_rows(rotated)
        if qz.has_qjl:
            q_sketch = (rotated @ constants.sketch.T).contiguous()
        if constants.mean is not None:
            mean = (rows * constants.mean[None, :, None]).sum(-1).contiguous()
    q_band, q_band_scale, band_mean = zeros, zeros, no_mean
    band_k_mode = band_v_mode = 0
    if state.band_keys is not None:
        band_k_mode = 1 if state.band_keys.is_exact else 2
        if band_k_mode == 2:
            constants = numerics.stream_constants(state.band_keys, device)
            q_band, q_band_scale = numerics.scaled_rows(rows @ constants.rotation.T)
            if constants.mean is not None:
                band_mean = (rows * constants.mean[None, :, None]).sum(-1).contiguous()
    if state.band_values is not None:
        band_v_mode = 1 if state.band_values.is_exact else 2
    rows = rows.contiguous()

    # the streams, each described once (stream_arguments), passed to the kernel by keyword
    v_args = stream_arguments("v", values, device, exact_dtype)
    bv_args = stream_arguments("bv", state.band_values, device, exact_dtype)
    if band_k_mode > 0 and band_v_mode == 0:  # exact values (limits.check_state): the main ones
        bv_args.update(_exact_source("bv", v_args))
    mask_tensor, has_mask, causal, window, mask_len, mask_offset, mask_strides = _mask_arguments(
        mask, device
    )

    formats = geo.attention_formats(
        head_dim,
        geo.StreamFormat.of(keys),
        geo.StreamFormat.of(values),
        None if state.band_keys is None else geo.StreamFormat.of(state.band_keys),
        None if state.band_values is None else geo.StreamFormat.of(state.band_values),
    )
    v_dim = head_dim if values.is_exact else formats["v_dim"]
    bv_dim = formats["bv_dim"]
    value_width = max(head_dim, v_dim, bv_dim)
    block_v, value_blocks = geo.value_block(value_width), geo.value_blocks(value_width)
    acc_width = block_v * value_blocks
    config = geo.attention_config(acc_width, bool(formats["k_qjl"]))
    first = state.first
    if causal and window:
        first = max(first, state.start - window + 1)
    n_row_blocks = math.ceil(n_rows / geo.BLOCK_ROWS)
    total_rows = batch * kv_heads * n_rows
    split_lo = first - first % config.block_s
    span = state.end - split_lo
    if n_row_blocks == 1:  # a decode step: the keys cut into splits
        n_splits, part = split_plan(span, batch * kv_heads, device, partition)
        part_m, part_l, part_acc = decode_partials(device, total_rows, n_splits, acc_width)
    else:  # a prompt: its row blocks provide the parallelism, one split each
        n_splits, part = geo.even_partition(max(1, span), 1, config.block_s)
        part_m, part_l, part_acc = (
            empty((total_rows, n_splits, 3), torch.float32, device),
            empty((total_rows, n_splits, 3), torch.float32, device),
            empty((total_rows, n_splits, 3, acc_width), torch.float32, device),
        )
    grid = (batch * kv_heads, n_row_blocks, n_splits * value_blocks)
    k_table, bk_table = (
        _centroid_table(stream, device, config.score_codebook_dtype)
        for stream in (keys, state.band_keys)
    )
    mb, mt, mk = mask_strides
    attention_kernel[grid](
        q_raw_ptr=rows, q_main_ptr=q_main, q_main_scale_ptr=q_main_scale, q_sketch_ptr=q_sketch,
        q_band_ptr=q_band, q_band_scale_ptr=q_band_scale, mean_ptr=mean, band_mean_ptr=band_mean,
        **stream_arguments("k", keys, device, exact_dtype, k_table),
        **v_args,
        **stream_arguments("bk", state.band_keys, device, exact_dtype, bk_table),
        **bv_args,
        **sink_arguments(state, v_args, device, exact_dtype),
        mask_ptr=mask_tensor, part_m_ptr=part_m, part_l_ptr=part_l, part_acc_ptr=part_acc,
        kv_heads=kv_heads, group=group, n_rows=n_rows, start=state.start, first=first,
        end=state.end, n_splits=n_splits, partition=part, split_lo=split_lo,
        value_blocks=value_blocks, n_sink=state.n_sink, band=state.band, causal=causal,
        window=window, has_mask=has_mask, mask_len=mask_len, mask_offset=mask_offset,
        stride_mb=mb, stride_mt=mt, stride_mk=mk, scale=float(scale),
        softcap=float(softcap or 0.0),
        **formats,
        SOFTCAP=int(bool(softcap and softcap > 0)),
        BLOCK_V=block_v,
        BLOCK_ROWS=geo.BLOCK_ROWS,
        CHUNK=geo.attention_chunk(block_v),
        **config.constexprs(),
        num_warps=config.num_warps,
        maxnreg=geo.ATTENTION_MAX_REGISTERS,
    )  # fmt: skip
    reduced = empty((total_rows, 3, acc_width), torch.float32, device)
    reduce_kernel[(total_rows, 3, math.ceil(acc_width / geo.REDUCE_BLOCK))](
        part_m,
        part_l,
        part_acc,
        reduced,
        n_splits,
        acc_width,
        BLOCK=geo.REDUCE_BLOCK,
        num_warps=geo.REDUCE_NUM_WARPS,
    )
    reduced = reduced.reshape(batch, kv_heads, n_rows, 3 * acc_width)
    out = _rotate_back(values, reduced[..., :v_dim], device)
    if band_v_mode == 2:  # slot 1: the band, in its value quantizer's rotated space
        band_matrix = numerics.stream_constants(state.band_values, device).rotation
        out = out + reduced[..., acc_width : acc_width + bv_dim] @ band_matrix
    elif band_k_mode > 0:  # slot 1: the band's exact values (or the main ones)
        out = out + reduced[..., acc_width : acc_width + head_dim]
    if state.n_sink:  # slot 2: the sink, exact
        out = out + reduced[..., 2 * acc_width : 2 * acc_width + head_dim]
    out = out.reshape(batch, kv_heads, length, group, head_dim).transpose(2, 3)
    return out.reshape(batch, q_heads, length, head_dim)


def reset_plans() -> None:
    """Forget the buffers made once (stand-ins and decode partials), e.g. to free memory."""
    _DUMMIES.clear()
    _PARTIALS.clear()


def _centroid_table(stream, device, dtype: torch.dtype) -> torch.Tensor:
    """The table of centroid pairs the kernel reads for a stream of codes, the centroids
    in ``dtype`` (:func:`rqlib.kernels.numerics.kernel_table`); for ``None`` or an exact stream
    a one-element stand-in of the table's type, never read."""
    if stream is None or stream.is_exact:
        return _dummy(device, numerics.PAIR_DTYPES[dtype])
    return numerics.kernel_table(stream.parts[0].quantizer, device, dtype)


def _rotate_back(values, accumulated: torch.Tensor, device) -> torch.Tensor:
    """The main values' accumulator in the model's coordinates: ``R^T acc / a``."""
    if values.is_exact:
        return accumulated
    constants = numerics.stream_constants(values, device)
    out = accumulated @ constants.rotation
    if constants.scale is not None:
        out = out / constants.scale[None, :, None]
    return out


def quantize(quantizer, x: torch.Tensor, validate: bool = True):
    """Quantize ``x [..., d]``: torch normalizes and rotates, the kernel does the rest."""
    norms, y = quantizer.rotated_unit(x, validate)
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
            norms * residual.reshape(batch_shape), "residual norm", validate
        )
    return CompressedVectors(
        codes[:, :code_bytes].reshape(*batch_shape, code_bytes),
        quantizer.store_norms(norms, validate=validate),
        signs[:, :sign_bytes].reshape(*batch_shape, sign_bytes) if has_qjl else None,
        residual_norms,
        quantizer,
    )


def trellis_quantize(quantizer, x: torch.Tensor, validate: bool = True):
    """Quantize ``x [..., d]`` with a trellis code: torch normalizes and rotates, the Viterbi
    kernel searches (:func:`trellis_search`), torch packs (and adds the QJL signs)."""
    return quantizer.quantize(x, validate, trellis_search=trellis_search)


def trellis_search(quantizer, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symbols (uint8) and levels (float32) ``[N, D]`` of the trellis path of least squared
    error for each row of ``samples [N, D]`` (float64), one program a row, in launches whose
    back pointers fit :data:`~rqlib.kernels.limits.TRELLIS_SCRATCH_BYTES`."""
    samples = samples.contiguous()
    n, dim = samples.shape
    trellis, bits = quantizer.trellis, quantizer.mse_bits
    table, levels = numerics.trellis_tables(quantizer, samples.device)
    symbols = empty((n, dim), torch.uint8, samples.device)
    values = empty((n, dim), torch.float32, samples.device)
    row_bytes = dim << (trellis.state_bits - bits)
    rows = max(1, min(n, geo.TRELLIS_SCRATCH_BYTES // row_bytes))
    pointers = empty((rows, row_bytes), torch.uint8, samples.device)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        trellis_encode_kernel[(stop - start,)](
            samples[start:stop],
            table,
            levels,
            pointers,
            symbols[start:stop],
            values[start:stop],
            dim,
            STATE_BITS=trellis.state_bits,
            BITS=bits,
            TAIL_BITING=trellis.tail_biting,
            num_warps=geo.TRELLIS_NUM_WARPS,
        )
    return symbols, values
