"""The checks the chapters run on their own numbers (rqlib.book.checks).

The central one: chapter 1's unbiasedness check must reject the MSE estimator (slope 1 - D)
and accept QJL (slope 1), on fresh random pairs. Its intervals are Student-t intervals of
independent per-draw slopes; at the confidence used here (1 - 5e-7) a correct estimator is
refused with probability 5e-7 per interval (two intervals per test: 1e-6), and the MSE
estimator's gap to 1 (D >= 0.03 at <= 3 bits) is many half widths wide (at least 4 over 200
random seeds, tests/audit/randomized-200.txt), so the test fails only when the check stops
working.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from rqlib.book import checks
from rqlib.core.codebooks import lloyd_max
from rqlib.core.theory import mse_shrinkage

CONFIDENCE = 1 - 5e-7


def half_widths_from(interval, value: float) -> float:
    """How many half widths of ``interval`` its centre lies from ``value``."""
    centre, half = (interval.low + interval.high) / 2, (interval.high - interval.low) / 2
    return abs(centre - value) / half


@pytest.mark.randomized
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_the_slope_check_rejects_the_mse_estimator_and_accepts_qjl(rng, record_statistic, bits):
    d = 64
    queries, keys = checks.correlated_pairs(128, d, rng)
    first_draw = int(torch.randint(0, 10**6, (1,), generator=rng))
    mse = checks.estimator_slopes("turboquant-mse", bits, queries, keys, 32, first_draw=first_draw)
    prod = checks.estimator_slopes(
        "turboquant-prod", bits, queries, keys, 32, first_draw=first_draw
    )
    mse_interval, prod_interval = mse.interval(CONFIDENCE), prod.interval(CONFIDENCE)
    print(f"{bits} bits: MSE {mse_interval}, QJL {prod_interval}")
    shrinkage = mse_shrinkage(lloyd_max(d, bits).distortion)
    record_statistic(
        "MSE interval: half widths from 1", half_widths_from(mse_interval, 1.0), 1.0, at_least=True
    )
    record_statistic(
        "MSE interval: half widths from 1 - D", half_widths_from(mse_interval, shrinkage), 1.0
    )
    record_statistic("QJL interval: half widths from 1", half_widths_from(prod_interval, 1.0), 1.0)
    assert not mse_interval.contains(1.0), "the check no longer sees the MSE estimator's bias"
    assert mse_interval.contains(shrinkage)
    assert prod_interval.contains(1.0), "the check refuses an unbiased estimator"


def test_slopes_are_independent_draws_of_the_estimator(rng):
    """Different seeds give different quantizers, hence different slopes; the per-pair mean
    estimate is the average of the draws."""
    queries, keys = checks.correlated_pairs(32, 16, rng)
    result = checks.estimator_slopes("turboquant-mse", 2, queries, keys, 4)
    assert len(set(result.slopes.round(12))) == 4
    truth = (queries.double() * keys.double()).sum(-1).numpy()
    assert np.allclose(result.truth, truth)
    assert result.mean_estimate.shape == (32,)
    with pytest.raises(ValueError, match="draws"):
        checks.estimator_slopes("turboquant-mse", 2, queries, keys, 1)
    with pytest.raises(ValueError, match="pairs"):
        checks.estimator_slopes("turboquant-mse", 2, queries, keys[:5], 4)


def test_mean_interval_is_the_student_t_interval():
    interval = checks.mean_interval([1.0, 2.0, 3.0, 4.0], confidence=0.99)
    half = stats.t.ppf(0.995, 3) * np.std([1, 2, 3, 4], ddof=1) / 2
    assert interval.estimate == 2.5 and interval.n == 4
    assert interval.low == pytest.approx(2.5 - half) and interval.high == pytest.approx(2.5 + half)
    assert interval.contains(2.5 + 0.99 * half) and not interval.contains(2.5 + 1.01 * half)
    assert str(interval) == f"2.5000 ± {half:.4f}"
    for bad in ([1.0], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="samples"):
            checks.mean_interval(bad)
    with pytest.raises(ValueError, match="confidence"):
        checks.mean_interval([1.0, 2.0], confidence=1.0)


def test_correlated_pairs_have_the_requested_inner_products(rng):
    q, k = checks.correlated_pairs(9, 32, rng, max_correlation=0.8)
    assert torch.allclose(q.norm(dim=-1), torch.ones(9), atol=1e-6)
    assert torch.allclose(k.norm(dim=-1), torch.ones(9), atol=1e-6)
    assert torch.allclose((q * k).sum(-1), torch.linspace(-0.8, 0.8, 9), atol=1e-6)
    with pytest.raises(ValueError, match="max_correlation"):
        checks.correlated_pairs(9, 32, rng, max_correlation=1.0)


def test_claim_passes_a_true_sentence_and_stops_on_a_false_one():
    assert checks.claim("two is even", 2 % 2 == 0) is None  # nothing to show in a cell
    with pytest.raises(checks.ClaimError, match="three is even"):
        checks.claim("three is even", 3 % 2 == 0)
    with pytest.raises(TypeError, match="bool"):
        checks.claim("a number is not a verdict", 1)
    assert checks.either(np.bool_(True), "wins", "loses") == "wins"
    assert checks.either(False, "wins", "loses") == "loses"


def test_relative_error_sees_a_nan_and_refuses_bad_shapes(rng):
    ref = torch.randn(4, 5, generator=rng)
    assert checks.relative_error(ref, ref) == 0.0
    out = ref.clone()
    out[1, 2] = float("nan")  # an element a kernel forgot to write
    assert math.isnan(checks.relative_error(out, ref))
    with pytest.raises(ValueError, match="shapes"):
        checks.relative_error(ref[:2], ref)


def test_outlier_ratio_of_keys_with_one_loud_channel(rng):
    # float64 keys: scaling by 10 then rounds each element to 1e-16, so the RMS scales by 10
    # to within ~1e-15; in float32 the rounding (6e-8 per element) would not fit rel=1e-9
    keys = torch.randn(1, 2, 4000, 16, generator=rng, dtype=torch.float64)
    rms = checks.channel_rms(keys)
    keys[..., 5] *= 10.0
    loud = checks.channel_rms(keys)
    assert float(loud[5]) == pytest.approx(10 * float(rms[5]), rel=1e-9)
    assert checks.outlier_ratio(keys) == pytest.approx(float(loud.max() / loud.median()))
