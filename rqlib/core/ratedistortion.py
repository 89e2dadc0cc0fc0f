"""Rate and distortion of codes for vectors whose errors are weighted: bound and transform code.

The error of a key that matters is the error of the scores, ``<q, k - k_hat>``; its mean square
over queries is ``e^T M e`` with ``M = E[q q^T]``, the queries' second moment (for values, ``M``
is what ``o_proj`` makes of an error; see :mod:`rqlib.study.bound`). With ``W = M^(1/2)`` the
weighted error is the plain squared error of ``W e``, so the problem is that of coding ``z =
W (k - mu)`` in plain MSE. Its components along the eigenvectors of ``C = W Cov(k) W`` are
uncorrelated with variances ``lambda_i`` (the *weighted spectrum*).

- :func:`reverse_water_filling` is the Shannon bound for Gaussian components of those
  variances: at ``R`` bits a component on average, component ``i`` gets ``max(0, 1/2 log2
  (lambda_i / theta))`` bits and distortion ``min(lambda_i, theta)``, for the water level
  ``theta`` that spends exactly ``R``. No code of that rate does better on a Gaussian source.
- :class:`TransformCode` is a code that follows it: the calibrated transform ``T = U^T W``
  (so that ``T (k - mu)`` has the uncorrelated components), one gain per vector, and a scalar
  Lloyd-Max code for a unit Gaussian on each component, with one bit width per *group* of
  components, chosen by :func:`allocate_group_bits` (the integer form of water-filling). A
  group of 0 bits is not stored at all.

Everything here is float64 torch on one head; the study (:mod:`rqlib.study.bound`) loops over
layers and heads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from rqlib.core.codebooks import lloyd_max

__all__ = [
    "GAIN_BITS",
    "TransformCode",
    "WaterFilling",
    "allocate_group_bits",
    "fit_transform",
    "gaussian_code",
    "reverse_water_filling",
]

#: Bits of the stored per-vector gain (fp16).
GAIN_BITS = 16
#: Bits of each stored constant of a calibrated transform (fp16), counted as side information.
CONSTANT_BITS = 16
#: Eigenvalues of the metric below this fraction of their mean are floored there, so that a
#: direction no calibration query used cannot blow the inverse transform up.
METRIC_FLOOR = 1e-6


@dataclass(frozen=True)
class WaterFilling:
    """The reverse water-filling solution for one spectrum at one rate."""

    level: float  # the water level theta
    variances: torch.Tensor  # lambda_i
    rates: torch.Tensor  # bits of each component
    distortions: torch.Tensor  # min(lambda_i, theta)

    @property
    def relative_distortion(self) -> float:
        """Total distortion over total variance (1 at rate 0)."""
        return float(self.distortions.sum() / self.variances.sum().clamp_min(1e-300))


def reverse_water_filling(variances: torch.Tensor, rate: float) -> WaterFilling:
    """Shannon's distortion-rate solution for independent Gaussian components of ``variances``
    at an average of ``rate`` bits a component (bisection on the water level in log space)."""
    lam = torch.as_tensor(variances, dtype=torch.float64).flatten()
    if lam.numel() == 0 or bool((lam < 0).any()) or not bool(torch.isfinite(lam).all()):
        raise ValueError("variances must be a non-empty vector of finite values >= 0")
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"rate must be a finite number >= 0, got {rate!r}")
    positive = lam[lam > 0]
    if rate == 0 or positive.numel() == 0:
        return WaterFilling(float(lam.max()), lam, torch.zeros_like(lam), lam.clone())
    lo, hi = math.log(float(positive.min())) - 60 * rate - 1, math.log(float(positive.max()))
    for _ in range(200):  # the rate spent falls as the level rises
        mid = 0.5 * (lo + hi)
        spent = (0.5 * torch.log2(positive / math.exp(mid))).clamp_min(0).sum() / lam.numel()
        lo, hi = (mid, hi) if spent > rate else (lo, mid)
    level = math.exp(0.5 * (lo + hi))
    rates = torch.where(lam > 0, (0.5 * torch.log2(lam.clamp_min(1e-300) / level)), 0.0)
    return WaterFilling(level, lam, rates.clamp_min(0), torch.minimum(lam, lam.new_tensor(level)))


@functools.cache
def gaussian_code(bits: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(centroids, boundaries, distortion)`` of the Lloyd-Max code of ``bits`` bits for a
    unit Gaussian; 0 bits is the single centroid 0 with distortion 1."""
    if bits == 0:
        return torch.zeros(1, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), 1.0
    # the "gaussian" law of lloyd_max is N(0, 1/d) for a coordinate in R^d: rescale d = 2
    book = lloyd_max(2, bits, "gaussian")
    scale = math.sqrt(2.0)
    centroids = torch.tensor(book.centroids, dtype=torch.float64) * scale
    boundaries = torch.tensor(book.boundaries, dtype=torch.float64) * scale
    return centroids, boundaries, float(book.distortion)


