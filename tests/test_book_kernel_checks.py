"""Chapter 3's kernel checks (rqlib.book.kernel_checks): they pass on the kernels, fail on a
kernel that is slightly wrong, and the byte model and benchmark arguments match the CLI's."""

import argparse

import pytest
import torch

from rqlib import kernels
from rqlib.book import kernel_checks
from rqlib.cli import COMMANDS
from rqlib.study import bench


def test_the_checks_pass_on_the_interpreted_kernels(rng):
    seed = int(torch.randint(0, 1000, (1,), generator=rng))
    scores = kernel_checks.scores_check(64, 3, 2, seed, "cpu")
    attention = kernel_checks.attention_check(64, 3, 4, 2, seed, "cpu")
    bound = kernel_checks.tolerance("cpu")
    assert scores["vs_float64"] <= bound and scores["vs_inner_product"] <= bound
    assert attention["prompt"] <= bound and attention["decode"] <= bound
    assert attention["splits"] == 4


def test_the_scores_check_sees_a_kernel_off_by_a_part_in_ten_thousand(monkeypatch, rng):
    real = kernels.fused_scores
    monkeypatch.setattr(kernels, "fused_scores", lambda *a, **k: real(*a, **k) * (1 + 1e-4))
    scores = kernel_checks.scores_check(64, 3, 2, 0, "cpu")
    # a relative error of 1e-4 everywhere is ten times the bound
    assert scores["vs_float64"] > kernel_checks.tolerance("cpu")


def test_the_attention_check_sees_a_kernel_off_by_a_part_in_ten_thousand(monkeypatch):
    real = kernels.attention
    monkeypatch.setattr(kernels, "attention", lambda *a, **k: real(*a, **k) * (1 + 1e-4))
    attention = kernel_checks.attention_check(64, 3, 4, 2, 0, "cpu")
    bound = kernel_checks.tolerance("cpu")
    assert attention["prompt"] > bound and attention["decode"] > bound


def test_the_lanes_check_passes_and_sees_one_lane_off(monkeypatch, rng):
    """A decode step in 1, 2 and 4 lanes agrees with the float64 reference; a kernel whose
    4-lane output is off by a part in ten thousand fails the check."""
    seed = int(torch.randint(0, 1000, (1,), generator=rng))
    found = kernel_checks.lanes_check(64, 3, 2, 3, seed, "cpu")
    bound = kernel_checks.tolerance("cpu")
    assert all(found[lanes] <= bound for lanes in (1, 2, 4))
    assert found["spread"] <= bound and found["default"] == 4
    real = kernels.attention

    def off_in_four_lanes(*args, **kwargs):
        return real(*args, **kwargs) * (1 + 1e-4 * (kwargs.get("lanes") == 4))

    monkeypatch.setattr(kernels, "attention", off_in_four_lanes)
    found = kernel_checks.lanes_check(64, 3, 2, 3, seed, "cpu")
    assert found[4] > bound and found["spread"] > bound and found[1] <= bound


@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_the_lane_map_keeps_the_columns_of_each_lane(lanes):
    """Row i of a tile keeps (own_lane) and weights back (spread_lane) exactly the columns of
    its lane, the keys lane_range gives it (the masks read these): lane i % lanes."""
    found = kernel_checks.lane_map(lanes, "cpu")
    read, keys = found["read"], found["keys"]
    width = read.shape[1] // lanes
    for i, row in enumerate(read):
        lane = i % lanes
        columns = torch.arange(lane * width, (lane + 1) * width)
        assert torch.equal(keys[i], columns.int())
        assert torch.equal(torch.nonzero(row).flatten(), columns)
        assert torch.equal(row[columns], columns.int() + 1)


def test_benchmark_arguments_are_the_cli_defaults_with_the_chapter_values():
    parser = argparse.ArgumentParser()
    COMMANDS["bench"][0](parser)
    cli = parser.parse_args(
        ["kernels", "--head-dim", "128", "--key-bits", "3", "--value-bits", "4", "--group", "4"]
        + ["--kv-heads", "8", "--kv-lens", "1024,4096", "--hbm-gbps", "4800"]
    )
    ours = kernel_checks.bench_arguments(
        head_dim=128,
        key_bits=3,
        value_bits=4,
        group=4,
        kv_heads=8,
        kv_lens=[1024, 4096],
        hbm_gbps=4800.0,
    )
    assert vars(ours) == vars(cli)


def test_byte_table_is_the_bench_byte_model():
    sizes = dict(head_dim=64, value_bits=4, group=4, kv_heads=8, kv_lens=[1024], hbm_gbps=None)
    table = kernel_checks.byte_table([2, 3], **sizes)
    assert list(table.index) == [2, 3] and list(table.columns) == list(kernel_checks.FORMATS)
    formats = bench.byte_formats(kernel_checks.bench_arguments(key_bits=3, **sizes))
    assert table.loc[3].tolist() == [nbytes for _, nbytes, _ in formats]
    assert table.loc[3, "fp16"] == 128.0


def test_benchmark_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = kernel_checks.bench_arguments(
        head_dim=64, key_bits=3, value_bits=4, group=4, kv_heads=8, kv_lens=[1024], hbm_gbps=None
    )
    with pytest.raises(RuntimeError, match="CUDA"):
        kernel_checks.benchmark(args)
