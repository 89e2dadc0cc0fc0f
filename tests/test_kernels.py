"""The Triton kernels under TRITON_INTERPRET=1 against float64 torch references.

Shapes are small and irregular (kv_len never a multiple of a tile, q_len 1 and 7, batch 2, GQA
1/3/8/20, head_dim 64/96/128/256 with dense, Hadamard, rotor and no rotation, code bits 0..5,
both QJL sketches) because the interpreter's cost grows with programs x operations. Every output
and scratch buffer starts as NaN (``launch.POISON_BUFFERS``), so an element a kernel does not
write fails the comparison. The attention kernel is tested in tests/test_kernels_attention.py.

Tolerances. Errors are measured as max|out - ref| / max|ref| against a float64 reference fed
the same stored codes, norms and (already rounded) inputs. fp32 kernels accumulate at most
D + m <= 1282 products per score, so the rounding error is of order sqrt(D) * 2^-24 ~ 1e-6
relative; 1e-5 leaves a 10x margin and still fails on any logic error (a wrong code, sign or
norm changes results at the 1e-2 level). fp16 / bf16 queries are converted to fp32 exactly, so
the same 1e-5 applies.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import sys

import pytest
import torch
import triton
import triton.language as tl

from rqlib import kernels
from rqlib.book.kernel_checks import gather_centroids
from rqlib.core.packing import pack_bits, unpack_bits, unpack_signs
from rqlib.core.quantizers import make_quantizer
from rqlib.kernels import aot, launch, numerics, reference
from rqlib.kernels import limits as geo
from rqlib.kernels.triton_common import load_code_groups

pytestmark = pytest.mark.interpreter

FP32_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch):
    """Every buffer the kernels write starts as NaN / 0xFF."""
    monkeypatch.setattr(launch, "POISON_BUFFERS", True)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref| (NaN in ``out`` gives NaN, which fails every comparison)."""
    error = float((out.double() - ref).abs().max() / ref.abs().max())
    print(f"relative error {error:.3e}")
    return error


