"""How a decode step cuts its keys into splits (rqlib.kernels.limits.decode_splits).

With one query token the (batch, KV head) programs are far fewer than a GPU's SMs, so the keys
are cut into splits. Their number is fixed for a device and a batch (never a function of the
context), so a decode step's partial results have one size for a whole generation and are
allocated once; each split covers ``ceil(span / splits)`` keys rounded up to whole key tiles.
The hand cases use Llama-3-8B's geometry (8 KV heads) on an H100/H200 (132 SMs).
"""

from __future__ import annotations

import math

import pytest
import torch

from rqlib.kernels import launch
from rqlib.kernels import limits as geo


def test_the_key_tile_divides_a_ring():
    """Rings are multiples of RING_GRANULE slots (rqlib.kernels.store), so a tile ends inside
    its ring."""
    assert geo.RING_GRANULE % geo.ATTENTION_BLOCK_S == 0
    assert geo.ATTENTION_CONFIG.block_s == geo.CUDA_CORE_CONFIG.block_s == geo.ATTENTION_BLOCK_S


def test_partial_bytes_by_hand():
    # per row: (m, l) of 3 streams and the main stream's 128 accumulators, written + read
    assert geo.partial_bytes(4, 128) == 2 * 4 * (3 * 2 + 128) * 4 == 4288


@pytest.mark.parametrize(
    ("programs", "expected"),
    [
        (8, 33),  # batch 1 x 8 KV heads: 2 waves of 132 SMs want ceil(264 / 8) = 33 splits
        (64, 5),  # batch 8 x 8 KV heads: ceil(264 / 64) = 5
        (1, 64),  # one KV head: 264 capped at MAX_SPLITS
        (512, 1),  # more programs than two waves: one split
    ],
)
def test_hand_cases_on_an_h100(programs, expected):
    assert geo.decode_splits(programs, 132) == expected


def test_without_an_sm_count_a_decode_step_has_the_default_splits():
    assert geo.decode_splits(8, None) == geo.DEFAULT_SPLITS


def test_at_batch_1_with_8_kv_heads_a_decode_step_fills_two_waves_of_132_sms():
    assert 8 * geo.decode_splits(8, 132) >= 2 * 132


def test_every_plan_covers_the_keys_with_whole_tiles_and_never_depends_on_the_context(rng):
    """For random spans, program counts and SM counts: the splits are as many at every span,
    each a positive whole number of key tiles, together covering the span (the last may be
    short or empty), and never more than two waves of the SMs ask for or MAX_SPLITS."""
    for _ in range(2000):
        programs = int(torch.randint(1, 512, (1,), generator=rng))
        sm_count = int(torch.randint(1, 200, (1,), generator=rng))
        splits = geo.decode_splits(programs, sm_count)
        assert 1 <= splits <= min(geo.MAX_SPLITS, math.ceil(geo.SPLIT_WAVES * sm_count / programs))
        for _ in range(3):
            span = int(torch.randint(0, 200_000, (1,), generator=rng))
            partition = geo.split_partition(span, splits)
            assert partition % geo.ATTENTION_BLOCK_S == 0 and partition >= geo.ATTENTION_BLOCK_S
            assert splits * partition >= span
            # no split is longer than it must be: one tile less would not cover the span
            if partition > geo.ATTENTION_BLOCK_S:
                assert splits * (partition - geo.ATTENTION_BLOCK_S) < span


@pytest.mark.parametrize("args", [(0, 132), (8, 0)])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        geo.decode_splits(*args)


def test_the_launch_plans_from_the_device_sm_count(monkeypatch):
    """split_plan reads the SM count from the device: on a (pretend) H100 a decode step of
    batch 1 and 8 KV heads over 32768 keys gets 33 splits of ceil(32768 / 33 / 16) * 16 = 1008
    keys, and over 4096 keys the same 33 splits of 128; an explicit partition overrides it."""
    monkeypatch.setattr(launch, "_sm_count", lambda kind, index: 132)
    cpu = torch.device("cpu")
    assert launch.split_plan(32768, 8, cpu, None) == (33, 1008)
    assert launch.split_plan(4096, 8, cpu, None) == (33, 128)
    assert launch.split_plan(32768, 8, cpu, 512) == (64, 512)
