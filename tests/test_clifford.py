"""Cl(3,0): the algebra's axioms and the rotor sandwich as a rotation.

All checks are float64; the tolerance 1e-12 is a few hundred ulps, far below any algebra
mistake (a wrong sign or a wrong slot is an O(1) error). The random multivectors (``rng``) are
O(1), so rounding stays far inside 1e-12 for any draw: no test here fails by chance.
"""

import itertools
import math

import pytest
import torch

from rqlib.core import clifford

TOL = 1e-12


def basis_vector(i: int) -> torch.Tensor:
    out = torch.zeros(8, dtype=torch.float64)
    out[i] = 1.0
    return out


def random_multivectors(rng, *shape):
    return torch.randn(*shape, 8, generator=rng, dtype=torch.float64)


def random_vectors_as_mv(rng, n):
    mv = torch.zeros(n, 8, dtype=torch.float64)
    mv[:, 1:4] = torch.randn(n, 3, generator=rng, dtype=torch.float64)
    return mv


def test_generators_square_to_one_and_anticommute():
    one = basis_vector(0)
    for i in (1, 2, 3):
        e_i = basis_vector(i)
        torch.testing.assert_close(clifford.geometric_product(e_i, e_i), one, atol=0, rtol=0)
    for i, j in itertools.combinations((1, 2, 3), 2):
        e_i, e_j = basis_vector(i), basis_vector(j)
        torch.testing.assert_close(
            clifford.geometric_product(e_i, e_j), -clifford.geometric_product(e_j, e_i)
        )
    # e1 e2 = e12, e1 e3 = e13, e2 e3 = e23, e1 e2 e3 = e123 (the basis order of the module)
    e1, e2, e3 = (basis_vector(i) for i in (1, 2, 3))
    gp = clifford.geometric_product
    torch.testing.assert_close(gp(e1, e2), basis_vector(4))
    torch.testing.assert_close(gp(e1, e3), basis_vector(5))
    torch.testing.assert_close(gp(e2, e3), basis_vector(6))
    torch.testing.assert_close(gp(gp(e1, e2), e3), basis_vector(7))
    # the pseudoscalar squares to -1 in Cl(3,0)
    torch.testing.assert_close(gp(basis_vector(7), basis_vector(7)), -basis_vector(0))


def test_associativity_and_distributivity(rng):
    a, b, c = (random_multivectors(rng, 64) for _ in range(3))
    gp = clifford.geometric_product
    torch.testing.assert_close(gp(gp(a, b), c), gp(a, gp(b, c)), atol=TOL, rtol=0)
    torch.testing.assert_close(gp(a, b + c), gp(a, b) + gp(a, c), atol=TOL, rtol=0)


def test_reverse_is_an_antiautomorphism(rng):
    a, b = random_multivectors(rng, 32), random_multivectors(rng, 32)
    gp = clifford.geometric_product
    torch.testing.assert_close(
        clifford.reverse(gp(a, b)), gp(clifford.reverse(b), clifford.reverse(a)), atol=TOL, rtol=0
    )


def test_grades_partition_the_multivector(rng):
    x = random_multivectors(rng, 16)
    torch.testing.assert_close(sum(clifford.grade(x, k) for k in range(4)), x)
    with pytest.raises(ValueError, match="grade"):
        clifford.grade(x, 4)


def test_rotors_are_unit(rng):
    rotors = clifford.random_rotors(256, draw=int(torch.randint(0, 2**31, (1,), generator=rng)))
    product = clifford.geometric_product(rotors, clifford.reverse(rotors))
    expected = torch.zeros_like(product)
    expected[:, 0] = 1.0
    torch.testing.assert_close(product, expected, atol=TOL, rtol=0)


def test_sandwich_preserves_norms_inner_products_and_grade(rng):
    n = 128
    rotors = clifford.random_rotors(n, draw=int(torch.randint(0, 2**31, (1,), generator=rng)))
    u, v = random_vectors_as_mv(rng, n), random_vectors_as_mv(rng, n)
    ru, rv = clifford.sandwich(rotors, u), clifford.sandwich(rotors, v)
    # nothing leaks out of grade 1
    torch.testing.assert_close(ru - clifford.grade(ru, 1), torch.zeros_like(ru), atol=TOL, rtol=0)
    torch.testing.assert_close(ru.norm(dim=-1), u.norm(dim=-1), atol=TOL, rtol=0)
    torch.testing.assert_close((ru * rv).sum(-1), (u * v).sum(-1), atol=TOL, rtol=0)


def test_sandwich_composes(rng):
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    r1, r2 = clifford.random_rotors(64, seed), clifford.random_rotors(64, seed + 1)
    x = random_multivectors(rng, 64)
    composed = clifford.sandwich(clifford.geometric_product(r2, r1), x)
    in_turn = clifford.sandwich(r2, clifford.sandwich(r1, x))
    torch.testing.assert_close(composed, in_turn, atol=TOL, rtol=0)


def test_sandwich_equals_its_rotation_matrix(rng):
    rotors = clifford.random_rotors(64, draw=int(torch.randint(0, 2**31, (1,), generator=rng)))
    matrices = clifford.rotor_matrix(rotors)
    eye = torch.eye(3, dtype=torch.float64).expand(64, 3, 3)
    torch.testing.assert_close(matrices @ matrices.transpose(-1, -2), eye, atol=TOL, rtol=0)
    torch.testing.assert_close(torch.linalg.det(matrices), torch.ones(64, dtype=torch.float64))
    v = random_vectors_as_mv(rng, 64)
    expected = (matrices @ v[:, 1:4].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(clifford.sandwich(rotors, v)[:, 1:4], expected, atol=TOL, rtol=0)


def test_rotor_rotates_in_its_plane_by_its_angle():
    # exp(-θ/2 e12) turns e1 towards e2 by θ and leaves e3 alone
    theta = 0.7
    r = clifford.rotor(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), theta)
    image = clifford.sandwich(r, basis_vector(1))
    expected = math.cos(theta) * basis_vector(1) + math.sin(theta) * basis_vector(2)
    torch.testing.assert_close(image, expected, atol=TOL, rtol=0)
    torch.testing.assert_close(clifford.sandwich(r, basis_vector(3)), basis_vector(3))
    with pytest.raises(ValueError, match="non-zero"):
        clifford.rotor(torch.zeros(3), 1.0)


@pytest.mark.parametrize("d", [1, 2, 3, 64, 67, 128])
def test_embed_extract_round_trip(rng, d):
    v = torch.randn(5, d, generator=rng, dtype=torch.float64)
    mv = clifford.embed_vectors(v)
    assert mv.shape == (5, math.ceil(d / 3), 8)
    torch.testing.assert_close(mv - clifford.grade(mv, 1), torch.zeros_like(mv))
    torch.testing.assert_close(clifford.extract_vectors(mv, d), v)


def test_bad_inputs():
    with pytest.raises(ValueError, match="last dimension of 8"):
        clifford.geometric_product(torch.zeros(7), torch.zeros(8))
    with pytest.raises(TypeError, match="floating-point"):
        clifford.reverse(torch.zeros(8, dtype=torch.int64))
