"""The Triton kernels under TRITON_INTERPRET=1 against float64 torch references.

Shapes are small and irregular (kv_len never a multiple of a tile, q_len 1 and 7, batch 2, GQA
1/3/8, head_dim 64/96/128/256 with dense, Hadamard, rotor and no rotation, code bits 0..5, both
QJL sketches) because the interpreter's cost grows with programs x operations. Every output and
scratch buffer starts as NaN (``launch.POISON_BUFFERS``), so an element a kernel does not write
fails the comparison.

Tolerances. Errors are measured as max|out - ref| / max|ref| against a float64 reference fed
the same stored codes, norms and (already rounded) inputs. fp32 kernels accumulate at most
D + m <= 1282 products per score and one softmax over <= 200 keys, so the rounding error is of
order sqrt(D) * 2^-24 ~ 1e-6 relative; 1e-5 leaves a 10x margin and still fails on any logic
error (a wrong code, sign, norm or mask changes results at the 1e-2 level). fp16 / bf16
queries and values are converted to fp32 exactly, so the same 1e-5 applies to scores; decode
outputs returned in fp16 / bf16 add one rounding of 2^-11 / 2^-8 relative, hence 1e-3 / 8e-3.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from rqlib import kernels
from rqlib.core.packing import unpack_bits, unpack_signs
from rqlib.core.quantizers import make_quantizer
from rqlib.kernels import launch, reference
from rqlib.kernels import limits as geo

pytestmark = pytest.mark.interpreter

FP32_TOLERANCE = 1e-5
OUTPUT_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


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
    return make_quantizer(method, d, bits, seed=random_seed(rng), **options)


def gaussian(rng, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=rng).to(dtype)


# --------------------------------------------------------------------------------------------
# fused_scores

# (method, bits, d, options, batch, kv_heads, group, q_len, kv_len, q dtype)
SCORE_CASES = [
    ("turboquant-prod", 3, 128, {}, 2, 2, 3, 7, 77, torch.float32),
    ("turboquant-prod", 2, 64, {"qjl_sketch": "orthogonal"}, 2, 1, 8, 1, 100, torch.float16),
    ("rotorquant-prod", 4, 96, {"qjl_dim": 40}, 1, 2, 1, 7, 45, torch.bfloat16),
    ("turboquant-mse", 1, 256, {"rotation": "hadamard"}, 2, 1, 3, 1, 70, torch.float32),
    ("rotorquant-mse", 3, 256, {}, 1, 1, 1, 7, 33, torch.float32),
    ("turboquant-prod", 1, 128, {"rotation": "none"}, 2, 2, 1, 1, 65, torch.float32),
    ("turboquant-mse", 5, 64, {}, 1, 3, 3, 2, 50, torch.float32),
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


# --------------------------------------------------------------------------------------------
# decode_attention

# (key method, key bits, d, key options, value: dtype or (method, bits, options), batch,
#  kv_heads, group, kv_len, n_sink, n_recent, window, partition, q dtype)
DECODE_CASES = [
    ("turboquant-prod", 3, 128, {}, torch.float32, 2, 2, 4, 150, 0, 0, None, 64, torch.float32),
    ("turboquant-mse", 4, 64, {}, torch.float16, 1, 1, 8, 130, 0, 0, 40, 32, torch.float16),
    ("rotorquant-prod", 2, 96, {}, torch.bfloat16, 2, 1, 3, 75, 0, 0, 1, 16, torch.bfloat16),
    (
        "turboquant-prod",
        3,
        128,
        {"qjl_sketch": "orthogonal"},
        ("turboquant-mse", 4, {}),
        1,
        2,
        4,
        200,
        4,
        20,
        None,
        64,
        torch.float32,
    ),
    (
        "rotorquant-mse",
        3,
        256,
        {},
        ("rotorquant-mse", 4, {}),
        1,
        1,
        1,
        150,
        1,
        7,
        100,
        48,
        torch.float32,
    ),
    (
        "turboquant-prod",
        1,
        64,
        {},
        ("turboquant-mse", 2, {"rotation": "hadamard"}),
        2,
        1,
        2,
        90,
        0,
        16,
        None,
        32,
        torch.float32,
    ),
    ("turboquant-mse", 2, 64, {}, torch.float32, 1, 2, 3, 100, 3, 33, 60, 32, torch.float32),
    (
        "turboquant-mse",
        3,
        64,
        {},
        ("turboquant-mse", 3, {}),
        1,
        1,
        3,
        20,
        8,
        16,
        None,
        16,
        torch.float32,
    ),
]


def decode_case_id(case) -> str:
    method, bits, d, _, values, batch, kv, group, kv_len, sink, recent, window, part, dt = case
    v = values if isinstance(values, torch.dtype) else f"{values[0]}{values[1]}"
    return (
        f"{method}-{bits}b-d{d}-V{v}-B{batch}KV{kv}G{group}S{kv_len}"
        f"-sink{sink}-recent{recent}-win{window}-part{part}-{dt}"
    )


@pytest.mark.parametrize("case", DECODE_CASES, ids=decode_case_id)
def test_decode_attention_matches_float64_softmax(case, rng):
    method, bits, d, options, values_spec, batch, kv_heads, group = case[:8]
    kv_len, n_sink, n_recent, window, partition, q_dtype = case[8:]
    key_qz = quantizer(method, d, bits, rng, **options)
    k = gaussian(rng, batch, kv_heads, kv_len, d) * 2
    v = gaussian(rng, batch, kv_heads, kv_len, d)
    keys = key_qz.quantize(k)
    q = gaussian(rng, batch, kv_heads * group, 1, d, dtype=q_dtype)
    exact = {}
    if isinstance(values_spec, torch.dtype):
        values = v.to(values_spec)
    else:
        value_method, value_bits, value_options = values_spec
        values = quantizer(value_method, d, value_bits, rng, **value_options).quantize(v)
        if n_sink:
            exact["sink_values"] = v[:, :, :n_sink]
        if n_recent:
            exact["recent_values"] = v[:, :, kv_len - n_recent :]
    if n_sink:
        exact["sink_keys"] = k[:, :, :n_sink]
    if n_recent:
        exact["recent_keys"] = k[:, :, kv_len - n_recent :]
    scale = 1 / math.sqrt(d)

    out = kernels.decode_attention(
        q,
        keys,
        values,
        scale=scale,
        window=window,
        partition_size=partition,
        backend="triton",
        **exact,
    )
    values64 = values.double() if isinstance(values, torch.Tensor) else values
    exact64 = {name: t.double() for name, t in exact.items()}
    ref = reference.decode_attention(
        q.double(), keys, values64, scale=scale, window=window, dtype=torch.float64, **exact64
    )
    assert out.shape == ref.shape and out.dtype == q_dtype
    assert relative_error(out, ref) <= OUTPUT_TOLERANCE[q_dtype]

    torch_out = kernels.decode_attention(
        q, keys, values, scale=scale, window=window, backend="torch", **exact
    )
    assert relative_error(torch_out, ref) <= OUTPUT_TOLERANCE[q_dtype]


def test_decode_reference_is_softmax_of_scores(rng):
    """The oracle itself: with no exact tokens it is softmax(fused scores) . V, written out."""
    qz = quantizer("turboquant-prod", 64, 3, rng)
    keys = qz.quantize(gaussian(rng, 1, 2, 30, 64))
    v = gaussian(rng, 1, 2, 30, 64, dtype=torch.float64)
    q = gaussian(rng, 1, 4, 1, 64, dtype=torch.float64)
    scores = reference.fused_scores(q, keys, scale=0.3, dtype=torch.float64)
    scores[..., :10] = float("-inf")  # window 20 of 30
    expected = torch.softmax(scores, -1) @ v.repeat_interleave(2, dim=1)
    got = reference.decode_attention(q, keys, v, scale=0.3, window=20, dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)  # same float64 operations


def test_strided_cache_views(rng):
    """Caches are views (a prefix of a preallocated buffer, a [B, S, KV] layout transposed):
    the kernels take the strides, not a contiguous copy's layout."""
    d, kv_len = 64, 70
    qz = quantizer("turboquant-prod", d, 3, rng)
    stored = qz.quantize(gaussian(rng, 2, kv_len + 11, 2, d))  # [B, S_max, KV]
    keys = stored.map(lambda t: t[:, :kv_len].transpose(1, 2))  # [B, KV, S], non-contiguous
    values_buffer = gaussian(rng, 2, kv_len + 11, 2, d)
    values = values_buffer[:, :kv_len].transpose(1, 2)
    q = gaussian(rng, 2, 4, 1, d)
    assert not keys.codes.is_contiguous() and not values.is_contiguous()
    scores = kernels.fused_scores(q, keys, scale=0.2, backend="triton")
    ref = reference.fused_scores(q.double(), keys, scale=0.2, dtype=torch.float64)
    assert relative_error(scores, ref) <= FP32_TOLERANCE
    out = kernels.decode_attention(q, keys, values, scale=0.2, partition_size=32, backend="triton")
    ref = reference.decode_attention(
        q.double(), keys, values.double(), scale=0.2, dtype=torch.float64
    )
    assert relative_error(out, ref) <= FP32_TOLERANCE


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


