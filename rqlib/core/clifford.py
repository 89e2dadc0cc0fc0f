"""The Clifford algebra Cl(3,0) on ``(..., 8)`` tensors.

A multivector is stored as its eight coefficients in the basis

    [1, e1, e2, e3, e12, e13, e23, e123]

with e_i e_i = +1 and e_i e_j = -e_j e_i (i != j). RotorQuant uses the even subalgebra:
a *rotor* R = cos(θ/2) - sin(θ/2) B (B a unit bivector) rotates a vector v by θ in the
plane of B through the *sandwich* R v R̃, where R̃ is the reverse of R. A d-dimensional
vector is cut into ceil(d/3) groups of three coordinates and each group gets its own rotor.

The geometric product is a bilinear map; it is implemented once as a constant
``(8, 8, 8)`` sign tensor ``PRODUCT_TABLE`` so that ``c_k = Σ_ij a_i b_j T[i, j, k]``.
"""

from __future__ import annotations

import math

import torch

BASIS = ("1", "e1", "e2", "e3", "e12", "e13", "e23", "e123")
# Each basis blade as a bit mask over (e1, e2, e3): e13 -> 0b101.
BLADE_MASKS = (0b000, 0b001, 0b010, 0b100, 0b011, 0b101, 0b110, 0b111)
GRADES = tuple(bin(mask).count("1") for mask in BLADE_MASKS)
VECTOR_SLOTS = (1, 2, 3)  # e1, e2, e3
BIVECTOR_SLOTS = (4, 5, 6)  # e12, e13, e23


def _reordering_sign(a: int, b: int) -> int:
    """Sign picked up when the product of blades ``a`` and ``b`` is put in canonical order.

    Counts, for every generator in ``a``, the generators of ``b`` it has to move past.
    In Cl(3,0) every generator squares to +1, so this count is the only source of sign.
    """
    swaps = 0
    a >>= 1
    while a:
        swaps += bin(a & b).count("1")
        a >>= 1
    return -1 if swaps % 2 else 1


def _product_table() -> torch.Tensor:
    slot_of_mask = {mask: slot for slot, mask in enumerate(BLADE_MASKS)}
    table = torch.zeros(8, 8, 8, dtype=torch.float64)
    for i, a in enumerate(BLADE_MASKS):
        for j, b in enumerate(BLADE_MASKS):
            table[i, j, slot_of_mask[a ^ b]] = _reordering_sign(a, b)
    return table


