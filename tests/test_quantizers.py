"""Quantizers: distortion, the MSE estimator's shrinkage, QJL's unbiasedness and variance.

False failures (a correct library failing by chance) are bounded per run at 1e-6:

- a sample mean compared with its expectation allows Z = 5.33 standard errors: two-sided
  normal tail 1e-7 per assertion (every mean is over >= 2,000 independent terms, or over >= 100
  independent quantizers where the terms of one quantizer share its draw), at most 10 such
  assertions per test;
- a quantity that depends on one draw (a rotation, a sketch) is averaged over many draws, with
  a bound derived from the spread of one draw measured over 1,000 draws (Bernstein's
  inequality, stated where used);
- the other tests are exact identities up to float rounding (tolerances derived from the
  rounding) and cannot fail by chance.

The fast randomized tests are audited over many random seeds by ``make test-seeds``.
"""

import math

import pytest
import torch

from rqlib.core.codebooks import lloyd_max
from rqlib.core.estimator import key_terms
from rqlib.core.quantizers import METHODS, CompressedVectors, make_quantizer

Z = 5.33  # standard errors allowed: two-sided normal tail 1e-7 per assertion


def fresh_seed(rng) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


def unit_vectors(rng, n, d):
    x = torch.randn(n, d, generator=rng)
    return x / x.norm(dim=-1, keepdim=True)


def measured_distortion(quantizer, x):
    return ((x - quantizer.dequantize(quantizer.quantize(x))) ** 2).sum(-1)


@pytest.mark.randomized
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_turboquant_mse_distortion_matches_codebook(rng, record_statistic, d, bits):
    """After a Haar rotation a uniform unit vector is again uniform, whatever the rotation
    drawn, so the per-vector errors are independent with mean the codebook's D_mse exactly.
    The sample mean of 3,000 is within Z standard errors of D (false failure 1e-7)."""
    quantizer = make_quantizer("turboquant-mse", d, bits, draw=fresh_seed(rng))
    errors = measured_distortion(quantizer, unit_vectors(rng, 3_000, d))
    expected = lloyd_max(d, bits).distortion
    print(
        f"turboquant-mse d={d} b={bits}: measured D = {errors.mean().item():.5f}, "
        f"codebook D = {expected:.5f}"
    )
    se = errors.std().item() / math.sqrt(len(errors))
    record_statistic("|mean - D| / SE", abs(errors.mean().item() - expected) / se, Z)


@pytest.mark.randomized
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_estimator_shrinks_inner_products_by_one_minus_distortion(rng, record_statistic, bits):
    """The Lloyd-Max centroid condition gives E⟨x, x̂⟩ = E‖x̂‖² = 1 − D for unit x, so the
    least-squares slope of ⟨q, x̂⟩ on ⟨q, x⟩ over isotropic q is 1 − D: a biased estimator.
    The slope's regression standard error misses the spread of the realized ⟨x, x̂⟩ from
    vector to vector (relative sd sqrt(D/d) ≤ 0.06, so ≤ 0.06/sqrt(n) = 8e-4 on the slope);
    2e-3 covers it 2.4 times over, Z covers the regression noise (false failure 1e-7)."""
    d, n = 128, 20_000
    quantizer = make_quantizer("turboquant-mse", d, bits, draw=fresh_seed(rng))
    x = unit_vectors(rng, n, d)
    q = torch.randn(n, d, generator=rng)
    truth = (q * x).sum(-1)
    estimate = quantizer.inner_product(q, quantizer.quantize(x))
    slope = (estimate * truth).sum() / (truth * truth).sum()
    residual = estimate - slope * truth
    slope_se = residual.std() / truth.norm()
    expected = 1 - lloyd_max(d, bits).distortion
    print(f"bits={bits}: slope {slope.item():.4f}, expected 1 - D = {expected:.4f}")
    margin = Z * slope_se.item() + 2e-3
    record_statistic("|slope - (1 - D)| / margin", abs(slope.item() - expected) / margin, 1.0)
    # the bias is real and detected: 1 - slope ≈ D ≥ 0.009 at 4 bits, over 10 margins away
    record_statistic(
        "(1 - slope) / (Z SE)", (1 - slope.item()) / (Z * slope_se.item()), 1.0, at_least=True
    )


