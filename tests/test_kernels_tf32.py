"""Products on tensor cores with float32 accuracy: the tf32 format, the split of ``exact_dot``,
and the interpreter's emulation of a tensor core's rounding that lets CPU tests see it.

Bounds, all deterministic (no statistics): rounding to tf32 moves a number by at most half a
unit in its 11th significant bit, ``2^-11 |x|``; the two parts of ``tf32_parts`` leave less
than ``2^-20 |x|``; ``exact_dot`` drops ``lo lo`` and those remainders, less than
``3 * 2^-20 |x||y|`` a product, and a float32 sum of K products errs by at most ``K 2^-24`` of
the sum of their magnitudes. So ``exact_dot`` must agree with float64 within
``(3 * 2^-20 + K 2^-24) sum |x||y|`` entrywise, where one tf32 product errs by up to ``2^-10``
of each term, far outside.
"""

from __future__ import annotations

import pytest
import torch

from rqlib.book.kernel_checks import tf32_products
from rqlib.kernels.interpreter import TF32_DROPPED_BITS, round_to_tf32

pytestmark = pytest.mark.interpreter

LOW_BITS = (1 << TF32_DROPPED_BITS) - 1


def is_tf32(x: torch.Tensor) -> torch.Tensor:
    """Whether each float32 entry has its low 13 mantissa bits clear."""
    return (x.to(torch.float32).view(torch.int32) & LOW_BITS) == 0


def spread(rng: torch.Generator, *shape: int) -> torch.Tensor:
    """Gaussian entries whose magnitudes spread over several octaves."""
    return torch.randn(*shape, generator=rng) * torch.exp(2 * torch.randn(*shape, generator=rng))


def test_round_to_tf32_keeps_ten_mantissa_bits_rounding_to_nearest(rng):
    x = spread(rng, 4096)
    assert not bool(is_tf32(x).all())  # the check below can fail: float32 draws are not tf32
    rounded = round_to_tf32(x)
    assert bool(is_tf32(rounded).all())
    assert bool(((rounded - x).abs() <= 2.0**-11 * x.abs()).all())
    assert torch.equal(round_to_tf32(rounded), rounded)
    # ties go away from zero, as PTX cvt.rna does: 1 + 2^-11 is halfway between tf32 neighbours
    tie = torch.tensor([1 + 2.0**-11, -(1 + 2.0**-11)])
    assert round_to_tf32(tie).tolist() == [1 + 2.0**-10, -(1 + 2.0**-10)]


def test_exact_dot_agrees_with_float64_where_one_tf32_product_does_not(rng):
    m, k, n = 16, 32, 16
    x, y = spread(rng, m, k), spread(rng, k, n)
    got = tf32_products(x, y)

    hi, lo = got["hi"], got["lo"]
    assert bool(is_tf32(hi).all()) and bool(is_tf32(lo).all())
    assert bool(((x.double() - hi.double() - lo.double()).abs() < 2.0**-20 * x.abs()).all())
    expected = x.double() @ y.double()
    bound = (3 * 2.0**-20 + k * 2.0**-24) * (x.double().abs() @ y.double().abs())
    assert bool(((got["exact"].double() - expected).abs() <= bound).all())
    # the interpreter rounds a tf32 dot's inputs as a tensor core does, and the bound sees it
    assert bool(((got["plain"].double() - expected).abs() > bound).any())