PRODUCT_TABLE = _product_table()
_REVERSE_SIGNS = torch.tensor([(-1.0) ** (g * (g - 1) // 2) for g in GRADES], dtype=torch.float64)


def _check_multivector(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape[-1:] != (8,):
        raise ValueError(
            f"{name} must have a last dimension of 8 (a Cl(3,0) multivector), "
            f"got shape {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def geometric_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The geometric product ``a b`` of two ``(..., 8)`` multivectors (broadcasting)."""
    _check_multivector(a, "a")
    _check_multivector(b, "b")
    dtype = torch.promote_types(a.dtype, b.dtype)
    a, b = torch.broadcast_tensors(a.to(dtype), b.to(dtype))
    outer = (a.unsqueeze(-1) * b.unsqueeze(-2)).reshape(*a.shape[:-1], 64)
    return outer @ PRODUCT_TABLE.reshape(64, 8).to(device=a.device, dtype=dtype)


def reverse(x: torch.Tensor) -> torch.Tensor:
    """The reverse x̃: flips the sign of the grade-2 and grade-3 parts."""
    _check_multivector(x, "x")
    return x * _REVERSE_SIGNS.to(device=x.device, dtype=x.dtype)


def grade(x: torch.Tensor, k: int) -> torch.Tensor:
    """The grade-``k`` part of ``x`` (other coefficients set to zero), k in 0..3."""
    _check_multivector(x, "x")
    if k not in (0, 1, 2, 3):
        raise ValueError(f"grade k must be 0, 1, 2 or 3 in Cl(3,0), got {k}")
    mask = torch.tensor([g == k for g in GRADES], device=x.device, dtype=x.dtype)
    return x * mask


def rotor(bivector: torch.Tensor, angle: torch.Tensor | float) -> torch.Tensor:
    """The rotor ``exp(-angle/2 · B̂) = cos(angle/2) - sin(angle/2) B̂``.

    ``bivector`` is either ``(..., 3)`` coefficients of (e12, e13, e23) or a ``(..., 8)``
    multivector whose grade-2 part is used; it is normalized to the unit bivector B̂.
    The sandwich ``R v R̃`` then rotates v by ``angle`` in the plane of B (from e_i towards
    e_j for B = e_ij).
    """
    if not isinstance(bivector, torch.Tensor):
        raise TypeError(f"bivector must be a torch.Tensor, got {type(bivector).__name__}")
    if bivector.shape[-1] == 8:
        parts = bivector[..., list(BIVECTOR_SLOTS)]
    elif bivector.shape[-1] == 3:
        parts = bivector
    else:
        raise ValueError(
            "bivector must have a last dimension of 3 (e12, e13, e23) or 8, "
            f"got shape {tuple(bivector.shape)}"
        )
    if not parts.is_floating_point():
        raise TypeError(f"bivector must be a floating-point tensor, got {parts.dtype}")
    size = parts.norm(dim=-1, keepdim=True)
    if bool((size == 0).any()):
        raise ValueError("bivector must be non-zero: a rotation needs a plane")
    half = torch.as_tensor(angle, dtype=parts.dtype, device=parts.device) / 2
    batch = torch.broadcast_shapes(parts.shape[:-1], half.shape)
    out = parts.new_zeros(*batch, 8)
    out[..., 0] = torch.cos(half)
    out[..., list(BIVECTOR_SLOTS)] = -torch.sin(half).unsqueeze(-1) * parts / size
    return out


def random_rotors(n: int, draw: int) -> torch.Tensor:
    """``n`` Haar-random rotors as an ``(n, 8)`` float64 tensor, reproducible from ``draw``.

    A rotor is a unit element of the even subalgebra (a unit quaternion): normalizing a
    4-D standard Gaussian gives the uniform distribution on it, hence a uniformly random
    3-D rotation.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    generator = torch.Generator().manual_seed(int(draw))
    even = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    even = even / even.norm(dim=-1, keepdim=True)
    out = torch.zeros(n, 8, dtype=torch.float64)
    out[:, 0] = even[:, 0]
    out[:, list(BIVECTOR_SLOTS)] = even[:, 1:]
    return out


def sandwich(rotor_: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``R x R̃``: rotates every grade of ``x`` by the rotor ``R`` (broadcasting)."""
    return geometric_product(geometric_product(rotor_, x), reverse(rotor_))


def embed_vectors(v: torch.Tensor) -> torch.Tensor:
    """A ``(..., d)`` vector as ``(..., ceil(d/3), 8)`` grade-1 multivectors (zero-padded)."""
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        raise TypeError("v must be a floating-point torch.Tensor")
    d = v.shape[-1]
    if d < 1:
        raise ValueError("v must have a non-empty last dimension")
    groups = math.ceil(d / 3)
    padded = torch.nn.functional.pad(v, (0, 3 * groups - d))
    out = v.new_zeros(*v.shape[:-1], groups, 8)
    out[..., list(VECTOR_SLOTS)] = padded.reshape(*v.shape[:-1], groups, 3)
    return out


def extract_vectors(mv: torch.Tensor, d: int) -> torch.Tensor:
    """The first ``d`` grade-1 coefficients of ``(..., groups, 8)`` multivectors: ``(..., d)``."""
    _check_multivector(mv, "mv")
    groups = mv.shape[-2]
    if not 1 <= d <= 3 * groups:
        raise ValueError(f"d must be in 1..{3 * groups} for {groups} groups, got {d}")
    return mv[..., list(VECTOR_SLOTS)].reshape(*mv.shape[:-2], 3 * groups)[..., :d]


def rotor_matrix(rotor_: torch.Tensor) -> torch.Tensor:
    """The ``(..., 3, 3)`` rotation matrix M with ``M v = R v R̃`` for grade-1 v."""
    _check_multivector(rotor_, "rotor_")
    basis = torch.zeros(3, 8, dtype=rotor_.dtype, device=rotor_.device)
    basis[0, 1] = basis[1, 2] = basis[2, 3] = 1.0
    images = sandwich(rotor_.unsqueeze(-2), basis)  # (..., 3 inputs, 8)
    return images[..., list(VECTOR_SLOTS)].transpose(-1, -2)