def prod_errors(rng, method, bits, sketch, d=64, quantizers=200, pairs=100, **options):
    """Estimator errors over fresh quantizers (fresh rotation and sketch each): the QJL
    estimator is unbiased over the draw of the sketch, so the sketch must be redrawn.

    Each returned tensor is [quantizers, pairs]: the pairs of one quantizer share its sketch
    and are correlated, so standard errors are taken over the quantizers' means."""
    base = fresh_seed(rng)
    errors, mse_errors, bounds, exact_var = [], [], [], []
    for i in range(quantizers):
        quantizer = make_quantizer(method, d, bits, draw=base + i, qjl_sketch=sketch, **options)
        x = torch.randn(pairs, d, generator=rng) * (1 + torch.rand(pairs, 1, generator=rng))
        q = x + 0.5 * torch.randn(pairs, d, generator=rng)  # correlated: ⟨q, x⟩ is large
        c = quantizer.quantize(x)
        truth = (q * x).sum(-1)
        errors.append(quantizer.inner_product(q, c) - truth)
        mse = (quantizer.rotate_query(q) * key_terms(c)[0]).sum(-1)
        mse_errors.append(mse - truth)
        m = quantizer.qjl_dim
        r_norm = c.residual_norms.float()
        bounds.append(math.pi / (2 * m) * (q * q).sum(-1) * r_norm**2)
        q_dot_r = (q * x).sum(-1) - mse  # ⟨q, r⟩ in original units (up to norm rounding)
        exact_var.append(bounds[-1] - q_dot_r**2 / m)
    return tuple(torch.stack(t) for t in (errors, mse_errors, bounds, exact_var))


def mean_and_se(per_quantizer: torch.Tensor) -> tuple[float, float]:
    """The grand mean of a [quantizers, pairs] tensor and its standard error over quantizers."""
    means = per_quantizer.mean(-1)
    return means.mean().item(), means.std().item() / math.sqrt(len(means))


@pytest.mark.parametrize("method", ["turboquant-prod", "rotorquant-prod"])
@pytest.mark.parametrize("sketch", ["gaussian", "orthogonal"])
def test_prod_estimator_is_unbiased(rng, method, sketch):
    """The mean error over 200 independent quantizers is within Z standard errors of 0 (false
    failure 1e-7); the MSE-only part's shrinkage bias, about D⟨q, x⟩ with ⟨q, x⟩ ≈ 150, is
    hundreds of standard errors away from 0, so its detection cannot fail by chance."""
    errors, mse_errors, _, _ = prod_errors(rng, method, 3, sketch)
    mean, se = mean_and_se(errors)
    print(f"{method}/{sketch}: mean error {mean:+.5f} ± {se:.5f} (SE over quantizers)")
    assert abs(mean) < Z * se
    # the same data shows the MSE-only part is biased: the test has the power to see a bias
    mse_mean, mse_se = mean_and_se(mse_errors)
    assert abs(mse_mean) > Z * mse_se


@pytest.mark.parametrize("sketch", ["gaussian", "orthogonal"])
def test_prod_variance_is_within_the_papers_bound(rng, sketch):
    """Var ≤ π/(2m)‖q‖²‖r‖²; for the Gaussian sketch it equals π/(2m)‖q‖²‖r‖² − ⟨q,r⟩²/m
    exactly. The mean of err² − bound over 100 independent quantizers is compared with 0,
    allowing Z standard errors over the quantizers (false failure 1e-7 per assertion)."""
    errors, _, bounds, exact_var = prod_errors(rng, "turboquant-prod", 3, sketch, quantizers=100)
    over_bound, se_bound = mean_and_se(errors**2 - bounds)
    over_exact, se_exact = mean_and_se(errors**2 - exact_var)
    print(f"{sketch}: E[err² - bound] = {over_bound:.5f} ± {se_bound:.5f}")
    assert over_bound < Z * se_bound
    if sketch == "gaussian":
        assert abs(over_exact) < Z * se_exact
    else:  # orthogonal rows are negatively correlated: below the Gaussian variance
        assert over_exact < Z * se_exact


