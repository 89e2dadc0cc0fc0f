"""Checks a chapter runs on its own numbers: intervals, estimator slopes, kernel errors, claims.

Every conclusion a chapter states in words is computed here or in the chapter and then either
glued into the sentence (:func:`either` picks the words that are true) or asserted
(:func:`claim` stops the build with the sentence that no longer holds), so that a parameter file
that changes a result changes the prose or fails, and never leaves a stale sentence behind.

The unbiasedness check of chapter 1 looks where a bias of the inner-product estimators lives:
it is multiplicative (the MSE estimate is the truth times ``1 - D``), so a mean error over
random pairs, whose truths average zero, cannot see it. :func:`estimator_slopes` fixes a set of
query/key pairs with inner products spread over ``[-rho, rho]`` and draws many independent
quantizers (rotation and sketch); each draw gives one least-squares slope of the estimate on
the truth. The draws are independent, so their mean has a Student-t confidence interval
(:func:`mean_interval`), and its expectation is exactly ``1 - D`` for the MSE estimator and 1
for QJL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from rqlib.core.quantizers import make_quantizer

__all__ = [
    "ClaimError",
    "Interval",
    "SlopeDraws",
    "channel_rms",
    "claim",
    "correlated_pairs",
    "either",
    "estimator_slopes",
    "mean_interval",
    "outlier_ratio",
    "random_unit_vectors",
    "relative_error",
]


class ClaimError(AssertionError):
    """A sentence of the book that the chapter's own numbers no longer support."""


def claim(statement: str, holds: bool) -> None:
    """Do nothing when ``holds``; otherwise raise :class:`ClaimError` quoting ``statement``.

    A chapter calls this for every conclusion its prose states, so that a run whose numbers
    contradict the text fails instead of printing it.
    """
    if not isinstance(statement, str) or not statement.strip():
        raise ValueError(f"statement must be a non-empty sentence, got {statement!r}")
    if not isinstance(holds, (bool, np.bool_)):
        raise TypeError(f"holds must be a bool, got {type(holds).__name__} ({holds!r})")
    if not holds:
        raise ClaimError(f"the book states {statement!r}, but this run's numbers contradict it")


def either(holds: bool, if_true: str, if_false: str) -> str:
    """The words that are true of this run: ``if_true`` when ``holds``, else ``if_false``."""
    if not isinstance(holds, (bool, np.bool_)):
        raise TypeError(f"holds must be a bool, got {type(holds).__name__} ({holds!r})")
    return if_true if holds else if_false


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided Student-t confidence interval."""

    estimate: float
    low: float
    high: float
    confidence: float
    n: int

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies inside the interval (the test at level 1 - confidence keeps
        the hypothesis that the mean is ``value``)."""
        return bool(self.low <= value <= self.high)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        return f"{self.estimate:.4f} ± {self.half_width:.4f}"