def random_seed(rng: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


def quantizer(method, d, bits, rng, **options):
    return make_quantizer(method, d, bits, draw=random_seed(rng), **options)


def gaussian(rng, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=rng).to(dtype)


# --------------------------------------------------------------------------------------------
# fused_scores

#: a tail-biting trellis of 10 state bits, as the spec tokens tcq:tb make
TAIL_BITING = {"trellis_state_bits": 10, "trellis_tail_biting": True}

# (method, bits, d, options, batch, kv_heads, group, q_len, kv_len, q dtype)
SCORE_CASES = [
    ("turboquant-prod", 3, 128, {}, 2, 2, 3, 7, 77, torch.float32),
    ("turboquant-prod", 2, 64, {"qjl_sketch": "orthogonal"}, 2, 1, 8, 1, 100, torch.float16),
    ("rotorquant-prod", 4, 96, {"qjl_dim": 40}, 1, 2, 1, 7, 45, torch.bfloat16),
    ("turboquant-mse", 1, 256, {"rotation": "hadamard"}, 2, 1, 3, 1, 70, torch.float32),
    ("rotorquant-mse", 3, 256, {}, 1, 1, 1, 7, 33, torch.float32),
    ("turboquant-prod", 1, 128, {"rotation": "none"}, 2, 2, 1, 1, 65, torch.float32),
    ("turboquant-mse", 5, 64, {}, 1, 3, 3, 2, 50, torch.float32),
    # trellis codes: read tail-biting, and from 0 with QJL signs on the residual
    ("turboquant-mse", 3, 64, TAIL_BITING, 2, 1, 3, 2, 40, torch.float32),
    ("turboquant-prod", 3, 128, {"trellis_state_bits": 9}, 1, 2, 2, 1, 33, torch.float32),
]


def score_case_id(case) -> str:
    method, bits, d, options, batch, kv, group, q_len, kv_len, dtype = case
    extra = "-".join(f"{v}" for v in options.values())
    return f"{method}-{bits}b-d{d}-{extra}-B{batch}KV{kv}G{group}L{q_len}S{kv_len}-{dtype}"


@pytest.fixture(params=SCORE_CASES, ids=score_case_id)
def score_case(request, rng):
    method, bits, d, options, batch, kv_heads, group, q_len, kv_len, dtype = request.param
    qz = quantizer(method, d, bits, rng, **options)
    keys = qz.quantize(gaussian(rng, batch, kv_heads, kv_len, d) * 3)
    q = gaussian(rng, batch, kv_heads * group, q_len, d, dtype=dtype)
    return qz, keys, q, group


def test_fused_scores_match_float64_reference(score_case):
    qz, keys, q, _ = score_case
    scale = 1 / math.sqrt(qz.d)
    out = kernels.fused_scores(q, keys, scale=scale, backend="triton")
    ref = reference.fused_scores(q.double(), keys, scale=scale, dtype=torch.float64)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert relative_error(out, ref) <= FP32_TOLERANCE


def test_fused_scores_equal_quantizer_inner_product(score_case):
    """Two computations of the same estimator: the kernel and Quantizer.inner_product."""
    qz, keys, q, group = score_case
    out = kernels.fused_scores(q, keys, scale=1.0, backend="triton")
    per_query_head = keys.map(lambda t: t.repeat_interleave(group, dim=1).unsqueeze(2))
    expected = qz.inner_product(q.float().unsqueeze(-2), per_query_head)  # [B, QH, Lq, S]
    assert relative_error(out, expected.double()) <= FP32_TOLERANCE


def test_torch_backend_matches_float64_reference(score_case):
    qz, keys, q, _ = score_case
    out = kernels.fused_scores(q, keys, scale=0.5, backend="torch")
    ref = reference.fused_scores(q.double(), keys, scale=0.5, dtype=torch.float64)
    assert relative_error(out, ref) <= FP32_TOLERANCE


def test_fused_scores_writes_into_out(rng):
    qz = quantizer("turboquant-prod", 64, 3, rng)
    keys = qz.quantize(gaussian(rng, 1, 1, 40, 64))
    q = gaussian(rng, 1, 2, 3, 64)
    out = torch.full((1, 2, 3, 40), float("nan"))
    result = kernels.fused_scores(q, keys, scale=1.0, out=out, backend="triton")
    assert result is out
    ref = reference.fused_scores(q.double(), keys, scale=1.0, dtype=torch.float64)
    assert relative_error(out, ref) <= FP32_TOLERANCE


def test_strided_cache_views(rng):
    """Caches are views (a prefix of a preallocated buffer, a [B, S, KV] layout transposed):
    the kernels take the strides, not a contiguous copy's layout."""
    d, kv_len = 64, 70
    qz = quantizer("turboquant-prod", d, 3, rng)
    stored = qz.quantize(gaussian(rng, 2, kv_len + 11, 2, d))  # [B, S_max, KV]
    keys = stored.map(lambda t: t[:, :kv_len].transpose(1, 2))  # [B, KV, S], non-contiguous
    q = gaussian(rng, 2, 4, 1, d)
    assert not keys.codes.is_contiguous()
    scores = kernels.fused_scores(q, keys, scale=0.2, backend="triton")
    ref = reference.fused_scores(q.double(), keys, scale=0.2, dtype=torch.float64)
    assert relative_error(scores, ref) <= FP32_TOLERANCE


# --------------------------------------------------------------------------------------------
# quantize

# (method, bits, d, options, batch shape, input dtype)
QUANTIZE_CASES = [
    ("turboquant-mse", 3, 128, {}, (3, 37), torch.float32),
    ("turboquant-prod", 4, 96, {"qjl_sketch": "orthogonal", "qjl_dim": 50}, (45,), torch.float16),
    ("rotorquant-prod", 1, 64, {}, (2, 2, 20), torch.float32),
    ("rotorquant-mse", 5, 256, {}, (33,), torch.bfloat16),
    ("turboquant-prod", 2, 128, {"rotation": "hadamard"}, (70,), torch.float32),
    ("turboquant-mse", 8, 64, {"rotation": "none"}, (40,), torch.float32),
]


@pytest.mark.parametrize(
    "case", QUANTIZE_CASES, ids=lambda c: f"{c[0]}-{c[1]}b-d{c[2]}-{len(c[3])}opts-{c[5]}"
)
def test_quantize_kernel_is_bit_identical_to_torch(case, rng):
    method, bits, d, options, batch_shape, dtype = case
    qz = quantizer(method, d, bits, rng, **options)
    x = (gaussian(rng, *batch_shape, d) * 5).to(dtype)
    expected = qz.quantize(x)
    got = kernels.quantize(qz, x, backend="triton")
    assert got.codes.shape == expected.codes.shape
    assert torch.equal(got.codes, expected.codes)
    assert torch.equal(got.norms, expected.norms)
    if not qz.has_qjl:
        assert got.qjl_signs is None and got.residual_norms is None
        return
    # Signs: S r is summed in another order than torch's matmul, so a projection within
    # rounding (~2^-24 ||S_i|| ||r||) of zero may get the other sign; allow a flip only where
    # |S_i r| < 1e-5 ||S_i|| ||r|| (160x that bound) and count them.
    y = qz.rotation.apply(x.float() / x.float().norm(dim=-1, keepdim=True)).double()
    residual = y
    if qz.mse_bits:
        codes = unpack_bits(expected.codes, qz.mse_bits, qz.rotated_dim).long()
        residual = y - qz.centroids.double()[codes]
    projection = residual @ qz.sketch.double().T
    band = 1e-5 * qz.sketch.double().norm(dim=-1) * residual.norm(dim=-1, keepdim=True)
    differs = unpack_signs(got.qjl_signs, qz.qjl_dim) != unpack_signs(
        expected.qjl_signs, qz.qjl_dim
    )
    print(f"sign flips: {int(differs.sum())} of {differs.numel()}")
    assert not bool((differs & (projection.abs() >= band)).any())
    # Residual norms: ||r|| summed in another order differs in the last fp32 bit at most, which
    # can move the fp16-rounded stored value by at most one fp16 ulp.
    a, b = got.residual_norms.float(), expected.residual_norms.float()
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2**-14))) - 10)
    print(f"residual norms differing: {int((a != b).sum())} of {a.numel()}")
    assert bool(((a - b).abs() <= ulp).all())