def test_qjl_dim_larger_than_d_lowers_the_variance(rng):
    """m = 4d should cut the QJL variance about 4x. Over 40 quantizers each mean squared error
    is within 15 % of its expectation except with probability < 1e-7 (Z standard errors over
    the quantizers, relative SE ≤ 2.5 % as measured), so a ratio below 1/2 cannot fail by
    chance: it fails only when the variance does not fall with m."""
    errors_m, _, _, _ = prod_errors(rng, "turboquant-prod", 2, "orthogonal", quantizers=40)
    errors_4m, _, _, _ = prod_errors(
        rng, "turboquant-prod", 2, "orthogonal", quantizers=40, qjl_dim=256
    )
    assert (errors_4m**2).mean() < (errors_m**2).mean() / 2


@pytest.mark.randomized
def test_rotorquant_distortion_on_gaussian_vectors(rng, record_statistic):
    """A block rotation of an isotropic Gaussian vector is isotropic again, whatever the rotors
    drawn, so on such vectors rotor blocks give the codebook's distortion: at d = 96 (a
    multiple of 3) exactly, so the mean of 3,000 independent errors is within Z standard errors
    (false failure 1e-7). At d = 128 the padded last group (two coordinates and a zero) is not
    isotropic and moves the mean by a fixed amount, well under 3 %: Z standard errors (≈ 0.6 %
    of D) plus that shift stay inside 3 %, and the audit shows the margin."""
    for d in (96, 128):
        quantizer = make_quantizer("rotorquant-mse", d, 3, draw=fresh_seed(rng))
        x = torch.randn(3_000, d, generator=rng)
        errors = measured_distortion(quantizer, x) / (x * x).sum(-1)
        print(f"rotorquant-mse d={d} b=3 on Gaussian vectors: D = {errors.mean().item():.5f}")
        expected = lloyd_max(d, 3).distortion
        se = errors.std().item() / math.sqrt(len(errors))
        if d == 96:
            record_statistic("d=96 |mean - D| / SE", abs(errors.mean().item() - expected) / se, Z)
        record_statistic(f"d={d} |mean / D - 1|", abs(errors.mean().item() / expected - 1), 0.03)


def mean_relative_distortion(rng, method, d, draws, vectors, outliers):
    """One mean relative distortion per draw of the rotation: fresh quantizer, fresh vectors."""
    means = []
    for _ in range(draws):
        quantizer = make_quantizer(method, d, 3, draw=fresh_seed(rng))
        x = torch.randn(vectors, d, generator=rng)
        x[:, outliers] *= 12.0
        means.append((measured_distortion(quantizer, x) / (x * x).sum(-1)).mean().item())
    return torch.tensor(means)


@pytest.mark.randomized
def test_rotor_blocks_leave_outliers_dense_rotation_spreads_them(rng, record_statistic):
    """Keys of real models have a few outlier channels. A dense rotation spreads an outlier
    over all coordinates; a rotor only within its group of three, where it overflows the
    codebook. Measured on Gaussian vectors with two channels 12x larger.

    How one dense rotation spreads the two outliers depends on the draw: one draw's mean
    relative distortion X (100 vectors) has sd 0.00132 and |X − D| ≤ 0.0084 over 1,000 draws.
    Averaged over Haar draws the rotated direction is uniform, so E X = D exactly. With
    σ ≤ 0.0015 and |X − D| ≤ 0.02 (margins 14 % and 2.4x over the measured values),
    Bernstein's inequality over 200 independent draws gives
    P(|mean − D| ≥ ε = 0.00136 = 4 % of D) ≤ 2 exp(−200 ε² / (2σ² + 2 · 0.02 ε / 3)) = 2e-7.

    A rotor cannot spread an outlier beyond its group: at best it splits it evenly over three
    coordinates at 0.34 of the norm each, beyond the codebook's largest level 0.19, which
    costs at least 0.14 in relative distortion for the two groups (measured over 1,000 draws:
    0.17 at least, 0.23 on average), against 3 x 1.04 D = 0.106 on the dense side: the
    ratio cannot fall below 3 by chance."""
    d, outliers = 128, [5, 77]
    dense = mean_relative_distortion(rng, "turboquant-mse", d, 200, 100, outliers)
    rotor = mean_relative_distortion(rng, "rotorquant-mse", d, 10, 100, outliers)
    print(f"relative distortion with outliers: dense {dense.mean():.5f}, rotor {rotor.mean():.5f}")
    d_mse = lloyd_max(d, 3).distortion
    record_statistic("dense |mean / D - 1|", abs(dense.mean().item() / d_mse - 1), 0.04)
    record_statistic("rotor / dense", rotor.mean().item() / dense.mean().item(), 3.0, at_least=True)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_inner_product_equals_dot_with_reconstruction(rng, method, bits):
    quantizer = make_quantizer(method, 96, bits, draw=fresh_seed(rng))
    x, q = torch.randn(64, 96, generator=rng), torch.randn(64, 96, generator=rng)
    c = quantizer.quantize(x)
    # float32 sums over 96 products of O(1) terms: 1e-4 absolute
    torch.testing.assert_close(
        quantizer.inner_product(q, c), (q * quantizer.dequantize(c)).sum(-1), atol=1e-4, rtol=1e-4
    )
    # broadcasting: all query-key pairs at once
    pairs = quantizer.inner_product(q[:5, None, :], c.map(lambda t: t[None, :7]))
    assert pairs.shape == (5, 7)


