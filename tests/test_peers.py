"""rqlib.study.peers: the caches a transformers user would pick instead, as methods.

The bit counts are checked against counts done by hand from the storage formats (codes packed
per byte or per 32-bit word, a scale and a zero point per group at 16 bits, exact tokens at 16
bits), on tiny random models fed token by token as generate() feeds them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math

import pytest
import torch
from greedy import ROUNDING_TIE, assert_top1_agrees_but_at_ties, top1_near_ties
from test_hf import VOCAB, head_dim_64_model, seed_of, tiny_model
from transformers import LlamaConfig

from rqlib.base.install import no_deps_requirements
from rqlib.study import peers
from rqlib.study.eval import compare_modes, evaluate
from rqlib.study.peers import PEER_NAMES, Peer, stored_bits


def tiny_llama(rng: torch.Generator):
    """A random Llama with 3 layers, 2 KV heads of head_dim 16 (test_hf's)."""
    return tiny_model("llama", seed_of(rng))


def tiny_gemma3(rng: torch.Generator):
    """A random Gemma 3 with a sliding window of 6 on 3 of its 4 layers, head_dim 32."""
    return tiny_model("gemma3", seed_of(rng))


def feed(model, cache, ids: torch.Tensor) -> None:
    with torch.no_grad():
        for t in range(ids.shape[1]):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)


# ---- names -----------------------------------------------------------------------------------
def test_peer_names_parse_and_round_trip():
    for name in PEER_NAMES:
        assert Peer.parse(name).label == name
    peer = Peer.parse("hf-quanto:int2:group=32:res=16")
    assert (peer.backend, peer.nbits, peer.group_size, peer.residual_length) == (
        "quanto",
        2,
        32,
        16,
    )
    assert Peer.parse(peer.label) == peer
    assert Peer.parse("hf-hqq:int3:group=64:res=128").label == "hf-hqq:int3"  # defaults omitted


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hf-quanto:int3", "int2, int4"),
        ("hf-quanto", "bit width"),
        ("hf-fp8:int4", "no bit width"),
        ("hf-fp8:res=16", "no group size"),
        ("hf-kivi:int2", "unknown peer"),
        ("hf-quanto:int4:group=0", "positive"),
        ("hf-quanto:int4:res=x", "positive"),
        ("hf-quanto:int4:int2", "repeated"),
        ("hf-quanto:int4:k3", "unknown or repeated token"),
        ("turboquant-mse:k3", "not a peer"),
    ],
)
def test_bad_peer_names_raise(spec, message):
    with pytest.raises(ValueError, match=message):
        Peer.parse(spec)