# --------------------------------------------------------------------------------------------
# refusals and the dispatcher


def small_keys(rng, d=64, method="turboquant-prod", bits=3, **options):
    qz = quantizer(method, d, bits, rng, **options)
    return qz.quantize(gaussian(rng, 1, 1, 5, d))


@pytest.mark.parametrize("d", [32, 80, 100])
def test_unsupported_head_dim_is_refused(d, rng):
    keys = small_keys(rng, d=d)
    with pytest.raises(ValueError, match=r"supported head dims are \(64, 96, 128, 256\)"):
        kernels.fused_scores(gaussian(rng, 1, 1, 1, d), keys, scale=1.0)


def test_unsupported_norm_dtype_is_refused(rng):
    keys = small_keys(rng, norm_dtype=torch.float32)
    with pytest.raises(ValueError, match="supported norm dtypes"):
        kernels.fused_scores(gaussian(rng, 1, 1, 1, 64), keys, scale=1.0)


def test_group_must_divide_the_query_heads(rng):
    keys = small_keys(rng).map(lambda t: t.expand(1, 2, *t.shape[2:]))
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        kernels.fused_scores(gaussian(rng, 1, 3, 1, 64), keys, scale=1.0)


def test_groups_over_16_are_served(rng):
    keys = small_keys(rng)
    q = gaussian(rng, 1, 20, 2, 64)
    out = kernels.fused_scores(q, keys, scale=1.0, backend="triton")
    ref = reference.fused_scores(q.double(), keys, scale=1.0, dtype=torch.float64)
    assert relative_error(out, ref) <= FP32_TOLERANCE


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    assert kernels.select_backend(cpu) == "triton"  # conftest sets TRITON_INTERPRET=1
    assert kernels.select_backend(cpu, "torch") == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.select_backend(cpu, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.select_backend(cpu) == "torch"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.select_backend(cpu, "triton")


def test_cuda_without_triton_is_a_clear_error(monkeypatch):
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("rqlib.kernels.")]:
        if name not in ("rqlib.kernels.limits", "rqlib.kernels.reference"):
            monkeypatch.delitem(sys.modules, name)
    with pytest.raises(RuntimeError, match="need triton"):
        kernels.select_backend(torch.device("cuda"))


