"""rqlib.core.theory: the closed forms chapter 1 checks the library against."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from rqlib.core.quantizers import mean_abs_coordinate
from rqlib.core.theory import (
    coordinate_density,
    gaussian_coordinate_density,
    mse_shrinkage,
    qjl_variance_bound,
)


@pytest.mark.parametrize("d", [2, 3, 5, 16, 64, 128, 1024])
def test_density_is_the_shifted_beta_law(d):
    total, _ = integrate.quad(lambda t: coordinate_density(t, d), -1, 1, limit=200)
    # quad's own error estimate is ~1e-10 here; 1e-6 leaves room for the d = 2 endpoint
    # singularity (the density is integrable but unbounded at +-1)
    assert total == pytest.approx(1.0, abs=1e-6)
    t = np.linspace(-0.99, 0.99, 41)
    beta = stats.beta.pdf((t + 1) / 2, (d - 1) / 2, (d - 1) / 2) / 2
    np.testing.assert_allclose(coordinate_density(t, d), beta, rtol=1e-9)
    assert np.all(coordinate_density(np.array([-1.5, 1.0, 2.0]), d) == 0)


@pytest.mark.randomized
def test_density_matches_random_unit_vectors(rng, record_statistic):
    """Independent samples from the law itself: the KS p-value is uniform, so p > 1e-7 fails
    with probability 1e-7; the mean |coordinate| is within 5.33 standard errors (two-sided
    normal tail 1e-7). False-failure rate 2e-7."""
    d, n = 24, 60000
    g = torch.randn(n, d, generator=rng, dtype=torch.float64)
    first = (g[:, 0] / g.norm(dim=1)).numpy()
    # the CDF of the shifted Beta law, which test_density_is_the_shifted_beta_law proves equal
    # to the integral of coordinate_density
    result = stats.kstest(first, lambda s: stats.beta.cdf((s + 1) / 2, (d - 1) / 2, (d - 1) / 2))
    record_statistic("KS p-value", result.pvalue, 1e-7, at_least=True)
    se = np.abs(first).std() / math.sqrt(n)
    record_statistic(
        "|mean |t| - E|t|| / SE", abs(np.abs(first).mean() - mean_abs_coordinate(d)) / se, 5.33
    )


def test_gaussian_limit():
    t = np.linspace(-0.2, 0.2, 21)
    near = np.abs(coordinate_density(t, 4096) - gaussian_coordinate_density(t, 4096)).max()
    far = np.abs(coordinate_density(t, 16) - gaussian_coordinate_density(t, 16)).max()
    assert near < far / 10  # the Beta law converges to N(0, 1/d) as d grows


def test_closed_forms_and_their_errors():
    assert mse_shrinkage(0.03454) == pytest.approx(1 - 0.03454)
    assert qjl_variance_bound(128, 2.0, 3.0) == pytest.approx(math.pi / 256 * 6)
    with pytest.raises(ValueError, match="distortion"):
        mse_shrinkage(1.5)
    with pytest.raises(ValueError, match="m must"):
        qjl_variance_bound(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="d must"):
        coordinate_density(0.0, 1)
