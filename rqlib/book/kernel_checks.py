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
centroid pairs (``triton_common.code_centroids``) against the codebook. On a CPU every check
runs the kernels in the interpreter, which multiplies fp16 inputs exactly, as a tensor core
does. :func:`register_report` compiles the decode step of the presets' format for sm_90 and
sm_80 and reads its registers, spills and occupancy.
:func:`byte_table` is the byte-count model of ``rqlib.study.bench`` for several key bit widths;
:func:`benchmark` times the kernels on a GPU.

Import this module after ``TRITON_INTERPRET`` is set (on a CPU): it imports ``rqlib.kernels``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import triton
import triton.language as tl

from rqlib import kernels
from rqlib.book.checks import relative_error
from rqlib.core.packing import pack_bits
from rqlib.core.quantizers import make_quantizer
from rqlib.kernels import numerics, reference
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
    "attention_sources",
    "centroid_pairs_check",
    "fp16_products",
    "gather_centroids",
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
        # the gpu and decode-cpu arguments, at their defaults
        out=None,
        only=None,
        batches=None,
        prompt=None,
        model="smollm2-135m",
        context=1024,
        steps=32,
        presets=None,
        threads=None,
        json=None,
        force=False,
    )


#: Streaming multiprocessors of an H100 SXM (and of an H200): the chapter's example GPU.
H100_SMS = 132