def test_poisoned_buffers_start_as_nan():
    assert bool(launch.empty((3, 4), torch.float32, "cpu").isnan().all())
    assert bool((launch.empty((5,), torch.uint8, "cpu") == 255).all())


def test_aot_list_covers_every_kind_of_layer_format():
    """The formats are compile-time, so the AOT list is a covering set, not every launch: every
    accumulator width launch.py can pick, every code width for keys and for values, every band
    and value kind, QJL, exact streams, softcapped or not, and the presets' layout at every head
    dim and dtype."""
    specs = [s for s in aot.specializations() if s.kernel == "attention_kernel"]
    seen = collections.defaultdict(set)
    for spec in specs:
        for name, value in spec.constexprs.items():
            seen[name].add(value)
        seen["dtype"].add(spec.pointers["v_exact_ptr"])
    widths = {
        geo.value_block(max(d, width))
        for d in geo.SUPPORTED_HEAD_DIMS
        for width in geo.rotated_dims(d)
    }
    assert seen["BLOCK_V"] == widths
    assert seen["head_dim"] == set(geo.SUPPORTED_HEAD_DIMS)
    assert seen["dtype"] == {"fp32", "fp16", "bf16"}
    code_widths = set(range(1, geo.MAX_MSE_BITS + 1))
    assert code_widths <= seen["k_bits"] and code_widths <= seen["v_bits"]
    assert seen["band_k_mode"] == {0, 1, 2} and seen["BAND_VALUE_CODES"] == {0, 1}
    assert seen["k_exact"] == seen["v_exact"] == seen["k_qjl"] == {0, 1}
    assert seen["SOFTCAP"] == {0, 1}
    assert seen["k_trellis_tail_biting"] == seen["v_trellis_tail_biting"] == {0, 1}
    switches = ("SOFTCAP",)
    listed = {
        (
            tuple((k, v) for k, v in spec.constexprs.items() if k not in switches),
            spec.pointers["v_exact_ptr"],
        )
        for spec in specs
    }
    for d, dtype in itertools.product(geo.SUPPORTED_HEAD_DIMS, seen["dtype"]):
        codes = functools.partial(geo.StreamFormat, dim=d, norm_width=11)
        band = codes(bits=8)
        layout = geo.attention_formats(d, codes(bits=3), codes(bits=2), band, band)
        spec = aot.attention_specialization(layout, dtype)
        assert (tuple(spec.constexprs.items()), dtype) in listed, (d, dtype)


@pytest.mark.parametrize(
    ("width", "block", "blocks"),
    [(64, 64, 1), (96, 128, 1), (129, 128, 2), (256, 256, 1), (258, 256, 2), (512, 256, 2)],
)
def test_wide_accumulators_are_cut_into_blocks(width, block, blocks):
    """A program's accumulator has at most 256 columns (wider ones spill registers): a rotor's
    258 value columns at head_dim 256 take two programs. A 256-column block that masks
    columns spills too, so a rotor's 129 at head_dim 128 takes two blocks of 128."""
    assert (geo.value_block(width), geo.value_blocks(width)) == (block, blocks)
    assert geo.accumulator_width(width) == block * blocks >= width


