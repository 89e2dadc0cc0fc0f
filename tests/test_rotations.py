"""Rotations: orthogonality, apply/inverse round trips, the fast Hadamard transform.

Random inputs come from the ``rng`` fixture. The round trips are float32 identities with a
rounding tolerance (no chance failure); the Haar test bounds sample moments at 6 standard
errors (false failure 2e-9 per bound) and is audited over random seeds (``make test-seeds``).
"""

import math

import pytest
import torch

from rqlib.core.rotations import fast_walsh_hadamard, haar_orthogonal, make_rotation

# float32 rotations of unit-scale vectors: errors are a few ulps times sqrt(d) ~ 1e-6
TOL = 1e-5


@pytest.mark.parametrize("kind", ["dense", "hadamard", "rotor", "none"])
@pytest.mark.parametrize("d", [64, 96, 128, 67])
def test_apply_inverse_matrix_agree(rng, kind, d):
    if kind == "hadamard" and d & (d - 1):
        with pytest.raises(ValueError, match="power-of-two"):
            make_rotation(kind, d, 0)
        return
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    rotation = make_rotation(kind, d, seed)
    assert rotation.out_dim == (3 * math.ceil(d / 3) if kind == "rotor" else d)
    m = rotation.matrix
    torch.testing.assert_close(m.T @ m, torch.eye(d), atol=TOL, rtol=0)
    x = torch.randn(33, d, generator=rng)
    y = rotation.apply(x)
    torch.testing.assert_close(y, x @ m.T, atol=TOL, rtol=0)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=TOL, rtol=TOL)
    torch.testing.assert_close(rotation.inverse(y), x, atol=TOL, rtol=0)
    # same seed, same rotation; another seed, another rotation
    torch.testing.assert_close(make_rotation(kind, d, seed).matrix, m, atol=0, rtol=0)
    if kind != "none":
        assert not torch.equal(make_rotation(kind, d, seed + 1).matrix, m)


def test_rotor_rotation_is_block_diagonal(rng):
    rotation = make_rotation("rotor", 12, int(torch.randint(0, 2**31, (1,), generator=rng)))
    mask = torch.block_diag(*[torch.ones(3, 3)] * 4)
    assert torch.all(rotation.matrix[mask == 0] == 0)


def test_fast_walsh_hadamard_matches_sylvester_matrix(rng):
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(6):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(5, 64, generator=rng, dtype=torch.float64)
    torch.testing.assert_close(fast_walsh_hadamard(x), x @ h.T)


@pytest.mark.randomized
def test_haar_orthogonal_has_haar_first_column(rng, record_statistic):
    """Under the Haar law each entry of Q has E[q²] = 1/d and E[q] = 0; without the sign fix
    of QR the diagonal of Q is biased positive. 2000 independent draws: q has sd sqrt(1/d) and
    q² = Beta(1/2, (d−1)/2) has sd below sqrt(2)/d, so both bounds are at least 6 standard
    errors (two-sided normal tail 2e-9 each: the false-failure rate)."""
    d, n = 8, 2000
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    diag = torch.stack([haar_orthogonal(d, seed + i)[0, 0] for i in range(n)])
    record_statistic("|mean q| / SE", abs(diag.mean().item()) / math.sqrt(1 / d / n), 6.0)
    record_statistic(
        "|mean q² - 1/d| / SE", abs((diag**2).mean().item() - 1 / d) / math.sqrt(2 / d**2 / n), 6.0
    )


def test_bad_inputs():
    with pytest.raises(ValueError, match="rotation must be one of"):
        make_rotation("givens", 64, 0)
    with pytest.raises(ValueError, match="d must be"):
        make_rotation("dense", 1, 0)
    rotation = make_rotation("dense", 8, 0)
    with pytest.raises(ValueError, match="last dimension 8"):
        rotation.apply(torch.zeros(3, 9))
    with pytest.raises(TypeError, match="floating-point"):
        rotation.apply(torch.zeros(3, 8, dtype=torch.int32))
