"""Bit-packing: exact round trips, sizes, and the documented bit layout.

Random codes come from the ``rng`` fixture; every check is an exact equality, so no test
here fails by chance (false-failure rate 0).
"""

import pytest
import torch

from rqlib.core.packing import pack_bits, pack_signs, packed_size, unpack_bits, unpack_signs


@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_every_length(rng, bits):
    for n in range(1, 258):
        codes = torch.randint(0, 2**bits, (2, n), generator=rng).to(torch.uint8)
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8
        assert packed.shape == (2, (n * bits + 7) // 8) == (2, packed_size(n, bits))
        assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_layout_is_lsb_first_stream():
    # codes 5 (101), 3 (011), 7 (111) at 3 bits: stream 1,0,1, 1,1,0, 1,1,1 ->
    # byte 0 = bits 0..7 = 0b11011101 = 221, byte 1 = bit 8 = 1
    assert pack_bits(torch.tensor([5, 3, 7], dtype=torch.uint8), 3).tolist() == [221, 1]
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() == [
        1,
        1,
    ]


def test_signs_round_trip(rng):
    positive = torch.rand(4, 3, 130, generator=rng) > 0.5
    packed = pack_signs(positive)
    assert packed.shape == (4, 3, 17)
    signs = unpack_signs(packed, 130)
    assert torch.equal(signs, positive.float() * 2 - 1)


def test_bad_inputs():
    with pytest.raises(ValueError, match="bits must be"):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="codes must be < 2\\*\\*bits"):
        pack_bits(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(TypeError, match="uint8"):
        pack_bits(torch.zeros(3, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="take 2 bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 2, 5)
    with pytest.raises(TypeError, match="bool"):
        pack_signs(torch.zeros(3))