def mean_interval(samples: np.ndarray | list[float], confidence: float = 0.99) -> Interval:
    """The mean of independent ``samples`` and its Student-t interval at ``confidence``."""
    values = np.asarray(samples, dtype=np.float64).ravel()
    if values.size < 2 or not np.all(np.isfinite(values)):
        raise ValueError(f"need at least two finite samples, got {values.size}: {values[:5]}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    mean = float(values.mean())
    half = stats.t.ppf(0.5 + confidence / 2, values.size - 1) * values.std(ddof=1)
    half /= math.sqrt(values.size)
    return Interval(mean, mean - half, mean + half, confidence, int(values.size))


def random_unit_vectors(n: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` independent uniformly random unit vectors in ``R^d`` (normalized Gaussians)."""
    g = torch.randn(n, d, generator=generator)
    return g / g.norm(dim=-1, keepdim=True)


def correlated_pairs(
    n: int, d: int, generator: torch.Generator, max_correlation: float = 0.9
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` pairs of unit vectors ``(q, k)`` in ``R^d`` with ``<q, k>`` evenly spread over
    ``[-max_correlation, max_correlation]`` (random directions otherwise): pairs whose truths
    are large, so that a slope of estimate on truth is measured sharply."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an integer >= 2, got {n!r}")
    if isinstance(d, bool) or not isinstance(d, int) or d < 2:
        raise ValueError(f"d must be an integer >= 2, got {d!r}")
    if not 0.0 < max_correlation < 1.0:
        raise ValueError(f"max_correlation must lie in (0, 1), got {max_correlation!r}")
    q = torch.randn(n, d, generator=generator, dtype=torch.float64)
    q = q / q.norm(dim=-1, keepdim=True)
    u = torch.randn(n, d, generator=generator, dtype=torch.float64)
    u = u - (u * q).sum(-1, keepdim=True) * q  # orthogonal to q
    u = u / u.norm(dim=-1, keepdim=True)
    rho = torch.linspace(-max_correlation, max_correlation, n, dtype=torch.float64)
    k = rho[:, None] * q + torch.sqrt(1 - rho**2)[:, None] * u
    return q.float(), k.float()


@dataclass(frozen=True)
class SlopeDraws:
    """The estimates of one estimator over fixed pairs, for many independent draws of it."""

    truth: np.ndarray  # [pairs] <q, k>
    mean_estimate: np.ndarray  # [pairs] the estimate averaged over the draws
    slopes: np.ndarray  # [draws] one least-squares slope through the origin per draw

    def interval(self, confidence: float = 0.99) -> Interval:
        """The mean slope with its Student-t interval (the draws are independent)."""
        return mean_interval(self.slopes, confidence)


def estimator_slopes(
    method: str,
    bits: int,
    queries: torch.Tensor,
    keys: torch.Tensor,
    draws: int,
    *,
    first_draw: int = 0,
    **options,
) -> SlopeDraws:
    """``Quantizer.inner_product`` over the fixed pairs for ``draws`` independent quantizers
    (``make_quantizer(method, d, bits, draw=first_draw + i, **options)``): per draw, the
    least-squares slope through the origin of the estimate on the truth ``<q, k>``.

    The slopes are independent and identically distributed; their expectation is the
    estimator's slope averaged over its randomness (``1 - D`` for ``-mse``, 1 for ``-prod``).
    """
    if queries.shape != keys.shape or queries.ndim != 2:
        raise ValueError(
            f"queries and keys must both be [pairs, d], got {tuple(queries.shape)} and "
            f"{tuple(keys.shape)}"
        )
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 2:
        raise ValueError(f"draws must be an integer >= 2, got {draws!r}")
    truth = (queries.double() * keys.double()).sum(-1)
    energy = float((truth * truth).sum())
    if energy == 0.0:
        raise ValueError("every pair has <q, k> = 0: the slope is undefined")
    slopes = np.empty(draws)
    total = torch.zeros_like(truth)
    for i in range(draws):
        quantizer = make_quantizer(method, keys.shape[-1], bits, draw=first_draw + i, **options)
        estimate = quantizer.inner_product(queries, quantizer.quantize(keys)).double()
        slopes[i] = float((estimate * truth).sum()) / energy
        total += estimate
    return SlopeDraws(truth.numpy(), (total / draws).numpy(), slopes)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|``; a NaN anywhere in ``out`` makes it NaN, which fails any
    bound (kernels' outputs start as NaN in the chapter's checks)."""
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} against {tuple(ref.shape)}")
    scale = ref.double().abs().max()
    if scale == 0:
        raise ValueError("the reference is all zeros: a relative error is undefined")
    return float((out.double() - ref.double()).abs().max() / scale)


def channel_rms(keys: torch.Tensor) -> torch.Tensor:
    """Root-mean-square of each channel of ``keys [..., channels]`` over everything else."""
    return keys.double().pow(2).reshape(-1, keys.shape[-1]).mean(dim=0).sqrt()


def outlier_ratio(keys: torch.Tensor) -> float:
    """The largest channel RMS over the median channel RMS of ``keys [..., channels]``."""
    rms = channel_rms(keys)
    return float(rms.max() / rms.median())