def split_examples(
    *, kv_heads: int = 8, long: int = 32768, short: int = 4096, batch: int = 8
) -> dict:
    """How a decode step of a model with ``kv_heads`` KV heads (Llama-3-8B's 8 by default) is
    split on an H100 (:func:`rqlib.kernels.limits.decode_splits`, whole tiles of
    :func:`rqlib.kernels.limits.split_partition`), for one sequence at ``long`` and ``short``
    tokens and a batch of ``batch`` at ``long``: glue values ``example_*``, ``split_waves``,
    ``max_splits`` and ``default_splits`` (the interpreter's, which has no SM count)."""
    from rqlib.kernels import limits as geo

    one, many = (geo.decode_splits(n * kv_heads, H100_SMS) for n in (1, batch))
    return {
        "split_waves": geo.SPLIT_WAVES,
        "max_splits": geo.MAX_SPLITS,
        "default_splits": geo.DEFAULT_SPLITS,
        "example_sms": H100_SMS,
        "example_kv_heads": kv_heads,
        "example_long": long,
        "example_short": short,
        "example_batch": batch,
        "example_splits": one,
        "example_long_partition": geo.split_partition(long, one),
        "example_short_partition": geo.split_partition(short, one),
        "example_batch_splits": many,
        "example_batch_partition": geo.split_partition(long, many),
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


def scores_check(head_dim: int, bits: int, group: int, draw: int, device: str) -> dict:
    """``fused_scores`` (Triton) on prod keys against float64 torch and the quantizer's own
    ``inner_product``: ``{"vs_float64": error, "vs_inner_product": error, "seconds": ...}``."""
    import time

    _poisoned()
    shape = IRREGULAR
    generator = torch.Generator().manual_seed(draw)
    quantizer = make_quantizer(KEY_METHOD, head_dim, bits, draw=draw)
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


def trellis_scores_check(head_dim: int, bits: int, group: int, draw: int, device: str) -> dict:
    """``fused_scores`` (Triton) on MSE keys coded by a tail-biting trellis (spec tokens
    ``tcq:tb``) against float64 torch on the same symbols: ``{"tail_biting": error,
    "read_from_0": error, "state_bits": L}``, the second the kernel launched on the same symbols
    read from 0, a wrong reading that the comparison must reject."""
    from rqlib.spec.config import TRELLIS_STATE_BITS

    _poisoned()
    shape = IRREGULAR
    generator = torch.Generator().manual_seed(draw)
    quantizer = make_quantizer(
        VALUE_METHOD, head_dim, bits, draw=draw, trellis_state_bits=TRELLIS_STATE_BITS,
        trellis_tail_biting=True,
    )  # fmt: skip
    keys = quantizer.quantize(
        _gaussian(generator, device, shape.batch, shape.kv_heads, shape.scores_kv_len, head_dim) * 3
    )
    q = _gaussian(generator, device, shape.batch, shape.kv_heads * group, shape.q_len, head_dim)
    scale = head_dim**-0.5
    exact64 = reference.fused_scores(q.double(), keys, scale=scale, dtype=torch.float64)
    from_0 = copy.copy(quantizer)
    from_0.trellis = dataclasses.replace(quantizer.trellis, tail_biting=False)
    misread = dataclasses.replace(keys, quantizer=from_0)
    return {
        "tail_biting": relative_error(
            kernels.fused_scores(q, keys, scale=scale, backend="triton"), exact64
        ),
        "read_from_0": relative_error(
            kernels.fused_scores(q, misread, scale=scale, backend="triton"), exact64
        ),
        "state_bits": TRELLIS_STATE_BITS,
    }


def _check_layer(
    head_dim: int, bits: int, value_bits: int, draw: int, device: str, generator
) -> tuple:
    """``(state, k, v)``: the cache layer of the attention checks (:data:`IRREGULAR` shapes)
    over Gaussian keys ``k`` and values ``v`` drawn from ``generator``: ``bits``-bit prod keys
    and ``value_bits``-bit MSE values as packed codes, an exact sink and an exact recent band.
    Every buffer the kernels write from then on starts as NaN."""
    _poisoned()
    s = IRREGULAR
    key_quantizer = make_quantizer(KEY_METHOD, head_dim, bits, draw=draw)
    value_quantizer = make_quantizer(VALUE_METHOD, head_dim, value_bits, draw=draw + 1)
    k = _gaussian(generator, device, s.batch, s.kv_heads, s.decode_kv_len, head_dim) * 2
    v = _gaussian(generator, device, s.batch, s.kv_heads, s.decode_kv_len, head_dim)
    layer = bench.decode_layer(key_quantizer, value_quantizer, k, v, s.n_sink, s.n_recent)
    return layer.state(), k, v


def attention_check(
    head_dim: int, bits: int, value_bits: int, group: int, draw: int, device: str
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
    generator = torch.Generator().manual_seed(draw + 1)
    state, k, v = _check_layer(head_dim, bits, value_bits, draw, device, generator)
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


def register_report(head_dim: int = 128) -> dict:
    """Registers, spills and theoretical occupancy of the attention kernel in the presets'
    format (``sass.decode_layout(head_dim, 3, 2, 11)``) with fp16 exact streams, in the one
    configuration a launch runs it in (:func:`rqlib.kernels.limits.attention_config`), compiled
    for sm_90 (:func:`rqlib.book.ptx.compile_ptx`): ``att_regs``, ``att_spill``, ``att_smem``,
    ``att_warps``, ``att_tensor_cores`` (the scores on tensor cores), ``att_blocks`` (blocks
    an SM holds), ``att_occupancy`` and ``att_limit`` (what bounds it); ``att_sm80_spill``,
    the spill at sm_80; and the same format at head dimension 256 (``wide_warps``,
    ``wide_tensor_cores``, ``wide_spill``), whose wider accumulator takes the other
    configuration."""
    from rqlib.book import ptx, sass
    from rqlib.kernels import aot
    from rqlib.kernels import limits as geo

    def spec(d: int):
        return aot.attention_specialization(sass.decode_layout(d, 3, 2, 11), "fp16")

    decode, wide = spec(head_dim), spec(256)
    compiled = ptx.compile_ptx(decode.label, 90)
    occupancy = aot.occupancy(compiled.registers, compiled.shared_bytes, decode.num_warps, 90)
    tensor_cores = bool(decode.constexprs["SCORE_TENSOR_CORES"])
    return {
        "att_regs": compiled.registers,
        "att_spill": compiled.spill_bytes,
        "att_smem": compiled.shared_bytes,
        "att_warps": decode.num_warps,
        "att_tensor_cores": tensor_cores,
        "att_blocks": occupancy["blocks"],
        "att_occupancy": occupancy["occupancy"],
        "att_limit": occupancy["limit"],
        "att_sm80_spill": ptx.compile_ptx(decode.label, 80).spill_bytes,
        "att_max_registers": geo.ATTENTION_MAX_REGISTERS,
        "wide_warps": wide.num_warps,
        "wide_tensor_cores": bool(wide.constexprs["SCORE_TENSOR_CORES"]),
        "wide_spill": ptx.compile_ptx(wide.label, 90).spill_bytes,
        "tensor_core_max_width": geo.TENSOR_CORE_MAX_WIDTH,
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


def split_dot_check(draw: int, device: str, m: int = 16, k: int = 64, n: int = 16) -> dict:
    """``split_dot`` and a single fp16 ``tl.dot`` of a float32 matrix (magnitudes spread over
    several octaves, some below fp16's normal range) and an fp16 one, against float64. Returns
    the largest ratio of each one's error to :func:`split_dot_bound` (``split_dot`` must stay
    at or below 1) and the largest error of each relative to the largest product."""
    generator = torch.Generator().manual_seed(draw)
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


def centroid_pairs_check(codes: torch.Tensor, bits: int, draw: int, device: str) -> dict:
    """The attention kernel's read of one packed row of ``codes`` (``uint8``, a multiple of 16
    of them) through the table of centroid pairs of a ``bits``-bit TurboQuant-MSE quantizer
    (``draw``), two codes a load: ``"exact"``, whether it returns the kernel's fp16 codebook
    at ``codes`` bit for bit, and ``"pairs"``, a table of each pair of adjacent codes, the
    ``2 * bits``-bit field they form in the packed row, and the two halves of the table's
    entry there next to the codebook's centroids of the two codes."""
    if codes.dim() != 1 or codes.numel() % 16:
        raise ValueError(f"codes must be one row of a multiple of 16 codes, got {codes.shape}")
    quantizer = make_quantizer("turboquant-mse", codes.numel(), bits, draw=draw)
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


def attention_sources() -> list:
    """The excerpts of ``rqlib.kernels.triton_attention`` that the chapter shows after the
    online softmax's equations (:func:`rqlib.book.source.show_source`): the keys of a tile,
    one softmax step, the walk over one stream's tiles (``stream_loop``, which the kernel calls
    for the main stream, the band and the sink), and the reduce's merge of the partial
    results."""
    from rqlib.book.source import show_source
    from rqlib.kernels import triton_attention as kernel

    return [
        show_source(kernel.tile_range),
        show_source(kernel.softmax_step),
        show_source(kernel.stream_loop, start="m_i, l_i, acc = fresh_softmax("),
        show_source(kernel.reduce_kernel, start="m_max = tl.load(part_m_ptr"),
    ]