def test_value_widths_beyond_the_kernel_are_refused():
    with pytest.raises(ValueError, match="value width 513 has no kernel"):
        geo.value_block(513)


@triton.jit
def unpack_code_groups(
    codes_ptr, out_ptr, n_rows, dim: tl.constexpr, bits: tl.constexpr, row_bytes: tl.constexpr,
    ROWS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Write the codes ``load_code_groups`` reads from packed rows to ``out`` [n_rows, dim]."""
    rows = tl.arange(0, ROWS)
    key_mask = rows < n_rows
    row_ptrs = codes_ptr + rows[:, None] * row_bytes
    for c0 in range(0, dim, CHUNK):
        codes = load_code_groups(row_ptrs, c0, key_mask, bits, row_bytes, CHUNK)
        cols = c0 + tl.arange(0, CHUNK)
        out = out_ptr + rows[:, None] * dim + cols[None, :]
        tl.store(out, codes, mask=key_mask[:, None] & (cols < dim)[None, :])


def test_code_groups_unpack_what_the_bytes_hold(rng):
    """``load_code_groups`` (eight codes a load, for the attention kernel's compile-time
    formats) returns the codes that ``rqlib.core.packing`` packed, for every width it serves
    (1, 2, 4, 8 as one integer; 3 joined from bytes), rows that are not a power of two in
    number, and a dimension cut into chunks. Exact equality of random codes: a wrong shift,
    lane or byte order changes some."""
    for bits, dim, chunk in [(1, 128, 64), (2, 64, 64), (3, 128, 32), (3, 64, 64), (4, 96, 32),
                             (8, 128, 128)]:  # fmt: skip
        n_rows = 11
        codes = torch.randint(0, 2**bits, (n_rows, dim), generator=rng, dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        assert packed.shape == (n_rows, dim * bits // 8)
        out = torch.full((n_rows, dim), -1, dtype=torch.int32)
        unpack_code_groups[(1,)](packed, out, n_rows, dim, bits, packed.shape[1], 16, chunk)
        assert torch.equal(out, codes.int()), (bits, dim, chunk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_centroid_pairs_are_the_codebook_two_at_a_time(bits, dtype, rng):
    """Through the table of centroid pairs (``numerics.kernel_table``) the kernel reads the
    centroids of the codes that ``rqlib.core.packing`` packed, two a load for widths up to
    ``PAIR_MAX_BITS`` with the codes read eight at a time, one a load otherwise, and zeros for
    masked keys and columns past the row (a chunk that overhangs a 40-code row). Exact
    equality: the table holds the codebook's values bit for bit, and a wrong half, index
    order or mask changes some of the random codes' centroids."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    quantizer = make_quantizer("turboquant-mse", 40, bits, draw=seed)
    table = numerics.kernel_table(quantizer, "cpu", dtype)
    codebook = numerics.kernel_centroids(quantizer, "cpu", dtype)
    n_rows, rows, dim, chunk, width = 11, 16, 40, 32, 64
    codes = torch.randint(0, 2**bits, (n_rows, dim), generator=rng, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    expected = torch.zeros(rows, width, dtype=dtype)
    expected[:n_rows, :dim] = codebook[codes.long()]
    groupable = bits <= 4 or bits == 8  # the widths triton_common.group_loads accepts
    for groups in (True, False) if groupable else (False,):
        out = gather_centroids(
            packed, table, n_rows, dim, bits, rows=rows, width=width, chunk=chunk, groups=groups
        )
        assert torch.equal(out, expected), (bits, dtype, groups)