@pytest.mark.parametrize("q_heads", [3, 17])
def test_unsupported_group_is_refused(q_heads, rng):
    keys = small_keys(rng)
    keys = keys.map(lambda t: t.expand(1, 2, *t.shape[2:]) if q_heads == 3 else t)
    with pytest.raises(ValueError, match="KV heads|query heads per KV head"):
        kernels.fused_scores(gaussian(rng, 1, q_heads, 1, 64), keys, scale=1.0)


def test_bad_decode_inputs_are_refused(rng):
    keys = small_keys(rng)
    v = gaussian(rng, 1, 1, 5, 64)
    q = gaussian(rng, 1, 2, 1, 64)
    values_qz = quantizer("turboquant-mse", 64, 2, rng)
    compressed = values_qz.quantize(v)
    prod_values = quantizer("turboquant-prod", 64, 3, rng).quantize(v)
    cases = [
        (dict(q=gaussian(rng, 1, 2, 2, 64)), "one query position"),
        (dict(window=0), "window"),
        (dict(values=prod_values), "MSE quantizer"),
        (dict(sink_values=v[:, :, :1], sink_keys=v[:, :, :1]), "only for compressed values"),
        (dict(values=compressed, sink_keys=v[:, :, :1]), "together"),
        (dict(partition_size=24), "multiple of 16"),
        (dict(values=v[:, :, :4]), "values must be"),
        (dict(recent_keys=gaussian(rng, 1, 1, 6, 64)), "holds 6 tokens"),
        (dict(values=v.double()), "dtype"),
    ]
    for overrides, message in cases:
        arguments = dict(q=q, keys=keys, values=v, scale=1.0)
        arguments.update(overrides)
        with pytest.raises(ValueError, match=message):
            kernels.decode_attention(**arguments)


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


def test_aot_list_covers_every_value_width():
    """Every accumulator width launch.py can pick is in the AOT list."""
    full, compressed = set(), set()
    for d in geo.SUPPORTED_HEAD_DIMS:
        full.add(geo.value_block(d))
        for width in geo.rotated_dims(d):
            compressed.add(geo.value_block(max(width, d)))
    from rqlib.kernels.aot import specializations

    listed = {
        (s.constexprs["V_COMPRESSED"], s.constexprs["BLOCK_V"])
        for s in specializations()
        if s.kernel == "decode_partition_kernel"
    }
    assert listed == {(False, b) for b in full} | {(True, b) for b in compressed}