def allocate_group_bits(
    group_variances: torch.Tensor, bits_per_component: int, max_bits: int = 8
) -> tuple[int, ...]:
    """Bits of each group of equal size so that the average is exactly ``bits_per_component``
    and the Lloyd-Max distortion ``sum_g var_g D(b_g)`` is smallest.

    Greedy: every step gives one more bit to the group whose distortion falls most. The
    Lloyd-Max distortions ``D(b)`` of a Gaussian fall by a smaller factor at each bit (convex
    in ``b``), so the greedy choice is optimal. ``group_variances`` is the summed variance of
    each group's components."""
    variances = [float(v) for v in torch.as_tensor(group_variances).flatten()]
    n = len(variances)
    if n == 0 or any(not math.isfinite(v) or v < 0 for v in variances):
        raise ValueError("group_variances must be a non-empty vector of finite values >= 0")
    if not isinstance(bits_per_component, int) or not 0 <= bits_per_component <= max_bits:
        raise ValueError(f"bits_per_component must be an int in 0..{max_bits}")
    bits = [0] * n
    for _ in range(bits_per_component * n):
        gains = [
            variances[g] * (gaussian_code(bits[g])[2] - gaussian_code(bits[g] + 1)[2])
            if bits[g] < max_bits
            else -1.0
            for g in range(n)
        ]
        best = max(range(n), key=lambda g: (gains[g], -g))
        bits[best] += 1
    return tuple(bits)