# ---- bits ------------------------------------------------------------------------------------
def hand_count(peer: Peer, tokens: int, kv_heads: int, head_dim: int) -> int:
    """Bits of one layer's keys after ``tokens`` tokens fed one at a time, from the formats."""
    if peer.backend == "fp8":
        return tokens * kv_heads * head_dim * 8 + 32  # fp8 codes, one float32 scale
    # the first token is quantized at once; then the residual grows to res - 1 and is flushed
    # (everything quantized again) when the next token would fill it
    exact = (tokens - 1) % peer.residual_length
    quantized = tokens - exact
    g, b = peer.group_size, peer.nbits
    groups = quantized * kv_heads * head_dim // g
    if peer.backend == "quanto":  # codes packed along the groups: 8 // b groups' codes per row
        codes = math.ceil(groups / (8 // b)) * g * 8
    elif b == 3:  # hqq: a group is a column of g codes; ten 3-bit codes per 32-bit word
        codes = groups * math.ceil(g / 10) * 32
    else:  # hqq: 8 // b codes per byte down the column
        codes = groups * (g // (8 // b)) * 8
    return codes + groups * 2 * 16 + exact * kv_heads * head_dim * 16


QUANTIZING = ["hf-quanto:int4", "hf-quanto:int2", "hf-hqq:int4", "hf-hqq:int3", "hf-hqq:int2"]


@pytest.mark.parametrize("name", QUANTIZING + ["hf-fp8"])
def test_stored_bits_match_a_hand_count(name, rng):
    """A peer run token by token on a tiny model stores what the format says, bit for bit;
    the amortized formula is the same count without quanto's row padding."""
    model = tiny_llama(rng)
    kv_heads, head_dim = 2, 16
    group = [8, 16][int(torch.randint(0, 2, (1,), generator=rng))]
    residual = int(torch.randint(3, 12, (1,), generator=rng))
    tokens = int(torch.randint(residual + 2, 3 * residual + 8, (1,), generator=rng))
    suffix = "" if name == "hf-fp8" else f":group={group}:res={residual}"
    peer = Peer.parse(name + suffix)
    cache = peer.make_cache(model)
    feed(model, cache, torch.randint(0, VOCAB, (1, tokens), generator=rng))
    coordinates = tokens * kv_heads * head_dim
    expected = hand_count(peer, tokens, kv_heads, head_dim) / coordinates
    measured = stored_bits(peer, cache, model.config)
    assert measured == {"key": expected, "value": expected, "mean": expected}
    if peer.group_wise:
        exact = (tokens - 1) % residual
        padding = 0
        if peer.backend == "quanto":
            groups = (tokens - exact) * kv_heads * head_dim // group
            padding = (-groups % (8 // peer.nbits)) * group * peer.nbits
        formula = peer.bits_of_state(model.config, tokens - exact, exact)
        assert formula == pytest.approx(expected - padding / coordinates, rel=1e-12)


def test_amortized_bits_at_a_long_context_by_hand():
    config = LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    )
    mean_exact = 127 / 2  # the residual holds 0..127 exact tokens; counted at its mean
    int4 = Peer.parse("hf-quanto:int4").bits(config, 4096)
    assert int4["key"] == pytest.approx(
        ((4096 - mean_exact) * (4 + 32 / 64) + mean_exact * 16) / 4096
    )
    assert int4["exact_tokens"] == mean_exact and int4["mean"] == int4["value"] == int4["key"]
    hqq3 = Peer.parse("hf-hqq:int3").bits(config, 1024)
    assert hqq3["key"] == pytest.approx(
        ((1024 - mean_exact) * (224 / 64 + 0.5) + mean_exact * 16) / 1024
    )
    # shorter than the residual, fed token by token: only the first token is quantized
    short = Peer.parse("hf-quanto:int2").bits(config, 100)
    assert short["key"] == pytest.approx((1 * 2.5 + 99 * 16) / 100)
    fp8 = Peer.parse("hf-fp8").bits(config, 4096)
    assert fp8["key"] == pytest.approx(8 + 32 / (4096 * 3 * 64))
    assert Peer.parse("hf-dynamic").bits(config, 4096)["mean"] == 16
    assert Peer.parse("hf-quanto:int4").bytes_per_token(config, 4096) == pytest.approx(
        2 * int4["key"] * 30 * 3 * 64 / 8
    )
    with pytest.raises(ValueError, match="context"):
        Peer.parse("hf-fp8").bits(config, 0)


# ---- the caches in an evaluation -------------------------------------------------------------
def test_a_quantizing_peer_is_exact_in_prefill_and_not_in_decode(rng):
    """Why peers are compared in decode mode: QuantizedCache returns the chunk it is given
    exact, so one forward over a window shows no error; decode mode shows the quantization in
    every window: a paired sign test over the 12 windows rejects agreement (one-sided
    p = 2^-12 = 2.4e-4). Over 12 random draws (144 windows) the smallest window's KL excess was
    1.2e-4, against a prefill KL below 1e-6; a draw fails only if some window's KL falls
    120-fold below the smallest seen. (The paired t-test of compare_modes is not asserted at
    p < 1e-3: its t ranged 7.7-14.9 over those draws against a threshold of 4.4, so it would
    miss about once in a thousand runs.)"""
    model = tiny_llama(rng)
    ids = torch.randint(0, VOCAB, (192,), generator=rng)
    peer = Peer.parse("hf-quanto:int2:group=16:res=4")
    fp, prefill = evaluate(model, ids, [peer], window=16, mode="prefill", progress=False)
    _, decode = evaluate(model, ids, [peer], window=16, mode="decode", progress=False)
    # prefill: the model's own attention over exact states, against the same forward
    # without a cache (fp32 rounding only)
    assert abs(prefill.kl) < 1e-6
    assert_top1_agrees_but_at_ties(prefill, top1_near_ties(model, ids, 16, None, ROUNDING_TIE))
    assert decode.kl > 1e-4
    excess = decode.per_window("kl") - prefill.per_window("kl")
    assert len(excess) == 12 and (excess > 0).all(), excess
    assert compare_modes(decode, prefill)["kl"]["mean_diff"] > 0
    assert decode.extra["stored_bits"]["mean"] < 16  # something was stored quantized
    assert decode.config["peer"] == peer.label and decode.bits == peer.bits(model.config, 4096)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_exact_peer_in_decode_mode_reproduces_the_one_shot_model(kind, rng):
    """The decode harness's control: DynamicCache fed token by token gives the one-shot
    forward's distribution (fp32 rounding: |KL| < 1e-6, the same argmax but at near ties, PPL
    to 1e-5), also on
    Gemma 3 where every layer keeps every token and the mask applies the sliding window."""
    model = tiny_llama(rng) if kind == "llama" else tiny_gemma3(rng)
    ids = torch.randint(0, VOCAB, (40,), generator=rng)
    fp, exact = evaluate(
        model, ids, [Peer.parse("hf-dynamic")], window=20, mode="decode", progress=False
    )
    assert exact.n_scored == fp.n_scored == 38
    assert abs(exact.kl) < 1e-6
    assert_top1_agrees_but_at_ties(exact, top1_near_ties(model, ids, 20, None, ROUNDING_TIE))
    assert exact.perplexity == pytest.approx(fp.perplexity, rel=1e-5)
    assert exact.tokens_fed == 38 and exact.seconds > 0


def test_quantized_peers_run_on_sliding_window_models_and_say_how(rng):
    model = tiny_gemma3(rng)
    ids = torch.randint(0, VOCAB, (24,), generator=rng)
    peer = Peer.parse("hf-quanto:int4:group=32:res=4")
    assert "sliding-window" in peer.note(model.config)
    assert Peer.parse("hf-dynamic").note(model.config) is None
    _, result = evaluate(model, ids, [peer], window=24, mode="decode", progress=False)
    assert "sliding-window" in result.extra["note"]
    assert result.kl > 0 and math.isfinite(result.perplexity)


def test_peers_refuse_a_group_that_does_not_divide_the_head(rng):
    with pytest.raises(ValueError, match="not a multiple of the group size 64"):
        Peer.parse("hf-quanto:int4").make_cache(tiny_llama(rng))
    Peer.parse("hf-quanto:int4").make_cache(head_dim_64_model(rng))  # the default group fits


def test_chunked_mode_refuses_peers_that_keep_their_chunk_exact(rng):
    model = tiny_llama(rng)
    ids = torch.randint(0, VOCAB, (16,), generator=rng)
    for name in QUANTIZING + ["hf-fp8"]:
        with pytest.raises(ValueError, match="chunked mode would flatter it"):
            evaluate(model, ids, [Peer.parse(name)], window=8, mode="chunked", chunk=4)
    evaluate(model, ids, [Peer.parse("hf-dynamic")], window=8, mode="chunked", chunk=4)


def test_a_missing_backend_package_is_named(monkeypatch, rng):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps hqq"):
        Peer.parse("hf-hqq:int2").make_cache(tiny_llama(rng))


def test_a_stale_build_lock_is_an_error_naming_it_and_a_fresh_one_is_waited_for(
    tmp_path, monkeypatch, rng
):
    """torch waits forever on the lock file of an extension build; a lock older than the
    threshold (a build stopped half-way) must be an error that names the file, a young one
    (a build under way) must not."""
    lock = tmp_path / "build" / "lock"
    lock.parent.mkdir()
    lock.touch()
    now = lock.stat().st_mtime
    peers.check_build_lock(lock, now=now + peers.STALE_BUILD_LOCK_SECONDS - 1)  # young: waits
    with pytest.raises(RuntimeError, match=str(lock)):
        peers.check_build_lock(lock, now=now + peers.STALE_BUILD_LOCK_SECONDS + 1)
    peers.check_build_lock(tmp_path / "no-lock")  # no lock: nothing to say
    # the quanto peer checks its own lock before it builds a cache
    monkeypatch.setattr(peers, "_quanto_build_lock", lambda: lock)
    monkeypatch.setattr(peers, "STALE_BUILD_LOCK_SECONDS", -1)
    with pytest.raises(RuntimeError, match="delete that file"):
        Peer.parse("hf-quanto:int4").make_cache(tiny_llama(rng))


# ---- installation ----------------------------------------------------------------------------
def test_the_peers_group_is_installed_without_deps_and_consistent():
    """The peers group is installed with --no-deps (pyproject's no-deps-extras); what is
    installed matches its pins, and every dependency those packages declare is installed
    (what `pip check` checks)."""
    requirements = [r for r in no_deps_requirements() if not r.startswith(("llm-", "gemma3-"))]
    pins = dict(r.split("==") for r in requirements)
    assert {"optimum-quanto", "hqq"} <= set(pins)
    for name, version in pins.items():
        assert importlib.metadata.version(name) == version, name
        for requirement in importlib.metadata.requires(name) or []:
            if "extra ==" in requirement:
                continue
            dependency = requirement.split(";")[0].split("[")[0]
            for sep in "<>=!~ (":
                dependency = dependency.split(sep)[0]
            assert importlib.metadata.version(dependency), f"{name} needs {dependency}"
    assert peers.PEER_NAMES  # the module imports with the group installed