def test_storage_accounting(rng):
    assert make_quantizer("turboquant-mse", 128, 3).bits_per_vector == 3 * 128 + 16
    assert make_quantizer("turboquant-prod", 128, 3).bits_per_vector == 2 * 128 + 16 + 128 + 16
    assert make_quantizer("turboquant-prod", 64, 4, qjl_dim=100).bits_per_vector == (
        3 * 64 + 16 + 104 + 16  # 100 sign bits occupy 13 bytes
    )
    # rotor pads 128 to 129 coordinates: 387 code bits in 49 bytes
    assert make_quantizer("rotorquant-mse", 128, 3).bits_per_vector == 49 * 8 + 16
    assert make_quantizer("turboquant-mse", 64, 3, norm_dtype=torch.float32).bits_per_vector == (
        3 * 64 + 32
    )
    x = torch.randn(10, 128, generator=rng)  # sizes only: cannot fail by chance
    quantizer = make_quantizer("turboquant-prod", 128, 3)
    assert quantizer.quantize(x).nbytes() * 8 == 10 * quantizer.bits_per_vector


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes_and_zero_vectors(rng, dtype):
    quantizer = make_quantizer("turboquant-prod", 64, 3, draw=fresh_seed(rng))
    x = torch.randn(8, 64, generator=rng).to(dtype)
    x[3] = 0
    c = quantizer.quantize(x)
    out = quantizer.dequantize(c)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.equal(out[3], torch.zeros(64))
    assert quantizer.inner_product(torch.randn(64, generator=rng), c)[3].item() == 0.0