def fit_transform(
    covariance: torch.Tensor, metric: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(T, T_inverse, variances)``: ``T = U^T M^(1/2)`` with ``U`` the eigenvectors of
    ``M^(1/2) C M^(1/2)`` in falling order of their eigenvalues ``variances``.

    ``C`` is the covariance of the vectors, ``M`` the metric of their error (both ``[d, d]``).
    The components of ``T x`` are uncorrelated with those variances, and the weighted error
    ``e^T M e`` equals the plain squared error of ``T e``."""
    c = torch.as_tensor(covariance, dtype=torch.float64)
    m = torch.as_tensor(metric, dtype=torch.float64)
    if c.dim() != 2 or c.shape[0] != c.shape[1] or m.shape != c.shape:
        raise ValueError(
            f"covariance and metric must be square and alike, got {tuple(c.shape)} and "
            f"{tuple(m.shape)}"
        )
    m = 0.5 * (m + m.T)
    e, v = torch.linalg.eigh(m)
    e = e.clamp_min(METRIC_FLOOR * float(e.clamp_min(0).mean()))
    root = v @ torch.diag(e.sqrt()) @ v.T
    root_inverse = v @ torch.diag(e.rsqrt()) @ v.T
    lam, u = torch.linalg.eigh(root @ (0.5 * (c + c.T)) @ root)
    lam, u = lam.flip(0).clamp_min(0), u.flip(1)
    return u.T @ root, root_inverse @ u, lam


@dataclass(frozen=True)
class TransformCode:
    """A calibrated transform code for one head (see the module docstring).

    ``encode`` stores, per vector, the code of each component (a group of ``group_size``
    consecutive components shares ``group_bits[g]``) and one gain; :attr:`bits_per_vector`
    counts both. ``side_bits`` counts what a model stores once per head: the transform, the
    variances and the mean. ``quantizer`` is ``"lloyd-max"`` (a scalar code per component) or a
    :class:`rqlib.core.trellis.BitshiftTrellis` (one trellis path through every stored component,
    each step as wide as its group's bits).
    """

    mean: torch.Tensor  # [d]
    transform: torch.Tensor  # [d, d]
    inverse: torch.Tensor  # [d, d]
    variances: torch.Tensor  # [d], falling
    group_bits: tuple[int, ...]
    quantizer: object = "lloyd-max"

    @classmethod
    def fit(
        cls,
        samples: torch.Tensor,
        metric: torch.Tensor,
        bits: int,
        group_size: int = 16,
        quantizer: object = "lloyd-max",
    ) -> TransformCode:
        """Fit on calibration ``samples`` ``[N, d]`` for an error metric ``[d, d]`` at an
        average of ``bits`` bits a component (side information and gain not included); a group
        gets at most 8 bits, and fewer than a trellis's state bits."""
        x = torch.as_tensor(samples, dtype=torch.float64)
        d = x.shape[-1]
        if x.dim() != 2 or x.shape[0] < 2:
            raise ValueError(f"samples must be [N >= 2, d], got {tuple(x.shape)}")
        if d % group_size:
            raise ValueError(f"group_size {group_size} must divide the dimension {d}")
        mean = x.mean(0)
        centered = x - mean
        transform, inverse, lam = fit_transform(centered.T @ centered / x.shape[0], metric)
        groups = lam.reshape(-1, group_size).sum(-1)
        widest = 8 if quantizer == "lloyd-max" else min(8, quantizer.state_bits - 1)
        group_bits = allocate_group_bits(groups, bits, max_bits=widest)
        return cls(mean, transform, inverse, lam, group_bits, quantizer)

    @property
    def dim(self) -> int:
        return self.mean.numel()

    @property
    def component_bits(self) -> torch.Tensor:
        size = self.dim // len(self.group_bits)
        return torch.tensor(self.group_bits).repeat_interleave(size)

    @property
    def bits_per_vector(self) -> int:
        return int(self.component_bits.sum()) + GAIN_BITS

    @property
    def side_bits(self) -> int:
        return CONSTANT_BITS * (self.dim * self.dim + 2 * self.dim)

    def _whitened(self, x: torch.Tensor) -> torch.Tensor:
        z = (torch.as_tensor(x, dtype=torch.float64) - self.mean) @ self.transform.T
        return z / self.variances.clamp_min(1e-300).sqrt()

    def _quantize(self, u: torch.Tensor) -> torch.Tensor:
        """Unit-variance components ``u`` ``[N, d]`` to their reconstructions."""
        out = torch.zeros_like(u)
        bits = self.component_bits
        if self.quantizer != "lloyd-max":  # one trellis path through every stored component
            columns = (bits > 0).nonzero().flatten()
            steps = bits[columns].tolist()
            out[:, columns] = self.quantizer.decode(
                self.quantizer.encode(u[:, columns], steps), steps
            )
            return out
        for b in sorted(set(self.group_bits) - {0}):
            columns = (bits == b).nonzero().flatten()
            centroids, boundaries, _ = gaussian_code(b)
            out[:, columns] = centroids[torch.bucketize(u[:, columns], boundaries)]
        return out

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """Encode and decode ``x`` ``[N, d]``: what attention would read back (float64).

        The gain is chosen per vector by least squares in the weighted space (and rounded to
        fp16): ``g = sum_i lambda_i y_i c_i / sum_i lambda_i c_i^2`` for whitened components
        ``y`` and reconstructions ``c`` of ``y / ||y||_rms``."""
        y = self._whitened(x)
        rms = y.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-300)
        c = self._quantize(y / rms)
        lam = self.variances
        denominator = (lam * c * c).sum(-1, keepdim=True)
        gain = torch.where(
            denominator > 0, (lam * y * c).sum(-1, keepdim=True) / denominator.clamp_min(1e-300), 0
        )
        gain = gain.to(torch.float16).to(torch.float64)
        z_hat = gain * c * lam.sqrt()
        return self.mean + z_hat @ self.inverse.T
