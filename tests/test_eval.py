"""rqlib.study.eval: windows, honest bit accounting and the one-pass evaluation on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rqlib.cli import format_table
from rqlib.spec.bits import average_bits, bytes_per_token
from rqlib.spec.config import CompressionConfig
from rqlib.study.eval import evaluate, windows


def test_non_overlapping_windows_score_every_token_but_the_first_of_each():
    spans = windows(10, 4)
    assert spans == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert windows(9, 4)[-1] == (4, 8, 5)  # a last window of one token has nothing to score


def test_strided_windows_score_each_token_once():
    for n, window, stride in [(20, 8, 4), (17, 6, 5), (9, 9, 9), (30, 10, 1)]:
        spans = windows(n, window, stride)
        scored = [t for _, end, first in spans for t in range(first, end)]
        assert scored == list(range(1, n))
        assert all(end - begin <= window and first > begin for begin, end, first in spans)


@pytest.mark.parametrize(
    "bad",
    [
        dict(n_tokens=1, window=4),
        dict(n_tokens=10, window=1),
        dict(n_tokens=10, window=4, stride=5),
        dict(n_tokens=10, window=4, stride=0),
    ],
)
def test_bad_windows_raise(bad):
    with pytest.raises(ValueError):
        windows(**bad)


SMOL_LIKE = LlamaConfig(
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64
)


def test_average_bits_counts_codes_norms_qjl_and_exact_tokens():
    fp = average_bits(None, SMOL_LIKE)
    assert fp["mean"] == 16
    mse = average_bits(CompressionConfig.parse("turboquant-mse:k3"), SMOL_LIKE)
    assert mse["key"] == (64 * 3 + 16) / 64 and mse["value"] == 16
    # prod at 3 bits: 2-bit codes, 64 sign bits, two fp16 norms
    prod = average_bits(CompressionConfig.parse("turboquant-prod:k3:v3"), SMOL_LIKE)
    assert prod["key"] == (64 * 2 + 64 + 32) / 64
    assert prod["value"] == (64 * 3 + 16) / 64
    # 1 sink + 32 recent tokens exact (K and V) at 16 bits, amortized over 4096 tokens
    windowed = average_bits(CompressionConfig.parse("turboquant-mse:b3:sink1:win32"), SMOL_LIKE)
    assert windowed["key"] == pytest.approx((64 * 3 + 16) / 64 + 16 * 33 / 4096)
    # the same band stored at 8 bits (wb=8): 8-bit codes and an 11-bit norm (nm=6) per token
    banded = average_bits(
        CompressionConfig.parse("turboquant-mse:b3:sink1:win32:wb=8:nm=6"), SMOL_LIKE
    )
    codes = (64 * 3 + 11) / 64
    assert banded["key"] == pytest.approx(codes + 16 / 4096 + 32 * (64 * 8 + 11) / 64 / 4096)
    assert banded["value"] == banded["key"]
    # two exact layers of 30
    exact = average_bits(CompressionConfig.parse("turboquant-mse:b3:exact=0,-1"), SMOL_LIKE)
    assert exact["key"] == pytest.approx((28 * 3.25 + 2 * 16) / 30)
    # rotor blocks pad 64 coordinates to 66
    rotor = average_bits(CompressionConfig.parse("rotorquant-mse:k3"), SMOL_LIKE)
    assert rotor["key"] == (8 * math.ceil(66 * 3 / 8) + 16) / 64
    assert bytes_per_token(None, SMOL_LIKE) == 30 * 3 * 64 * 2 * 2


def test_average_bits_rejects_a_bad_context():
    with pytest.raises(ValueError, match="context"):
        average_bits(None, SMOL_LIKE, context=0)


def test_evaluate_runs_all_methods_on_the_same_windows(rng):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (40,), generator=rng)
    exact = CompressionConfig.parse("turboquant-mse:k2:win64")
    lossy = CompressionConfig.parse("turboquant-mse:k1:v1")
    fp, kept, compressed = evaluate(model, ids, [exact, lossy], window=16, stride=8, progress=False)
    assert fp.n_scored == kept.n_scored == compressed.n_scored == 39
    assert fp.kl == 0 and fp.top1 == 1
    # everything exact: the same distribution up to fp32 rounding of the attention
    assert kept.perplexity == pytest.approx(fp.perplexity, rel=1e-5)
    # KL of two fp32 log-softmaxes that differ by rounding only (~1e-7 per entry)
    assert kept.kl < 1e-6 and kept.top1 == 1
    assert compressed.kl > 0  # 1-bit keys and values do change the distribution
    rows = [r.to_dict(fp.perplexity) for r in (fp, kept, compressed)]
    table = format_table(rows)
    assert table.count("\n") == 4 and "turboquant-mse:k1:v1" in table


def test_evaluate_rejects_bad_inputs(rng):
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=1,
        )
    ).eval()
    with pytest.raises(ValueError, match="1-d"):
        evaluate(model, torch.zeros(2, 8, dtype=torch.long), [], progress=False)
    with pytest.raises(TypeError, match="CompressionConfig"):
        evaluate(model, torch.zeros(8, dtype=torch.long), ["turboquant-mse:k3"], progress=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--method", "kivi:k3"], "unknown method"),
        (["eval", "--method", "turboquant-mse:k3:zz"], "unknown token"),
        (["eval", "--corpus", "ptb"], "unknown corpus"),
        (["eval", "--tokens", "1"], "--tokens"),
        (["eval", "--model", "/no/such/model/dir"], "cannot load model"),
    ],
)
def test_eval_command_reports_bad_input(argv, message, capsys):
    from rqlib.__main__ import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
