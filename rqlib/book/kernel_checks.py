"""Chapter 3's kernel checks and byte counts, in the shapes the chapter shows.

The kernels are checked the way the Triton tutorials check theirs: on irregular shapes (no
length a multiple of a tile) against independent torch computations, with every output buffer
starting as NaN so that an element a kernel forgot to write shows up as an error.

:func:`scores_check` compares ``rqlib.kernels.fused_scores`` with the float64 torch reference and
with ``Quantizer.inner_product``; :func:`attention_check` compares ``rqlib.kernels.attention``
over a cache layer (packed keys and values, exact sink and recent tokens) with the float64 torch
implementation, for a prompt and for a decode step. Both return the maximum relative errors.
:func:`attention_check` compares with the reference read with the kernel's codebook (the
codebook rounded to fp16, :mod:`rqlib.kernels.numerics`), and reports how far the kernel is from
the float32 codebook's attention too. :func:`split_dot_check` measures the kernel's tensor-core
products (``split_dot``) against float64, next to a single fp16 product, and
:func:`centroid_pairs_check` the centroids the attention kernel reads through a table of
centroid pairs (``triton_common.code_centroids``) against the codebook. :func:`lanes_check` runs
a decode step with its key tiles cut into 1, 2 and 4 lanes, and :func:`lane_map` draws which
pairs of a tile each lane reads, from the kernel's own helpers. On a CPU every check
runs the kernels in the interpreter, which multiplies fp16 inputs exactly, as a tensor core
does.
:func:`byte_table` is the byte-count model of ``rqlib.study.bench`` for several key bit widths;
:func:`benchmark` times the kernels on a GPU.

Import this module after ``TRITON_INTERPRET`` is set (on a CPU): it imports ``rqlib.kernels``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import triton
import triton.language as tl

from rqlib import kernels
from rqlib.book.checks import either, relative_error
from rqlib.core.packing import pack_bits
from rqlib.core.quantizers import make_quantizer
from rqlib.kernels import numerics, reference
from rqlib.kernels.triton_attention import lane_range, own_lane, spread_lane
from rqlib.kernels.triton_common import code_centroids, fp16_parts, split_dot
from rqlib.study import bench

__all__ = [
    "FORMATS",
    "IRREGULAR",
    "Irregular",
    "bench_arguments",
    "benchmark",
    "byte_table",
    "attention_check",
    "centroid_pairs_check",
    "fp16_products",
    "gather_centroids",
    "lane_map",
    "lanes_check",
    "lanes_numbers",
    "register_report",
    "scores_check",
    "split_dot_bound",
    "split_dot_check",
    "split_examples",
    "tolerance",
]

#: The storage formats of :func:`rqlib.study.bench.byte_formats`, in its order.
FORMATS = ("fp16", "one byte per code", "packed codes", "packed codes + QJL", "packed values")

#: The methods the kernel chapter and the benchmark compress keys and values with.
KEY_METHOD, VALUE_METHOD = "turboquant-prod", "turboquant-mse"


@dataclass(frozen=True)
class Irregular:
    """Shapes of the checks: no length is a multiple of a tile or of a partition."""

    batch: int = 2
    kv_heads: int = 2
    q_len: int = 7
    scores_kv_len: int = 77
    decode_kv_len: int = 200
    n_sink: int = 4
    n_recent: int = 20
    partition: int = 64


IRREGULAR = Irregular()


def tolerance(device: str) -> float:
    """The relative error the checks accept: fp32 kernels sum at most D + m products per score
    (rounding about sqrt(D) * 2^-24, 1e-6 relative); 1e-5 still fails any logic error, which
    shows at the 1e-2 level. Compiled GPU code uses an approximate exp2 in the softmax: 1e-4."""
    return 1e-5 if device == "cpu" else 1e-4


def bench_arguments(
    *,
    head_dim: int,
    key_bits: int,
    value_bits: int,
    group: int,
    kv_heads: int,
    kv_lens: Sequence[int],
    hbm_gbps: float | None,
) -> argparse.Namespace:
    """The arguments ``python -m rqlib bench kernels`` would parse for this configuration."""
    return argparse.Namespace(
        what="kernels",
        kv_lens=tuple(int(n) for n in kv_lens),
        head_dim=head_dim,
        kv_heads=kv_heads,
        group=group,
        batch=1,
        key_method=KEY_METHOD,
        key_bits=key_bits,
        value_method=VALUE_METHOD,
        value_bits=value_bits,
        hbm_gbps=hbm_gbps,
        cpu=False,
        sweep_tiles=False,
        # the decode-cpu arguments, at their defaults
        model="smollm2-135m",
        context=1024,
        steps=32,
        presets=["rq-3.5"],
        threads=None,
        json=None,
        force=False,
    )


#: Streaming multiprocessors of an H100 SXM (and of an H200): the chapter's example GPU.
H100_SMS = 132


def split_examples(
    *,
    head_dim: int = 128,
    kv_heads: int = 8,
    group: int = 4,
    bits: int = 3,
    long: int = 32768,
    short: int = 4096,
    batch: int = 8,
) -> dict:
    """How a decode step over ``bits``-bit keys and values (MSE codes, 11-bit norms) of a model
    with Llama-3-8B's geometry (the defaults) is split on an H100
    (:func:`rqlib.kernels.limits.decode_splits`): glue values ``example_*``, ``split_waves`` and
    ``max_partial_share_pct``."""
    from rqlib.kernels import limits as geo

    quantizer = make_quantizer("turboquant-mse", head_dim, bits, norm_mantissa_bits=6)
    key_bytes = 2 * quantizer.bits_per_vector / 8  # K and V per key position and KV head
    partial = geo.partial_bytes(group, geo.accumulator_width(head_dim), geo.lanes(group))

    def plan(span: int, sequences: int) -> tuple[int, int]:
        return geo.decode_splits(span, sequences * kv_heads, H100_SMS, partial, key_bytes)

    (long_splits, long_partition), (short_splits, short_partition) = plan(long, 1), plan(short, 1)
    return {
        "split_waves": geo.SPLIT_WAVES,
        "max_partial_share_pct": 100 * geo.MAX_PARTIAL_SHARE,
        "example_sms": H100_SMS,
        "example_long": long,
        "example_short": short,
        "example_batch": batch,
        "example_long_splits": long_splits,
        "example_long_partition": long_partition,
        "example_short_splits": short_splits,
        "example_short_partition": short_partition,
        "example_batch_splits": plan(long, batch)[0],
    }


def byte_table(key_bits: Sequence[int], **arguments) -> pd.DataFrame:
    """Bytes per token and KV head of each format (columns, :data:`FORMATS`) for each key bit
    width (rows), from :func:`rqlib.study.bench.byte_formats`."""
    rows = {}
    for bits in key_bits:
        formats = bench.byte_formats(bench_arguments(key_bits=bits, **arguments))
        if len(formats) != len(FORMATS) or formats[0][0] != "fp16":
            raise ValueError(f"rqlib.study.bench.byte_formats changed its formats: {formats}")
        rows[bits] = {name: nbytes for name, (_, nbytes, _) in zip(FORMATS, formats)}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("key bits")


def _gaussian(generator: torch.Generator, device: str, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device)


def _poisoned() -> None:
    """Make every output and scratch buffer of the Triton launches start as NaN."""
    from rqlib.kernels import launch

    launch.POISON_BUFFERS = True


def scores_check(head_dim: int, bits: int, group: int, seed: int, device: str) -> dict:
    """``fused_scores`` (Triton) on prod keys against float64 torch and the quantizer's own
    ``inner_product``: ``{"vs_float64": error, "vs_inner_product": error, "seconds": ...}``."""
    import time

    _poisoned()
    shape = IRREGULAR
    generator = torch.Generator().manual_seed(seed)
    quantizer = make_quantizer(KEY_METHOD, head_dim, bits, seed=seed)
    keys = quantizer.quantize(
        _gaussian(generator, device, shape.batch, shape.kv_heads, shape.scores_kv_len, head_dim) * 3
    )
    q = _gaussian(generator, device, shape.batch, shape.kv_heads * group, shape.q_len, head_dim)
    scale = head_dim**-0.5
    started = time.perf_counter()
    scores = kernels.fused_scores(q, keys, scale=scale, backend="triton")
    seconds = time.perf_counter() - started
    exact64 = reference.fused_scores(q.double(), keys, scale=scale, dtype=torch.float64)
    per_query_head = keys.map(lambda t: t.repeat_interleave(group, dim=1).unsqueeze(2))
    estimator = quantizer.inner_product(q.unsqueeze(-2), per_query_head) * scale
    return {
        "vs_float64": relative_error(scores, exact64),
        "vs_inner_product": relative_error(scores, estimator),
        "seconds": seconds,
    }


def _check_layer(
    head_dim: int, bits: int, value_bits: int, seed: int, device: str, generator
) -> tuple:
    """``(state, k, v)``: the cache layer of the attention checks (:data:`IRREGULAR` shapes)
    over Gaussian keys ``k`` and values ``v`` drawn from ``generator``: ``bits``-bit prod keys
    and ``value_bits``-bit MSE values as packed codes, an exact sink and an exact recent band.
    Every buffer the kernels write from then on starts as NaN."""
    _poisoned()
    s = IRREGULAR
    key_quantizer = make_quantizer(KEY_METHOD, head_dim, bits, seed=seed)
    value_quantizer = make_quantizer(VALUE_METHOD, head_dim, value_bits, seed=seed + 1)
    k = _gaussian(generator, device, s.batch, s.kv_heads, s.decode_kv_len, head_dim) * 2
    v = _gaussian(generator, device, s.batch, s.kv_heads, s.decode_kv_len, head_dim)
    layer = bench.decode_layer(key_quantizer, value_quantizer, k, v, s.n_sink, s.n_recent)
    return layer.state(), k, v


def attention_check(
    head_dim: int, bits: int, value_bits: int, group: int, seed: int, device: str
) -> dict:
    """The fused attention (Triton) against the float64 torch implementation on one cache layer
    that stores prod keys and MSE values as packed codes, exact sink tokens and an exact recent
    band: a prompt of ``q_len`` queries ending the stored sequence (query and key blocks) and a
    decode step cut into several splits, against the reference read with the kernel's codebook
    (``prompt``, ``decode``) and with the float32 one (``prompt_codebook``,
    ``decode_codebook``: what rounding the codebook to fp16 moves), and the float32 codebook's
    reference against attention over the keys and values before compression
    (``prompt_compression``, ``decode_compression``: what compressing them moves).
    ``{"prompt": error, ..., "splits": n, "seconds": ...}``."""
    import time

    from rqlib.kernels.state import CausalMask

    s = IRREGULAR
    generator = torch.Generator().manual_seed(seed + 1)
    state, k, v = _check_layer(head_dim, bits, value_bits, seed, device, generator)
    scale = head_dim**-0.5
    errors, seconds = {}, 0.0
    for name, q_len in (("prompt", s.q_len), ("decode", 1)):
        q = _gaussian(generator, device, s.batch, s.kv_heads * group, q_len, head_dim)
        mask = CausalMask(s.batch, state.end - q_len, q_len, 0, state.end)
        chunk = dataclasses.replace(state, start=state.end - q_len)
        started = time.perf_counter()
        # a short partition: several splits even at this short length
        out = kernels.attention(
            chunk, q, mask, scale=scale, backend="triton", partition=s.partition
        )
        seconds += time.perf_counter() - started
        on_kernel_codebook = numerics.on_kernel_codebook(chunk)
        options = dict(scale=scale, dtype=torch.float64)
        kernel_reference = reference.attention(on_kernel_codebook, q.double(), mask, **options)
        errors[name] = relative_error(out, kernel_reference)
        float32_reference = reference.attention(chunk, q.double(), mask, **options)
        errors[f"{name}_codebook"] = relative_error(out, float32_reference)
        uncompressed = _uncompressed(q, k, v, scale)
        errors[f"{name}_compression"] = relative_error(float32_reference, uncompressed)
    return {**errors, "splits": math.ceil(s.decode_kv_len / s.partition), "seconds": seconds}


def lanes_check(
    head_dim: int, bits: int, value_bits: int, group: int, seed: int, device: str
) -> dict:
    """One decode step of the layer of :func:`attention_check` (a query token per head, so a
    block of ``group`` rows) with the key tiles cut into each number of lanes the kernel
    takes (:func:`rqlib.kernels.limits.lanes` picks one): ``{lanes: error}`` against the
    float64 reference read with the kernel's codebook, and ``"spread"``, the largest
    difference between two of them relative to the largest output."""
    from rqlib.kernels import limits as geo
    from rqlib.kernels.state import CausalMask

    s = IRREGULAR
    generator = torch.Generator().manual_seed(seed + 2)
    state, _, _ = _check_layer(head_dim, bits, value_bits, seed, device, generator)
    scale = head_dim**-0.5
    q = _gaussian(generator, device, s.batch, s.kv_heads * group, 1, head_dim)
    mask = CausalMask(s.batch, state.end - 1, 1, 0, state.end)
    step = dataclasses.replace(state, start=state.end - 1)
    expected = reference.attention(
        numerics.on_kernel_codebook(step), q.double(), mask, scale=scale, dtype=torch.float64
    )
    outputs, errors = {}, {}
    for lanes in range(1, geo.MAX_LANES + 1):
        if lanes & (lanes - 1):
            continue
        outputs[lanes] = kernels.attention(
            step, q, mask, scale=scale, backend="triton", partition=s.partition, lanes=lanes
        )
        errors[lanes] = relative_error(outputs[lanes], expected)
    spread = max(relative_error(a, b) for a in outputs.values() for b in outputs.values())
    return {**errors, "spread": spread, "default": geo.lanes(group)}


@triton.jit
def _lane_map_kernel(out_ptr, ROWS: tl.constexpr, KEYS: tl.constexpr, LANES: tl.constexpr):
    rows, columns = tl.arange(0, ROWS), tl.arange(0, KEYS)
    lane = rows % LANES
    every = columns[None, :] + 1 + 0 * rows[:, None]  # [ROWS, KEYS]: each tile column, from 1
    own = own_lane(every, lane, LANES, KEYS // LANES)
    keys, _ = lane_range(0, lane, 0, KEYS, KEYS // LANES)
    tl.store(
        out_ptr + rows[:, None] * KEYS + columns[None, :],
        spread_lane(own, lane, LANES, KEYS // LANES),
    )
    tl.store(
        out_ptr
        + ROWS * KEYS
        + rows[:, None] * (KEYS // LANES)
        + tl.arange(0, KEYS // LANES)[None, :],
        keys,
    )


def lane_map(lanes: int, device: str) -> dict[str, torch.Tensor]:
    """Which pairs of a key tile (``BLOCK_ROWS`` rows, ``ATTENTION_BLOCK_S`` keys) the
    attention kernel's softmax reads in ``lanes`` lanes, from its own helpers in one program:
    ``"read"``, ``[rows, keys]``, the tile column + 1 where ``own_lane`` keeps a score and
    ``spread_lane`` puts its weight back, 0 where the product is computed and dropped; and
    ``"keys"``, ``[rows, keys / lanes]``, the keys of a tile starting at key 0 that
    ``lane_range`` gives each row (the masks read these)."""
    from rqlib.kernels import limits as geo

    rows, keys = geo.BLOCK_ROWS, geo.ATTENTION_BLOCK_S
    out = torch.full((rows * keys + rows * keys // lanes,), -1, dtype=torch.int32, device=device)
    _lane_map_kernel[(1,)](out, rows, keys, lanes)
    out = out.cpu()
    read, keys = out[: rows * keys].reshape(rows, keys), out[rows * keys :].reshape(rows, -1)
    kept = [sorted(int(column) - 1 for column in row if column > 0) for row in read]
    return {"read": read, "keys": keys, "consistent": kept == keys.tolist()}


def lanes_numbers(group: int) -> dict:
    """What the chapter says of the lanes of a decode step of ``group`` query rows
    (:func:`rqlib.kernels.limits.lanes`), as glue values: ``lanes_default`` lanes,
    ``lanes_used_rows`` rows of a tile holding a query, ``lanes_keys`` keys a lane reads of a
    tile, the blocks of rows that take ``max_lanes`` lanes (``lanes_four_rows`` rows at most)
    and two (``lanes_two_rows``), and ``lanes_phrase``, every number of lanes a launch takes."""
    from rqlib.kernels import aot
    from rqlib.kernels import limits as geo

    lanes = geo.lanes(group)
    return {
        "lanes_group": group,
        "lanes_default": lanes,
        "lanes_used_rows": min(geo.BLOCK_ROWS, group * lanes),
        "lanes_keys": geo.ATTENTION_BLOCK_S // lanes,
        "max_lanes": geo.MAX_LANES,
        "lanes_four_rows": max(r for r in range(1, geo.BLOCK_ROWS + 1) if geo.lanes(r) == 4),
        "lanes_two_rows": max(r for r in range(1, geo.BLOCK_ROWS + 1) if geo.lanes(r) == 2),
        "lanes_phrase": ", ".join(map(str, aot.LANES[:-1])) + f" and {aot.LANES[-1]}",
    }


def register_report(group: int, head_dim: int = 128) -> dict:
    """Registers and spills of the attention kernel in the presets' format
    (``sass.decode_layout(head_dim, 3, 2, 11)``) with fp16 exact streams, in its first
    configuration, compiled for sm_90 (:func:`rqlib.book.ptx.compile_ptx`): a decode step of
    ``group`` rows in its lanes (``att_regs``, ``att_spill``, ``att_sm80_spill`` at sm_80, the
    theoretical occupancy ``att_blocks``, ``att_occupancy``, ``att_limit``), the same at head
    dimension 256 (``att_wide_spill``) and a prompt, in one lane (``att_prompt_spill``); and the
    configurations (``n_configs``, ``tensor_core_configs``, ``first_config``: warps, scores on
    tensor cores, value pairs). The decode step's shared memory unpipelined (``att_smem``) and
    in the ``n_pipelined`` pipelined configurations (``limits.PIPELINED_CONFIGS``): how many do
    not spill (``pipelined_fits``), and the first's spill in words and its shared memory
    (``pipelined_first_phrase``, ``pipelined_smem``: the first configuration in two stages).
    The first configuration of wider key tiles (``limits.WIDE_TILE_CONFIGS``: ``wide_keys``
    keys, ``wide_warps`` warps): its spill in the same decode step (``wide_spill``) and at
    head dimension 64 (``wide_small_spill``)."""
    from rqlib.book import ptx, sass
    from rqlib.kernels import aot
    from rqlib.kernels import limits as geo

    lanes = geo.lanes(group)

    def spec(d: int, lanes: int, config: geo.AttentionConfig = geo.ATTENTION_CONFIGS[0]):
        layout = sass.decode_layout(d, 3, 2, 11)
        return aot.attention_specialization(layout, "fp16", config, lanes)

    decode = spec(head_dim, lanes)
    compiled = ptx.compile_ptx(decode.label, 90)
    occupancy = aot.occupancy(compiled.registers, compiled.shared_bytes, decode.num_warps, 90)
    first = geo.ATTENTION_CONFIGS[0]
    pipelined = [
        ptx.compile_ptx(spec(head_dim, lanes, config).label, 90) for config in geo.PIPELINED_CONFIGS
    ]
    wide = geo.WIDE_TILE_CONFIGS[0]
    return {
        "wide_keys": wide.block_s,
        "wide_warps": wide.num_warps,
        "wide_spill": ptx.compile_ptx(spec(head_dim, lanes, wide).label, 90).spill_bytes,
        "wide_small_spill": ptx.compile_ptx(spec(64, lanes, wide).label, 90).spill_bytes,
        "att_smem": compiled.shared_bytes,
        "n_pipelined": len(pipelined),
        "pipelined_fits": sum(not kernel.spill_bytes for kernel in pipelined),
        "pipelined_first_phrase": either(
            pipelined[0].spill_bytes > 0,
            f"spills {pipelined[0].spill_bytes} bytes a thread",
            "fits too",
        ),
        "pipelined_smem": pipelined[0].shared_bytes,
        "att_regs": compiled.registers,
        "att_spill": compiled.spill_bytes,
        "att_sm80_spill": ptx.compile_ptx(decode.label, 80).spill_bytes,
        "att_wide_spill": ptx.compile_ptx(spec(256, lanes).label, 90).spill_bytes,
        "att_prompt_spill": ptx.compile_ptx(spec(head_dim, 1).label, 90).spill_bytes,
        "att_warps": decode.num_warps,
        "att_lanes": lanes,
        "att_blocks": occupancy["blocks"],
        "att_occupancy": occupancy["occupancy"],
        "att_limit": occupancy["limit"],
        "n_configs": len(geo.ATTENTION_CONFIGS),
        "tensor_core_configs": sum(c.score_tensor_cores for c in geo.ATTENTION_CONFIGS),
        "first_config": (first.num_warps, first.score_tensor_cores, first.value_pairs),
    }


def _uncompressed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention in float64 of queries ``q`` ending the sequence over the uncompressed
    keys and values ``k``, ``v`` (``[B, KV, S, d]``, each KV head read by its query group)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    q_len, kv_len = q.shape[2], k.shape[2]
    positions = torch.arange(kv_len - q_len, kv_len, device=q.device)
    hidden = torch.arange(kv_len, device=q.device)[None, :] > positions[:, None]
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@triton.jit
def _fp16_products_kernel(
    x_ptr, y_ptr, split_ptr, plain_ptr, hi_ptr, lo_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
):  # fmt: skip
    rows, inner, cols = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    x = tl.load(x_ptr + rows[:, None] * K + inner[None, :])
    y = tl.load(y_ptr + inner[:, None] * N + cols[None, :])
    out = rows[:, None] * N + cols[None, :]
    tl.store(split_ptr + out, split_dot(x, y, tl.zeros((M, N), dtype=tl.float32)))
    tl.store(plain_ptr + out, tl.dot(x.to(tl.float16), y))
    hi, lo = fp16_parts(x)
    tl.store(hi_ptr + rows[:, None] * K + inner[None, :], hi)
    tl.store(lo_ptr + rows[:, None] * K + inner[None, :], lo)


def fp16_products(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x @ y`` for float32 ``x`` ``[M, K]`` (within fp16's range) and fp16 ``y`` ``[K, N]``
    (M, K, N powers of two, at least 16) in one Triton program: ``"split"`` by ``split_dot``,
    ``"plain"`` by one fp16 ``tl.dot`` (``x`` rounded to fp16), and ``fp16_parts(x)`` as
    ``"hi"`` and ``"lo"``."""
    (m, k), n = x.shape, y.shape[1]
    result = {name: x.new_empty(m, n) for name in ("split", "plain")}
    result.update({name: x.new_empty(m, k, dtype=torch.float16) for name in ("hi", "lo")})
    _fp16_products_kernel[(1,)](
        x, y, result["split"], result["plain"], result["hi"], result["lo"], m, k, n
    )
    return result


