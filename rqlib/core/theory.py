"""Closed forms the book checks the library against.

These are the formulas of the TurboQuant and QJL papers that are not part of the quantizers
themselves: the law of one coordinate of a uniformly random unit vector, the MSE estimator's
shrinkage, the QJL variance bound, the second-order costs of both estimators inside a
softmax (the paper's distortion bounds live
with the codebooks, :func:`rqlib.core.codebooks.distortion_bounds`; E|u_1| and the QJL constant
with the quantizers, :func:`rqlib.core.quantizers.mean_abs_coordinate` and
:func:`rqlib.core.quantizers.qjl_gamma`). Each is a one-liner with its
derivation in the docstring; chapter 1 checks each against Monte Carlo.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln

from rqlib.core.codebooks import lloyd_max


def _check_dimension(d: int) -> int:
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 2:
        raise ValueError(f"d must be an integer >= 2, got {d!r}")
    return int(d)


def coordinate_density(t: np.ndarray | float, d: int) -> np.ndarray:
    """Density of one coordinate of a uniformly random unit vector in R^d.

    f_d(t) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - t^2)^((d-3)/2) on [-1, 1]:
    (t + 1)/2 follows Beta((d-1)/2, (d-1)/2). Zero outside [-1, 1]. For large d it approaches
    the N(0, 1/d) density (:func:`gaussian_coordinate_density`).
    """
    d = _check_dimension(d)
    t = np.asarray(t, dtype=np.float64)
    log_norm = gammaln(d / 2) - 0.5 * math.log(math.pi) - gammaln((d - 1) / 2)
    inside = np.abs(t) < 1
    one_minus = np.where(inside, 1.0 - t**2, 1.0)
    density = np.exp(log_norm + (d - 3) / 2 * np.log(one_minus))
    return np.where(inside, density, 0.0)


def gaussian_coordinate_density(t: np.ndarray | float, d: int) -> np.ndarray:
    """The N(0, 1/d) density: the large-d approximation of :func:`coordinate_density`."""
    d = _check_dimension(d)
    t = np.asarray(t, dtype=np.float64)
    return np.sqrt(d / (2 * math.pi)) * np.exp(-d * t**2 / 2)


def mse_shrinkage(distortion: float) -> float:
    """The slope of the MSE-only estimate <q, x_mse> regressed on the truth <q, x>: 1 - D.

    Lloyd-Max centroids are conditional means, so E[c_hat * y] = E[c_hat^2] coordinate-wise,
    hence E<x_mse, x> = E||c_hat||^2 = 1 - D for a unit x. By rotation invariance
    E[x_mse x^T] = (1 - D) I / d while E[x x^T] = I / d; the regression slope is their ratio.
    """
    if not 0.0 <= distortion <= 1.0:
        raise ValueError(f"distortion must lie in [0, 1], got {distortion!r}")
    return 1.0 - distortion


def qjl_variance_bound(m: int, q_norm_sq: float, r_norm_sq: float) -> float:
    """The QJL paper's bound on the variance of the 1-bit estimator: pi / (2 m) ||q||^2 ||r||^2."""
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError(f"m must be an integer >= 1, got {m!r}")
    return math.pi / (2 * int(m)) * float(q_norm_sq) * float(r_norm_sq)


def softmax_error_coefficients(d: int, bits: int) -> dict[str, float]:
    """Second-order costs in a softmax of the two estimators at ``bits`` per coordinate.

    The attention KL of score errors ``ε`` is ``½ Var_p(ε)`` to second order. For unit keys
    in ``R^d`` with the reconstruction ``x_hat = (1 - D) x + n``, ``E||n||^2 = D (1 - D)``:

    - ``mse_bias``: ``D_b^2``, the MSE estimator's shrinkage cost per unit of ``Var_p(s)``;
    - ``mse_noise``: ``D_b (1 - D_b)``, its noise per unit of ``sigma_0^2 = ||q||^2 ||k||^2 / d``;
    - ``qjl_noise``: ``(pi / 2) D_{b-1}``, the noise of QJL with ``m = d`` on the residual of
      ``b - 1`` bits (``D_0 = 1``: QJL alone), per unit of ``sigma_0^2``.
    """
    d = _check_dimension(d)
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    mse = lloyd_max(d, int(bits)).distortion
    residual = lloyd_max(d, int(bits) - 1).distortion if bits > 1 else 1.0
    return {
        "mse_bias": mse**2,
        "mse_noise": mse * (1 - mse),
        "qjl_noise": math.pi / 2 * residual,
    }
