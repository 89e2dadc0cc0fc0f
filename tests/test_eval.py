"""rqlib.study.eval: windows, honest bit accounting and the one-pass evaluation on a tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from greedy import ROUNDING_TIE, assert_top1_agrees_but_at_ties, top1_near_ties
from test_hf import seed_of, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from rqlib.cli import format_table
from rqlib.spec.bits import average_bits, bytes_per_token
from rqlib.spec.config import CompressionConfig
from rqlib.study.eval import (
    compare_modes,
    evaluate,
    select_tokens,
    tokens_sha256,
    window_batches,
    windows,
)
from rqlib.study.peers import Peer


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
    # KL of two fp32 log-softmaxes that differ by rounding only (~1e-7 per entry), which can
    # pick the other top token only where the best two logits are that close
    assert kept.kl < 1e-6
    assert_top1_agrees_but_at_ties(kept, top1_near_ties(model, ids, 16, 8, ROUNDING_TIE))
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
        (["eval", "--mode", "chunked"], "--chunk N goes with --mode chunked"),
        (["eval", "--chunk", "4"], "--chunk N goes with --mode chunked"),
        (["eval", "--mode", "chunked", "--chunk", "0"], "chunk, an int >= 1"),
        (["eval", "--offset", "-1"], "--offset"),
        (["eval", "--batch", "0"], "--batch must be >= 1"),
        (["eval", "--method", "hf-quanto:int3"], "int2, int4"),
        (
            ["eval", "--mode", "chunked", "--chunk", "8", "--method", "hf-quanto:int4"],
            "chunked mode would flatter it",
        ),
    ],
)
def test_eval_command_reports_bad_input(argv, message, capsys):
    from rqlib.__main__ import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ---- offset, modes -----------------------------------------------------------------------------
def test_select_tokens_takes_the_stated_tokens(rng):
    ids = torch.randint(0, 1000, (500,), generator=rng)
    offset = int(torch.randint(0, 400, (1,), generator=rng))
    # n >= 3: the shifted selection below takes n - 1 tokens, and select_tokens needs two
    n = int(torch.randint(3, 500 - offset + 1, (1,), generator=rng))
    chosen = select_tokens(ids, offset, n)
    assert chosen.tolist() == ids.tolist()[offset : offset + n]
    with pytest.raises(ValueError, match="the corpus has 500 tokens"):
        select_tokens(ids, 499, 2)
    for bad in (dict(offset=-1, n_tokens=4), dict(offset=0, n_tokens=1)):
        with pytest.raises(ValueError):
            select_tokens(ids, **bad)
    assert tokens_sha256(chosen) == tokens_sha256(chosen.clone())
    assert tokens_sha256(chosen) != tokens_sha256(select_tokens(ids, offset + 1, n - 1))


def tiny_llama(rng: torch.Generator):
    """A random Llama with 3 layers, 2 KV heads of head_dim 16 (test_hf's)."""
    return tiny_model("llama", seed_of(rng))


# A lossy config with every part the modes could disagree on: compressed keys and values,
# an exact sink, and a recent band relative to each query.
LOSSY = "turboquant-mse:k2:v2:sink1:win4"
# Significance of the paired test over windows (two tests, NLL and KL, per comparison; one
# comparison per test). Where the modes agree, a p-value is uniform (differences that are float
# noise) or larger (most windows equal: one differing window gives t = 1, p = 0.34), so a
# correct harness fails with probability at most 2 x 5e-7 = 1e-6 per test. A batch that scores
# each window against its neighbour's reference moved the KL of every window (t = 10.5 over 13
# windows, p = 2e-7: it fails).
ALPHA = 5e-7
# A gross bound besides: the mean KL of the two modes within 10 % of each other (a code flipped
# by float order moves one window's KL by a few percent, the mean over 12 windows by a few
# tenths of a percent per flip; it takes dozens of flips to reach 10 %). Over 600 comparisons
# (200 seeds, tests/audit/randomized-200.txt) the largest share was 2.1e-3, 47x below.
KL_SHARE = 0.10
# The lossy cache must move the distribution: its KL to the reference is at least CHANGED_KL.
# A cache that stores the keys and values exactly (hf-dynamic, scored beside it) reaches only
# fp32 rounding, |KL| of a few 1e-8 nats; the lossy cache's KL, a mean over 180 tokens, stays
# near 1e-4. Over 200 seeds (tests/audit/randomized-200.txt) the smallest lossy KL of 400
# was 9.8e-5, 98x above the bound, and the exact peer's largest |KL| 3.5e-8, 29x below it.
CHANGED_KL = 1e-6


def assert_agree(a, b, record_statistic) -> None:
    comparison = compare_modes(a, b, confidence=1 - ALPHA)
    record_statistic("paired test p, NLL", comparison["nll"]["p"], ALPHA, at_least=True)
    record_statistic("paired test p, KL", comparison["kl"]["p"], ALPHA, at_least=True)
    share = abs(comparison["kl"]["mean_diff"]) / b.kl
    record_statistic("|mean KL difference| / KL", share, KL_SHARE)


@pytest.mark.randomized
def test_decode_and_prefill_agree_in_distribution(rng, record_statistic):
    """The same cache, fed token by token or in one forward per window: paired t-tests over
    12 windows of the per-window mean NLL and KL find no difference at 0.001 (they differ in a
    window only where a code flipped because float sums ran in another order)."""
    model = tiny_llama(rng)
    ids = torch.randint(0, 128, (192,), generator=rng)
    config = CompressionConfig.parse(LOSSY)
    fp, prefill = evaluate(model, ids, [config], window=16, mode="prefill", progress=False)
    fp_decode, decode = evaluate(model, ids, [config], window=16, mode="decode", progress=False)
    record_statistic("KL of the lossy cache", prefill.kl, CHANGED_KL, at_least=True)
    assert decode.n_scored == prefill.n_scored == 12 * 15
    # one reference in both modes: the same one-shot forward (equal up to fp32 rounding, as
    # CPU kernels need not sum in the same order twice)
    assert torch.allclose(fp.per_token("nll"), fp_decode.per_token("nll"), rtol=0, atol=1e-5)
    assert_agree(decode, prefill, record_statistic)
    assert decode.tokens_fed == 12 * 15 and prefill.tokens_fed == 12 * 16  # no last token
    # decode mode on CPU reads a decoded copy of the codes (test_decoded_copy.py: same numbers)
    assert decode.extra["decoded_copy"] is True and "decoded_copy" not in prefill.extra


@pytest.mark.randomized
def test_chunked_agrees_with_decode(rng, record_statistic):
    model = tiny_llama(rng)
    ids = torch.randint(0, 128, (192,), generator=rng)
    chunk = int(torch.randint(2, 9, (1,), generator=rng))
    config = CompressionConfig.parse(LOSSY)
    _, decode = evaluate(model, ids, [config], window=16, mode="decode", progress=False)
    _, chunked = evaluate(
        model, ids, [config], window=16, mode="chunked", chunk=chunk, progress=False
    )
    assert chunked.n_scored == decode.n_scored == 12 * 15
    assert_agree(chunked, decode, record_statistic)


def test_window_batches_group_consecutive_windows_of_equal_length(rng):
    window = int(torch.randint(4, 20, (1,), generator=rng))
    batch = int(torch.randint(2, 6, (1,), generator=rng))
    # whole windows, not a multiple of batch (the last group has room), then a shorter one of
    # 2 .. window - 1 tokens: a grouping that ignored lengths would put it in that last group
    whole = batch * int(torch.randint(2, 4, (1,), generator=rng))
    whole += int(torch.randint(1, batch, (1,), generator=rng))
    n_tokens = window * whole + int(torch.randint(2, window, (1,), generator=rng))
    for stride in (None, max(1, window // 3)):
        spans = windows(n_tokens, window, stride)
        groups = window_batches(spans, batch)
        assert [span for group in groups for span in group] == spans  # all, in order
        for group in groups:
            assert 1 <= len(group) <= batch
            assert len({end - begin for begin, end, _ in group}) == 1
        for before, after in zip(groups, groups[1:]):  # a group is cut only when it must be
            full = len(before) == batch
            longer = before[0][1] - before[0][0] != after[0][1] - after[0][0]
            assert full or longer


@pytest.mark.randomized
def test_batched_windows_score_like_one_window_at_a_time(rng, record_statistic):
    """Windows fed as a batch of sequences (ours in one batched cache, the peer one window at a
    time) give each window the scores it gets alone: the one-shot reference and the exact peer
    to fp32 rounding (1e-5 nats per token), our lossy cache in distribution (the paired tests of
    :func:`assert_agree`: each sequence is compressed on its own, a batched product may round
    differently and flip a code). A batch that scored a window against another's tokens or
    reference fails all three."""
    model = tiny_llama(rng)
    ids = torch.randint(0, 128, (200,), generator=rng)  # 12 windows of 16 and one of 8
    batch = int(torch.randint(2, 6, (1,), generator=rng))
    methods = [CompressionConfig.parse(LOSSY), Peer.parse("hf-dynamic")]
    alone = evaluate(model, ids, methods, window=16, mode="decode", progress=False)
    together = evaluate(model, ids, methods, window=16, mode="decode", batch=batch, progress=False)
    for a, b in zip(alone, together):
        assert a.n_scored == b.n_scored == 12 * 15 + 7
        fed = 12 * 16 + 8 if a.label == "fp" else 12 * 15 + 7  # fp: one forward per window
        assert a.tokens_fed == b.tokens_fed == fed
    for index in (0, 2):  # fp, hf-dynamic
        assert torch.allclose(
            alone[index].per_token("nll"), together[index].per_token("nll"), rtol=0, atol=1e-5
        )
    record_statistic("KL of the lossy cache", together[1].kl, CHANGED_KL, at_least=True)
    # the exact peer stays below the same bound: it rejects a cache that changes nothing
    record_statistic("|KL| of the exact peer", abs(together[2].kl), CHANGED_KL)
    assert_agree(together[1], alone[1], record_statistic)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        evaluate(model, ids, methods, window=16, batch=0, progress=False)


def test_modes_score_each_token_once_with_strided_windows(rng):
    model = tiny_llama(rng)
    ids = torch.randint(0, 128, (30,), generator=rng)
    config = CompressionConfig.parse("turboquant-mse:k3")
    counts = set()
    for mode, chunk in (("prefill", None), ("decode", None), ("chunked", 5)):
        fp, result = evaluate(
            model, ids, [config], window=12, stride=5, mode=mode, chunk=chunk, progress=False
        )
        counts.add((fp.n_scored, result.n_scored))
    assert counts == {(29, 29)}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="greedy"), "mode must be one of"),
        (dict(mode="chunked"), "chunk, an int >= 1"),
        (dict(mode="chunked", chunk=0), "chunk, an int >= 1"),
        (dict(mode="decode", chunk=4), "chunked' only"),
    ],
)
def test_evaluate_rejects_bad_modes(kwargs, message, rng):
    model = tiny_llama(rng)
    with pytest.raises(ValueError, match=message):
        evaluate(model, torch.zeros(8, dtype=torch.long), [], progress=False, **kwargs)


