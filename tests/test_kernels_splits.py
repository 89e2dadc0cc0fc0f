"""How a decode step cuts its keys into splits (rqlib.kernels.limits.decode_splits).

With one query token the (batch, KV head) programs are far fewer than a GPU's SMs, so the keys
are cut into splits; too many splits and the partial results (m, l and the accumulators of
every row, written by each split and read back by the reduce) cost more than they save. The
hand cases use Llama-3-8B's geometry (8 KV heads, GQA group 4, head_dim 128, 3-bit K and V
with 11-bit norms) on an H100 (132 SMs), worked out in the comments.
"""

from __future__ import annotations

import math

import pytest
import torch

from rqlib.core.quantizers import make_quantizer
from rqlib.hf.cache import CompressedLayer
from rqlib.hf.codec import ChannelPart, VectorCodec
from rqlib.kernels import launch
from rqlib.kernels import limits as geo

# Llama-3-8B, 3-bit keys and values: a vector is 128 * 3 code bits + an 11-bit norm
KEY_BYTES = 2 * (128 * 3 + 11) / 8  # 98.75 bytes of K and V per key position and KV head
# a decode step of 4 rows in 4 lanes: per row and lane, (m, l) of 3 streams and the main
# stream's 128 accumulators, written + read
PARTIAL = 2 * 4 * 4 * (3 * 2 + 128) * 4


def random_tile(rng) -> int:
    """The key tile of a random configuration a launch may tune over."""
    tiles = sorted({config.block_s for config in geo.tuned_configs()})
    return tiles[int(torch.randint(0, len(tiles), (1,), generator=rng))]


def test_every_key_tile_divides_a_ring_and_the_splits():
    """Rings are multiples of RING_GRANULE slots (rqlib.kernels.store), so a tile of any
    configuration ends inside its ring; the default split is whole tiles of each."""
    tiles = {config.block_s for config in geo.tuned_configs()}
    assert max(tiles) == geo.widest_tile() and min(tiles) == geo.ATTENTION_BLOCK_S
    assert all(geo.RING_GRANULE % tile == 0 for tile in tiles)
    assert all(geo.DEFAULT_PARTITION % tile == 0 for tile in tiles)


def test_partial_bytes_by_hand():
    assert geo.lanes(4) == 4
    assert geo.partial_bytes(4, 128, 4) == PARTIAL == 17152
    assert geo.partial_bytes(16, 128) == 2 * 16 * (3 * 2 + 128) * 4  # a prompt: one lane
    assert geo.stream_partial_bytes(4, 128, 4) == 2 * 4 * 4 * 128 * 4  # the band's, or the sink's


def test_a_block_of_few_rows_fills_the_tile_with_lanes():
    assert [geo.lanes(rows) for rows in range(1, 18)] == [4] * 4 + [2] * 4 + [1] * 9
    assert max(geo.lanes(rows) * rows for rows in range(1, 17)) <= geo.BLOCK_ROWS
    with pytest.raises(ValueError, match="at least one row"):
        geo.lanes(0)


# the shortest split: PARTIAL / (0.25 * KEY_BYTES) = 17152 / 24.6875 = 694.8 keys


@pytest.mark.parametrize(
    ("span", "programs", "expected"),
    [
        # batch 1 x 8 KV heads: 2 waves of 132 SMs want ceil(264 / 8) = 33 splits; 32768 keys
        # allow floor(32768 / 694.8) = 47, so 33 splits of ceil(32768 / 33 / 16) * 16 = 1008
        (32768, 8, (33, 1008)),
        # 4096 keys allow only floor(4096 / 694.8) = 5 splits: 5 of ceil(4096 / 5 / 16) * 16 = 832
        (4096, 8, (5, 832)),
        # batch 8 x 8 KV heads want ceil(264 / 64) = 5 splits: 5 of 6560 keys at 32768
        (32768, 64, (5, 6560)),
        # a short context: one split, however few programs
        (300, 8, (1, 304)),
    ],
)
def test_hand_cases_on_an_h100(span, programs, expected):
    assert geo.decode_splits(span, programs, 132, PARTIAL, KEY_BYTES) == expected


def test_without_an_sm_count_splits_have_the_default_length():
    assert geo.decode_splits(1000, 8, None, PARTIAL, KEY_BYTES) == (2, 512)
    assert geo.DEFAULT_PARTITION == 512


def test_every_plan_covers_the_keys_fills_no_more_than_asked_and_bounds_the_partials(rng):
    """For random spans, program counts, SM counts and byte sizes: the splits cover the span
    exactly once (no split empty), partitions are whole key tiles, no more splits than the SMs
    ask for, and when there is more than one split, each split's partial results stay within
    MAX_PARTIAL_SHARE of the bytes it reads."""
    for _ in range(2000):
        span = int(torch.randint(1, 200_000, (1,), generator=rng))
        programs = int(torch.randint(1, 512, (1,), generator=rng))
        sm_count = int(torch.randint(1, 200, (1,), generator=rng))
        key_bytes = float(torch.randint(20, 2000, (1,), generator=rng))
        partial = int(torch.randint(0, 100_000, (1,), generator=rng))
        block = random_tile(rng)
        splits, partition = geo.decode_splits(span, programs, sm_count, partial, key_bytes, block)
        assert partition % block == 0 and partition >= block
        assert splits * partition >= span > (splits - 1) * partition
        assert splits <= max(1, math.ceil(geo.SPLIT_WAVES * sm_count / programs))
        if splits > 1:
            assert partial <= geo.MAX_PARTIAL_SHARE * key_bytes * partition


@pytest.mark.parametrize(
    "args",
    [(0, 8, 132, PARTIAL, KEY_BYTES), (100, 0, 132, PARTIAL, KEY_BYTES), (100, 8, 0, 1, 1.0)],
)
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError, match="must be|need"):
        geo.decode_splits(*args)


def test_the_launch_plans_from_the_layer_bytes_and_the_device_sm_count(rng, monkeypatch):
    """split_plan reads the bytes per key from the layer's rings and the SM count from the
    device: on a (pretend) H100 a decode step over 32768 3-bit keys of Llama-3-8B's geometry
    gets the hand plan above; an explicit partition overrides it."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    quantizer = make_quantizer("turboquant-mse", 128, 3, seed=seed, norm_mantissa_bits=6)
    codec = VectorCodec([ChannelPart(quantizer, None)], 128)
    layer = CompressedLayer(0, codec, codec)
    layer.active = True
    keys, values = torch.randn(2, 1, 8, 32768, 128, generator=rng, dtype=torch.float16)
    layer.update(keys, values)
    state = layer.state()
    monkeypatch.setattr(launch, "_sm_count", lambda kind, index: 132)
    cpu = torch.device("cpu")
    assert launch.split_plan(state, 32768, 1, 4, 4, 128, cpu, None) == (33, 1008)
    assert launch.split_plan(state, 32768, 1, 4, 4, 128, cpu, 512) == (64, 512)
    # in tiles of 64 keys: 32768 / 33 = 993 keys rounds up to 1024, so 32 splits
    assert launch.split_plan(state, 32768, 1, 4, 4, 128, cpu, None, 64) == (32, 1024)
    # 4096 keys: the hand plan above; in one lane the partials are 4x smaller and allow more
    assert launch.split_plan(state, 4096, 1, 4, 4, 128, cpu, None) == (5, 832)
    assert launch.split_plan(state, 4096, 1, 4, 1, 128, cpu, None) == (22, 192)
