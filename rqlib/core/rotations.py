"""Random rotations of R^d, each with ``apply`` and ``inverse``.

- ``"dense"``: a Haar-random orthogonal matrix (QR of a Gaussian matrix with the signs of R's
  diagonal moved into Q, which makes the law exactly Haar). O(d²) per vector.
- ``"hadamard"``: x ↦ H·diag(s)·x / √d with random signs s and the Walsh–Hadamard matrix H,
  computed by the fast transform in O(d log d); d must be a power of two.
- ``"rotor"``: one Haar-random Cl(3,0) rotor per group of three coordinates, applied by the
  sandwich R v R̃ (:mod:`rqlib.core.clifford`); d is zero-padded to 3·ceil(d/3), so the output has
  ``out_dim >= d`` coordinates. A block rotation: it mixes coordinates only within a group.
- ``"none"``: the identity (a baseline).

Every rotation also exposes ``.matrix`` (``[out_dim, d]``, orthonormal columns) so that
``apply(x) == x @ matrix.T``; kernels rotate queries with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rqlib.core import clifford

KINDS = ("dense", "hadamard", "rotor", "none")


def _generator(draw: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(draw))


def haar_orthogonal(d: int, draw: int) -> torch.Tensor:
    """A Haar-random ``d × d`` orthogonal matrix (float64), reproducible from ``draw``."""
    gaussian = torch.randn(d, d, generator=_generator(draw), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return q * signs


def fast_walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh–Hadamard transform along the last axis (length a power of two)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two length, got {d}")
    batch = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(*batch, d)


@dataclass(frozen=True, eq=False)
class Rotation:
    """A random rotation, fixed by its draw number: ``apply`` maps ``[..., d]`` to
    ``[..., out_dim]``, ``inverse`` back."""

    kind: str
    d: int
    draw: int
    out_dim: int
    matrix: torch.Tensor = field(repr=False)  # float32 [out_dim, d]
    signs: torch.Tensor | None = field(default=None, repr=False)  # hadamard
    rotors: torch.Tensor | None = field(default=None, repr=False)  # rotor, (groups, 8) float64

    def _check(self, x: torch.Tensor, size: int, name: str) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
        if x.shape[-1] != size:
            raise ValueError(f"{name} must have last dimension {size}, got {tuple(x.shape)}")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [..., d]`` into ``[..., out_dim]`` (float32, or x's dtype if float64)."""
        self._check(x, self.d, "x")
        x = x if x.dtype == torch.float64 else x.float()
        if self.kind == "hadamard":
            return fast_walsh_hadamard(x * self.signs.to(x)) / math.sqrt(self.d)
        if self.kind == "rotor":
            rotors = self.rotors.to(device=x.device, dtype=x.dtype)
            rotated = clifford.sandwich(rotors, clifford.embed_vectors(x))
            return clifford.extract_vectors(rotated, self.out_dim)
        if self.kind == "none":
            return x.clone()
        return x @ self.matrix.to(x).T

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Rotate back ``y [..., out_dim]`` into ``[..., d]`` (padding coordinates dropped)."""
        self._check(y, self.out_dim, "y")
        y = y if y.dtype == torch.float64 else y.float()
        if self.kind == "hadamard":
            return fast_walsh_hadamard(y) / math.sqrt(self.d) * self.signs.to(y)
        if self.kind == "rotor":
            rotors = clifford.reverse(self.rotors.to(device=y.device, dtype=y.dtype))
            groups = self.out_dim // 3
            mv = y.new_zeros(*y.shape[:-1], groups, 8)
            mv[..., list(clifford.VECTOR_SLOTS)] = y.reshape(*y.shape[:-1], groups, 3)
            return clifford.extract_vectors(clifford.sandwich(rotors, mv), self.d)
        if self.kind == "none":
            return y.clone()
        return y @ self.matrix.to(y)


def make_rotation(kind: str, d: int, draw: int = 0) -> Rotation:
    """A rotation of R^d of the given ``kind`` (``"dense"``, ``"hadamard"``, ``"rotor"``,
    ``"none"``), reproducible from ``draw``."""
    if kind not in KINDS:
        raise ValueError(f"rotation must be one of {KINDS}, got {kind!r}")
    if isinstance(d, bool) or not isinstance(d, int) or d < 2:
        raise ValueError(f"d must be an integer >= 2, got {d!r}")
    if kind == "dense":
        return Rotation(kind, d, draw, d, haar_orthogonal(d, draw).float())
    if kind == "hadamard":
        if d & (d - 1):
            raise ValueError(
                f"rotation='hadamard' needs a power-of-two d, got d={d}; "
                "use 'dense' or 'rotor' for other dimensions"
            )
        signs = torch.randint(0, 2, (d,), generator=_generator(draw)).double() * 2 - 1
        matrix = fast_walsh_hadamard(torch.diag(signs)).T / math.sqrt(d)
        return Rotation(kind, d, draw, d, matrix.float(), signs=signs.float())
    if kind == "rotor":
        groups = math.ceil(d / 3)
        rotors = clifford.random_rotors(groups, draw)
        blocks = clifford.rotor_matrix(rotors)  # (groups, 3, 3)
        matrix = torch.block_diag(*blocks)[:, :d]
        return Rotation(kind, d, draw, 3 * groups, matrix.float(), rotors=rotors)
    return Rotation(kind, d, draw, d, torch.eye(d))