def test_compare_modes_needs_the_same_tokens(rng):
    model = tiny_llama(rng)
    ids = torch.randint(0, 128, (20,), generator=rng)
    (fp,) = evaluate(model, ids, [], window=10, progress=False)
    (short,) = evaluate(model, ids[:12], [], window=10, progress=False)
    same = compare_modes(fp, fp)
    assert (same["windows"], same["tokens"]) == (2, 18)
    assert same["kl"]["p"] == 1 and same["nll"]["ci"] == (0.0, 0.0)
    with pytest.raises(ValueError, match="different windows"):
        compare_modes(fp, short)
    (one,) = evaluate(model, ids, [], window=20, progress=False)
    with pytest.raises(ValueError, match="at least 2 windows"):
        compare_modes(one, one)


@pytest.mark.model
def test_eval_command_end_to_end_in_decode_mode_from_an_offset(tmp_path, rng, capsys):
    """The path a user runs: held-out tokens from an offset, decode mode, a peer, the exact
    control and one of ours; the JSON says which tokens were used, and load_headline reads it."""
    from rqlib.__main__ import main
    from rqlib.base.corpora import load_corpus
    from rqlib.book.loaders import load_headline
    from rqlib.hf.models import load_model

    offset = int(torch.randint(0, 100_000, (1,), generator=rng))
    path = tmp_path / "headline.json"
    argv = ["eval", "--corpus", "pydoc", "--tokens", "24", "--window", "12"]
    argv += ["--offset", str(offset), "--mode", "decode", "--no-progress", "--json", str(path)]
    for method in ("hf-quanto:int4", "hf-dynamic", "turboquant-mse:k3"):
        argv += ["--method", method]
    assert main(argv) == 0
    assert "decode mode" in capsys.readouterr().out
    payload = json.loads(path.read_text())
    _, tokenizer = load_model("smollm2-135m")
    text = load_corpus("pydoc").text
    expected = tokenizer(text, add_special_tokens=False)["input_ids"][offset : offset + 24]
    assert payload["tokens_sha256"] == tokens_sha256(torch.tensor(expected))
    assert (payload["offset"], payload["mode"], payload["windows"]) == (offset, "decode", 2)
    frame = load_headline(path)
    assert list(frame["method"]) == ["fp", "hf-quanto:int4", "hf-dynamic", "turboquant-mse:k3"]
    assert list(frame["kind"]) == ["fp", "peer", "control", "rqlib"]
    assert (frame["n_scored"] == 22).all() and (frame["seconds_per_token"] > 0).all()
    assert (frame["offset"] == offset).all()
    assert list(frame["decoded_copy"]) == [False, False, False, True]  # only ours keep one
    exact = frame.set_index("method").loc["hf-dynamic"]
    assert abs(exact["kl"]) < 1e-5 and exact["top1"] == 1


def test_load_headline_names_a_file_of_another_kind(tmp_path):
    from rqlib.book.loaders import load_headline

    path = tmp_path / "presets.json"
    path.write_text(json.dumps({"kind": "presets", "rows": []}))
    with pytest.raises(ValueError, match=f"{path} is not a file written by `rqlib eval --json`"):
        load_headline(path)
