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


def test_the_split_examples_cut_whole_tiles_and_do_not_grow_with_the_context():
    """A decode step's number of splits depends on the programs and the SMs, not on the
    context; each split is whole key tiles, and the splits cover the keys."""
    from rqlib.kernels import limits as geo

    found = kernel_checks.split_examples()
    for length, splits, partition in (
        (found["example_long"], found["example_splits"], found["example_long_partition"]),
        (found["example_short"], found["example_splits"], found["example_short_partition"]),
        (found["example_long"], found["example_batch_splits"], found["example_batch_partition"]),
    ):
        assert partition % geo.ATTENTION_BLOCK_S == 0 and splits * partition >= length
        assert (splits - 1) * partition < length + geo.ATTENTION_BLOCK_S * splits
    assert 1 <= found["example_batch_splits"] <= found["example_splits"] <= geo.MAX_SPLITS
    # programs x splits fill SPLIT_WAVES waves of the SMs, unless MAX_SPLITS caps them
    programs = found["example_kv_heads"]
    assert programs * found["example_splits"] >= min(
        geo.SPLIT_WAVES * found["example_sms"], programs * geo.MAX_SPLITS
    )


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


def test_the_attention_sources_are_the_kernel_s_own_lines():
    """The excerpts the chapter shows after the online softmax: tile_range, the softmax step,
    the loop over one stream's tiles (which calls the softmax step) and the reduce's merge; a
    kernel rewrite that moves a marker fails here, not in the book build."""
    excerpts = kernel_checks.attention_sources()
    assert [e.path.rsplit("/", 1)[-1] for e in excerpts] == ["triton_attention.py"] * 4
    tile, step, walk, merge = (e.text for e in excerpts)
    assert "def tile_range(" in tile and "def softmax_step(" in step
    assert "for tile in range(" in walk and "softmax_step(" in walk
    assert merge.lstrip().startswith("m_max = tl.load(part_m_ptr")
