"""The flakiness audit's tail fit (``conftest.tail_rate``) recovers known tails.

The inputs are exact quantiles of known laws (no random draw), so these tests cannot fail by
chance: a fit that is off is off every time.
"""

import math

import pytest
from conftest import tail_rate


def quantiles(inverse_cdf, n=5_000):
    """n values spread as the law's quantiles at (i + 1/2) / n: a sample without noise."""
    return [inverse_cdf((i + 0.5) / n) for i in range(n)]


@pytest.mark.parametrize(
    ("law", "inverse_cdf", "bound", "true_rate"),
    [
        # exponential: a tail with shape 0, P(X > 14) = e^-14
        ("exponential", lambda u: -math.log(1 - u), 14.0, math.exp(-14)),
        # Pareto with index 3 (shape 1/3): P(X > 100) = 100^-3
        ("pareto-3", lambda u: (1 - u) ** (-1 / 3), 100.0, 1e-6),
    ],
)
def test_tail_fit_extrapolates_a_known_tail(law, inverse_cdf, bound, true_rate):
    rate, heavier, shape = tail_rate(quantiles(inverse_cdf), bound, at_least=False)
    # far beyond the largest of 5,000 values (about 8.5 and 17), within a factor of 3
    assert true_rate / 3 <= rate <= 3 * true_rate, (law, rate, shape)
    assert heavier >= rate  # the fit's uncertainty only widens the rate


def test_tail_fit_reads_lower_bounds_and_bounds_inside_the_values():
    # a lower bound: the values' left tail, here the mirrored exponential
    rate, _, _ = tail_rate(quantiles(lambda u: 20 + math.log(u)), 6.0, at_least=True)
    assert math.exp(-14) / 3 <= rate <= 3 * math.exp(-14)
    # a bound among the values gets the share beyond it, and a tighter bound a larger rate
    values = quantiles(lambda u: -math.log(1 - u))
    inside, _, _ = tail_rate(values, 3.0, at_least=False)
    assert inside == pytest.approx(math.exp(-3), rel=0.01)
    assert tail_rate(values, 10.0, at_least=False)[0] < tail_rate(values, 8.0, at_least=False)[0]