def split_dot_bound(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The entrywise bound on ``|split_dot(x, y) - x @ y|`` (float64): the split's remainder,
    ``(2^-22 |x| + 2^-25) |y|`` a product (:data:`rqlib.kernels.numerics.PART_REMAINDER`), and
    a float32 sum (rounded to nearest) of the ``2K`` exact products of the two parts into the
    accumulator, ``(2K + 1) 2^-24`` of their magnitudes."""
    relative, absolute = numerics.PART_REMAINDER
    k = x.shape[-1]
    magnitudes = x.double().abs() @ y.double().abs()
    return (relative + (2 * k + 1) * 2.0**-24) * magnitudes + absolute * y.double().abs().sum(0)


def split_dot_check(seed: int, device: str, m: int = 16, k: int = 64, n: int = 16) -> dict:
    """``split_dot`` and a single fp16 ``tl.dot`` of a float32 matrix (magnitudes spread over
    several octaves, some below fp16's normal range) and an fp16 one, against float64. Returns
    the largest ratio of each one's error to :func:`split_dot_bound` (``split_dot`` must stay
    at or below 1) and the largest error of each relative to the largest product."""
    generator = torch.Generator().manual_seed(seed)
    x, y = (
        torch.randn(*shape, generator=generator)
        * torch.exp(2 * torch.randn(*shape, generator=generator))
        for shape in ((m, k), (k, n))
    )
    x = x.clamp(-60000.0, 60000.0)  # within fp16's range, as the kernel's factors are
    y = y.clamp(-60000.0, 60000.0).to(torch.float16)
    got = fp16_products(x.to(device), y.to(device))
    expected = x.double() @ y.double()
    bound = split_dot_bound(x, y)
    result = {}
    for name in ("split", "plain"):
        error = (got[name].cpu().double() - expected).abs()
        result[f"{name}_over_bound"] = float((error / bound).max())
        result[f"{name}_error"] = float(error.max() / expected.abs().max())
    return result


@triton.jit
def _gather_centroids_kernel(
    codes_ptr, table_ptr, out_ptr, n_rows, dim: tl.constexpr, bits: tl.constexpr,
    row_bytes: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, WIDTH: tl.constexpr,
    GROUPS: tl.constexpr,
):  # fmt: skip
    rows = tl.arange(0, ROWS)
    key_mask = rows < n_rows
    row_ptrs = codes_ptr + rows[:, None] * row_bytes
    for c0 in range(0, WIDTH, CHUNK):
        centroids = code_centroids(
            row_ptrs, c0, key_mask, dim, bits, row_bytes, table_ptr, CHUNK, GROUPS, True
        )
        cols = c0 + tl.arange(0, CHUNK)
        tl.store(out_ptr + rows[:, None] * WIDTH + cols[None, :], centroids)


def gather_centroids(
    packed: torch.Tensor,
    table: torch.Tensor,
    n_rows: int,
    dim: int,
    bits: int,
    *,
    rows: int,
    width: int,
    chunk: int,
    groups: bool,
) -> torch.Tensor:
    """The centroids that ``triton_common.code_centroids`` reads for the packed rows ``packed``
    (``n_rows`` rows of ``dim`` ``bits``-bit codes) through the table of centroid pairs
    ``table`` (``numerics.kernel_table``), in one program: ``[rows, width]`` in the table's
    centroid dtype, every row and column written, also those past ``n_rows`` and ``dim`` (the
    kernel reads 0 there). Codes eight a load with ``groups``, ``chunk`` columns at a time."""
    dtype = numerics.PAIR_CENTROID_DTYPES[table.dtype]
    out = torch.full((rows, width), float("nan"), dtype=dtype, device=packed.device)
    _gather_centroids_kernel[(1,)](
        packed, table, out, n_rows, dim, bits, packed.shape[1], rows, chunk, width, groups
    )
    return out


def centroid_pairs_check(codes: torch.Tensor, bits: int, seed: int, device: str) -> dict:
    """The attention kernel's read of one packed row of ``codes`` (``uint8``, a multiple of 16
    of them) through the table of centroid pairs of a ``bits``-bit TurboQuant-MSE quantizer
    (``seed``), two codes a load: ``"exact"``, whether it returns the kernel's fp16 codebook
    at ``codes`` bit for bit, and ``"pairs"``, a table of each pair of adjacent codes, the
    ``2 * bits``-bit field they form in the packed row, and the two halves of the table's
    entry there next to the codebook's centroids of the two codes."""
    if codes.dim() != 1 or codes.numel() % 16:
        raise ValueError(f"codes must be one row of a multiple of 16 codes, got {codes.shape}")
    quantizer = make_quantizer("turboquant-mse", codes.numel(), bits, seed=seed)
    table = numerics.kernel_table(quantizer, device)
    codebook = numerics.kernel_centroids(quantizer, "cpu")
    packed = pack_bits(codes, bits)[None, :]
    n = codes.numel()
    read = gather_centroids(
        packed.to(device), table, 1, n, bits, rows=16, width=n, chunk=16, groups=True
    )
    expected = codebook[codes.long()]
    word = int.from_bytes(bytes(packed[0].tolist()), "little")
    fields = [(word >> 2 * bits * i) & ((1 << 2 * bits) - 1) for i in range(n // 2)]
    low, high = numerics.table_halves(table.cpu()[torch.tensor(fields)])
    pairs = pd.DataFrame(
        {
            "codes": [f"{int(a)}, {int(b)}" for a, b in zip(codes[0::2], codes[1::2])],
            "field": fields,
            "low half": low.float().numpy(),
            "c[first]": expected[0::2].float().numpy(),
            "high half": high.float().numpy(),
            "c[second]": expected[1::2].float().numpy(),
        }
    )
    exact = torch.equal(read[0].cpu(), expected) and not read[1:].cpu().any()
    return {"exact": bool(exact), "pairs": pairs}


def benchmark(args: argparse.Namespace, device: str = "cuda") -> pd.DataFrame:
    """Time every kernel at every context length of ``args`` on a GPU (after checking the
    compiled kernels against the references there): one row per (length, kernel)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU")
    dev = torch.device(device)
    bench.check_on_gpu(args, dev)
    key_qz = make_quantizer(args.key_method, args.head_dim, args.key_bits)
    value_qz = make_quantizer(args.value_method, args.head_dim, args.value_bits)
    rows = []
    for kv_len in sorted(args.kv_lens):
        timed = bench.time_one_length(args, kv_len, key_qz, value_qz, args.head_dim**-0.5, dev)
        for name, ms, nbytes, sdpa_ms in timed:
            rows.append(
                {
                    "kv_len": kv_len,
                    "kernel": name,
                    "time_us": ms * 1e3,
                    "GB_per_s": nbytes / ms / 1e6,
                    "speedup_vs_sdpa": sdpa_ms / ms,
                }
            )
        torch.cuda.empty_cache()
    frame = pd.DataFrame(rows)
    if args.hbm_gbps:
        frame["fraction_of_hbm"] = frame["GB_per_s"] / args.hbm_gbps
    return frame