def test_cat_and_map(rng):
    quantizer = make_quantizer("rotorquant-prod", 64, 3, draw=fresh_seed(rng))
    a = quantizer.quantize(torch.randn(2, 3, 64, generator=rng))
    b = quantizer.quantize(torch.randn(2, 5, 64, generator=rng))
    joined = CompressedVectors.cat([a, b], dim=1)
    assert joined.shape == (2, 8)
    torch.testing.assert_close(
        quantizer.dequantize(joined)[:, 3:], quantizer.dequantize(b), atol=1e-6, rtol=1e-5
    )  # same codes; only the float32 summation order of the batched inverse rotation differs
    assert torch.equal(joined.codes[:, 3:], b.codes)
    with pytest.raises(ValueError, match="different quantizers"):
        CompressedVectors.cat(
            [a, make_quantizer("rotorquant-prod", 64, 3).quantize(torch.ones(2, 1, 64))], 1
        )


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: make_quantizer("turboquant-mse", 64, 0), ValueError, "bits must be"),
        (lambda: make_quantizer("turboquant-mse", 64, 9), ValueError, "bits must be"),
        (lambda: make_quantizer("turboquant-mse", 1, 3), ValueError, "d must be"),
        (lambda: make_quantizer("polarquant", 64, 3), ValueError, "method must be"),
        (
            lambda: make_quantizer("turboquant-mse", 64, 3, rotation="givens"),
            ValueError,
            "rotation must be",
        ),
        (
            lambda: make_quantizer("turboquant-prod", 64, 3, qjl_sketch="sparse"),
            ValueError,
            "qjl_sketch must be",
        ),
        (lambda: make_quantizer("turboquant-prod", 64, 3, qjl_dim=0), ValueError, "qjl_dim"),
        (lambda: make_quantizer("turboquant-mse", 64, 3, qjl_dim=64), ValueError, "-prod"),
        (
            lambda: make_quantizer("turboquant-mse", 64, 3, norm_dtype=torch.int8),
            ValueError,
            "norm_dtype",
        ),
        (
            lambda: make_quantizer("turboquant-mse", 64, 3).quantize(torch.zeros(4, 65)),
            ValueError,
            "last dimension d=64",
        ),
        (
            lambda: make_quantizer("turboquant-mse", 64, 3).quantize(
                torch.zeros(4, 64, dtype=torch.int32)
            ),
            TypeError,
            "float16, bfloat16",
        ),
        (
            lambda: make_quantizer("turboquant-mse", 64, 3).quantize(torch.full((2, 64), math.nan)),
            ValueError,
            "NaN or infinite",
        ),
        (
            lambda: make_quantizer("turboquant-mse", 64, 3).quantize(torch.full((2, 64), 1e5)),
            ValueError,
            "overflows",
        ),
        (
            lambda: make_quantizer("turboquant-mse", 64, 3).sketch_query(torch.zeros(64)),
            ValueError,
            "no QJL",
        ),
    ],
)
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("mantissa_bits", [3, 6, 9])
def test_norm_mantissa_rounding_is_nearest_and_representable(mantissa_bits, rng):
    from rqlib.core.quantizers import round_fp16_mantissa

    # positive fp16 values over the whole normal range, plus exact powers of two
    exponents = torch.randint(-14, 15, (5000,), generator=rng).float()
    values = (torch.rand(5000, generator=rng) + 1) * 2.0**exponents
    values = torch.cat([values, 2.0 ** torch.arange(-14.0, 15.0)]).to(torch.float16)
    rounded = round_fp16_mantissa(values, mantissa_bits)
    dropped = 10 - mantissa_bits
    assert (rounded.view(torch.int16) & ((1 << dropped) - 1) == 0).all()  # e5m<m> exactly
    # round to nearest: relative error at most half a unit of the kept mantissa, 2^-(m+1)
    relative = ((rounded.float() - values.float()) / values.float()).abs()
    assert relative.max().item() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6)
    assert torch.equal(round_fp16_mantissa(values, 10), values)
    with pytest.raises(ValueError, match="non-negative"):
        round_fp16_mantissa(-values, mantissa_bits)


@pytest.mark.randomized
def test_norm_mantissa_bits_are_counted_and_barely_change_the_distortion(rng):
    d, bits = 128, 5
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    full = make_quantizer("turboquant-mse", d, bits, draw=seed)
    short = make_quantizer("turboquant-mse", d, bits, draw=seed, norm_mantissa_bits=6)
    assert full.bits_per_vector == 5 * 128 + 16 and short.bits_per_vector == 5 * 128 + 11
    # norms over two and a half decades; never zero (float32 rand gives 0 with probability
    # 2^-24 a row, and a zero row's relative error is 0/0)
    x = torch.randn(3_000, d, generator=rng) * (0.01 + torch.rand(3_000, 1, generator=rng)) * 50
    error_full = (full.dequantize(full.quantize(x)) - x).pow(2).sum(-1) / x.pow(2).sum(-1)
    error_short = (short.dequantize(short.quantize(x)) - x).pow(2).sum(-1) / x.pow(2).sum(-1)
    # the norm's relative error is at most 2^-7, so it adds at most (2^-7)^2 = 6.1e-5 to a
    # relative distortion of D(5 bits) ~ 2.5e-3: the means must agree within 3 % (7.5e-5). The
    # cross term 2ε⟨x − x̂, x̂⟩/‖x‖² averages to 0 with sd ≤ 2 · 2^-7 · sqrt(D/d) = 1.4e-4 per
    # vector, 2.6e-6 for the mean of 3,000: the 3 % cannot be missed by chance (> 20 sd)
    assert error_short.mean().item() == pytest.approx(error_full.mean().item(), rel=0.03)
    assert (error_short - error_full).abs().max().item() <= 2 * 2.0**-7 + 1e-4
    with pytest.raises(ValueError, match="float16"):
        make_quantizer("turboquant-mse", d, 3, norm_dtype=torch.float32, norm_mantissa_bits=6)
    with pytest.raises(ValueError, match="1..10"):
        make_quantizer("turboquant-mse", d, 3, norm_mantissa_bits=11)
