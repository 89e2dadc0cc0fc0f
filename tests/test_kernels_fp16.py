"""Products on fp16 tensor cores with float32 accuracy: the fp16 parts of ``split_dot`` and the
kernel's codebook (:mod:`rqlib.kernels.numerics`).

Bounds, all deterministic (no statistics). fp16 keeps 11 significant bits, so rounding to it
moves a number in its normal range by at most ``2^-11`` of itself, and one in its subnormal
range (below ``2^-14``) by at most ``2^-25``. ``fp16_parts`` rounds twice, so
``|x - hi - lo| <= 2^-22 |x| + 2^-25``. A tensor core, and the interpreter, multiply fp16 numbers
exactly and sum in float32: ``split_dot`` must agree with float64 within
``kernel_checks.split_dot_bound``, where one fp16 product moves each term by up to ``2^-11``,
far outside.
"""

from __future__ import annotations

import pytest
import torch

from rqlib.book.kernel_checks import fp16_products, split_dot_bound
from rqlib.core.quantizers import make_quantizer
from rqlib.kernels import numerics

pytestmark = pytest.mark.interpreter


def spread(rng: torch.Generator, *shape: int) -> torch.Tensor:
    """Gaussian entries whose magnitudes spread over many octaves, a quarter of them moved
    below fp16's normal range (2^-14), none above its largest number."""
    x = torch.randn(*shape, generator=rng) * torch.exp(2 * torch.randn(*shape, generator=rng))
    tiny = torch.rand(*shape, generator=rng) < 0.25
    return torch.where(tiny, x * 2.0**-20, x).clamp(-60000.0, 60000.0)


def test_split_dot_agrees_with_float64_where_one_fp16_product_does_not(rng):
    m, k, n = 16, 32, 16
    x, y = spread(rng, m, k), spread(rng, k, n).to(torch.float16)
    assert bool((x.abs() < 2.0**-14).any())  # the subnormal range is exercised
    got = fp16_products(x, y)

    hi, lo = got["hi"].double(), got["lo"].double()
    relative, absolute = numerics.PART_REMAINDER
    remainder = (x.double() - hi - lo).abs()
    assert bool((remainder <= relative * x.double().abs() + absolute).all())
    assert bool((remainder > 0).any())  # float32 draws are not sums of two fp16 numbers
    expected = x.double() @ y.double()
    bound = split_dot_bound(x, y)
    assert bool(((got["split"].double() - expected).abs() <= bound).all())
    # rounding x to fp16 once is seen by the bound
    assert bool(((got["plain"].double() - expected).abs() > bound).any())


@pytest.mark.parametrize("bits", [3, 8])
def test_the_kernel_codebook_is_the_codebook_rounded_to_fp16(bits, rng):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    quantizer = make_quantizer("turboquant-mse", 128, bits, draw=seed)
    table = numerics.kernel_centroids(quantizer, "cpu")
    assert table.dtype == numerics.CODEBOOK_DTYPE
    centroids = quantizer.centroids.double()
    moved = (table.double() - centroids).abs()
    assert bool((moved <= numerics.CODEBOOK_ROUNDING * centroids.abs()).all())
    assert bool((moved > 0).any())  # the float32 codebook is not already fp16
    # to nearest: no fp16 neighbour of a rounded centroid is closer to it
    for step in (1, -1):
        neighbour = (table.view(torch.int16) + step).view(torch.float16).double()
        assert bool(((neighbour - centroids).abs() >= moved).all())
    rounded = numerics.kernel_quantizer(quantizer)
    assert torch.equal(rounded.centroids, table.float())
    assert torch.equal(quantizer.centroids, centroids.float())  # the original is untouched
    assert rounded.boundaries is quantizer.boundaries  # it stores the same codes


@pytest.mark.parametrize("bits", [3, 4, 5])
def test_a_table_of_centroid_pairs_holds_the_kernel_codebook(bits, rng):
    """Entry ``i + n j`` of ``kernel_table`` holds centroids ``i`` (low half) and ``j`` (high
    half) of the kernel's codebook, bit for bit, in fp16 and float32; past ``PAIR_MAX_BITS``
    only the entries ``j = 0`` are made (the high halves zero)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    quantizer = make_quantizer("turboquant-mse", 64, bits, draw=seed)
    for dtype in (torch.float16, torch.float32):
        codebook = numerics.kernel_centroids(quantizer, "cpu", dtype)
        table = numerics.kernel_table(quantizer, "cpu", dtype)
        assert table.dtype == numerics.PAIR_DTYPES[dtype]
        n = codebook.numel()
        pairs = n if bits <= numerics.PAIR_MAX_BITS else 1
        assert table.numel() == n * pairs
        entry = torch.arange(table.numel())
        low, high = numerics.table_halves(table)
        assert torch.equal(low, codebook[entry % n])
        high_expected = codebook[entry // n] if pairs > 1 else torch.zeros_like(high)
        assert torch.equal(high, high_expected)
    with pytest.raises(ValueError, match="centroid pairs are of"):
        numerics.kernel_table(quantizer, "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="tables of centroid pairs are of"):
        numerics.table_halves(table.to(torch.int16))


def test_scaled_rows_are_exact_powers_of_two_into_the_unit_interval(rng):
    rows = spread(rng, 5, 7, 64)
    rows[0, 0] = 0.0
    scaled, scale = numerics.scaled_rows(rows)
    mantissa, _ = torch.frexp(scale)
    assert bool((mantissa == 0.5).all())  # powers of two
    assert torch.equal(scaled * scale[..., None], rows)  # exact
    largest = scaled.abs().amax(-1)
    assert bool((largest < 1).all())
    assert bool((largest[rows.abs().amax(-1) > 0] >= 0.5).all())
    assert scale[0, 0] == 1.0
