"""The transformers integration on tiny random Llama / Gemma3 / Qwen2 models (no download).

The oracle for "everything kept exact" is the model's own sdpa attention; for the compressed
path it is a per-query loop written here from the definition (compressed keys except the sink
and the band of recent keys, dequantized values except the same exact tokens).

Models and inputs are drawn from ``rng``. Exact configs are compared to float rounding (no
chance failure). The bounds on one draw's largest error of a lossy cache are marked randomized:
``make test-seeds`` shows the worst of many random seeds against each bound.
"""

from __future__ import annotations

import pytest
import torch
from greedy import assert_same_greedy_generation
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rqlib.core.quantizers import make_quantizer
from rqlib.hf import build_cache, compress
from rqlib.hf.attention import ACTIVE
from rqlib.hf.cache import CompressedLayer
from rqlib.hf.codec import ChannelPart, VectorCodec, key_channel_scale, value_channel_scale
from rqlib.spec.config import CompressionConfig

VOCAB = 256
# fp32 attention summed in a different order than sdpa: differences of a few ulps per score,
# amplified through a few layers; 1e-4 on logits of magnitude ~1 leaves room for those.
LOGIT_TOL = 1e-4


def tiny_model(kind: str, seed: int, dtype=torch.float32):
    """A small random model of the given architecture, in eval mode, sdpa attention."""
    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
        )
        model = LlamaForCausalLM(config)
    elif kind == "gemma3":
        # sliding window 6 on layers 0..2 (pattern: every 4th layer global) so that 24-token
        # inputs cross the window
        config = Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=6,
            sliding_window_pattern=4,
            max_position_embeddings=256,
            query_pre_attn_scalar=32,
        )
        model = Gemma3ForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=112,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=7,
            num_key_value_heads=1,
            max_position_embeddings=256,
        )
        model = Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "sdpa"
    return model.to(dtype).eval()


def random_ids(rng: torch.Generator, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=rng)


def seed_of(rng: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


KINDS = ["llama", "gemma3", "qwen2"]


def exact_specs(n_layers: int, length: int) -> dict[str, str]:
    """Three configs that keep everything exact, each through a different code path."""
    return {
        "exact-layers": "turboquant-mse:k2:v2:exact=" + ",".join(str(i) for i in range(n_layers)),
        "window": f"turboquant-mse:k2:v2:win{length}",
        "sink": f"turboquant-prod:k2:v2:sink{length}",
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["exact-layers", "window", "sink"])
def test_exact_configs_reproduce_sdpa_logits(kind, mode, rng):
    model = tiny_model(kind, seed_of(rng))
    ids = random_ids(rng, 1, 24)
    spec = exact_specs(model.config.num_hidden_layers, 64)[mode]
    with torch.no_grad():
        reference = model(ids).logits
        with compress(model, spec) as cache:
            logits = model(ids, cache=cache).logits
    assert (logits - reference).abs().max().item() <= LOGIT_TOL


#: 20 greedy tokens, with the logits of each step
GREEDY = dict(
    max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
    output_logits=True, return_dict_in_generate=True,
)  # fmt: skip


def assert_same_greedy(generated, reference, prompt: int) -> None:
    """The same tokens as the reference up to a near tie, and logits within LOGIT_TOL up to
    the step where they part (``tests/greedy.py``)."""
    assert_same_greedy_generation(
        generated.sequences[:, prompt:], reference.sequences[:, prompt:],
        *(torch.stack(out.logits, 1) for out in (generated, reference)), tol=LOGIT_TOL,
    )  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_exact_config_reproduces_greedy_generation(kind, rng):
    model = tiny_model(kind, seed_of(rng))
    prompt = random_ids(rng, 1, 7)
    with torch.no_grad():
        reference = model.generate(prompt, **GREEDY)
        with compress(model, "turboquant-mse:k2:v2:win64") as cache:
            generated = model.generate(prompt, cache=cache, **GREEDY)
    assert generated.sequences.shape == (1, 27)
    assert_same_greedy(generated, reference, prompt.shape[1])


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_batch_matches_sdpa(kind, rng):
    model = tiny_model(kind, seed_of(rng))
    ids = random_ids(rng, 2, 12)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # the first row is left-padded by 5 tokens
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        with compress(model, "turboquant-mse:k3:v3:win64") as cache:
            logits = model(ids, attention_mask=mask, cache=cache).logits
        real = mask.bool()
        assert torch.isfinite(logits).all()
        assert (logits[real] - reference[real]).abs().max().item() <= LOGIT_TOL
        expected = model.generate(ids, attention_mask=mask, **GREEDY)
        with compress(model, "turboquant-mse:k3:v3:win64") as cache:
            generated = model.generate(ids, attention_mask=mask, cache=cache, **GREEDY)
    assert_same_greedy(generated, expected, ids.shape[1])


def _chunked_against_whole(kind: str, spec: str, rng) -> tuple[float, float]:
    """One draw: the largest logit change the cache makes, and the largest difference between
    feeding the tokens as one prefill and as a 13-token chunk then one token at a time."""
    # fp64 makes the keys of both runs equal to ~1e-15
    model = tiny_model(kind, seed_of(rng), dtype=torch.float64)
    ids = random_ids(rng, 1, 20)
    with torch.no_grad():
        with compress(model, spec) as cache:
            whole = model(ids, cache=cache).logits
            cache.reset()
            parts = [model(ids[:, :13], cache=cache).logits]
            for position in range(13, 20):
                parts.append(model(ids[:, position : position + 1], cache=cache).logits)
        effect = (whole - model(ids).logits).abs().max().item()
    return effect, (torch.cat(parts, dim=1) - whole).abs().max().item()


# Independent draws of the chunked-against-whole comparison; the test keeps the closest.
CHUNKED_DRAWS = 3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("band", ["", ":wb=5"])
@pytest.mark.randomized
def test_chunked_prefill_and_decode_agree_with_one_prefill(kind, band, rng, record_statistic):
    """The band is relative to each query, so feeding the tokens in chunks (as decoding does)
    must give the same logits as one prefill, whether the band is exact or kept as codes.

    Most draws agree to ~1e-6 of the cache's own effect on the logits. But the quantizer
    rotates 20 keys at once, or 13 and then 1, in fp32: a coordinate within that rounding of a
    decision boundary takes the neighbouring code in one run (about one draw in 40), and with
    5-bit band codes such a flip moved the logits by up to 0.037 of the effect (2,000 single
    draws a case, six cases). That tail is too heavy to bound one draw at 1e-6 (a generalized
    Pareto fit put ~1e-5 beyond 10 %), so the test keeps the best of CHUNKED_DRAWS independent
    draws: a flip explains one draw, a band misplaced relative to the chunk shows in every
    draw. No single draw of the 2,000 a case came within 2.7x of 10 %: with zero exceedances in
    n = 2000 the rate per draw is below ln(1000)/n = 3.5e-3 at 99.9 % confidence, so all three
    beyond 10 % has probability below 4.1e-8 per case (2.5e-7 for the six). A band placed
    relative to the chunk's last query instead of each query fails every draw: the best of
    three was 0.18-0.96 of the effect over 20 seeds a case. The audit of the test as written is
    in tests/audit/randomized-200.txt."""
    spec = "turboquant-mse:k2:v3:sink1:win4" + band
    draws = [_chunked_against_whole(kind, spec, rng) for _ in range(CHUNKED_DRAWS)]
    effect = min(effect for effect, _ in draws)
    record_statistic("effect (max |logit change|)", effect, 1e-3, at_least=True)  # it is on
    closest = min(difference / effect for effect, difference in draws)
    record_statistic(f"best of {CHUNKED_DRAWS}: max |chunked - whole| / effect", closest, 0.1)


def _reference_attention(
    q, keys, values, key_hat, value_hat, n_sink, window, scale, band_keys=None, band_values=None
):
    """Per-query loop from the definition; q [B,Hq,L,d] are the last L of S positions.

    Sink tokens read ``keys``/``values``; the band reads ``band_keys``/``band_values`` (default:
    the exact ones too); every other token reads ``key_hat``/``value_hat``."""
    band_keys = keys if band_keys is None else band_keys
    band_values = values if band_values is None else band_values
    batch, q_heads, length, _ = q.shape
    kv_heads, n_keys = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    out = torch.zeros(batch, q_heads, length, keys.shape[-1], dtype=torch.float64)
    for row in range(length):
        i = n_keys - length + row
        for h in range(q_heads):
            g = h // group
            # what key / value j is read as: exact (sink), band, or compressed
            source = [
                "sink" if j < n_sink else "band" if i - window < j <= i else "c"
                for j in range(i + 1)
            ]
            pick = {
                "sink": (keys, values),
                "band": (band_keys, band_values),
                "c": (key_hat, value_hat),
            }
            k = torch.stack([pick[s][0][:, g, j] for j, s in enumerate(source)], 1)
            v = torch.stack([pick[s][1][:, g, j] for j, s in enumerate(source)], 1)
            scores = torch.einsum("bd,bjd->bj", q[:, h, row].double(), k.double()) * scale
            weights = torch.softmax(scores, -1)
            out[:, h, row] = torch.einsum("bj,bjd->bd", weights, v.double())
    return out


def _codec(dim: int, bits: int, seed: int, trellis: tuple[int, bool] | None = None) -> VectorCodec:
    """One quantizer's codec; ``trellis``: (state bits, tail-biting), or Lloyd-Max."""
    state_bits, tail_biting = trellis or (None, False)
    quantizer = make_quantizer(
        "turboquant-mse",
        dim,
        bits,
        draw=seed,
        trellis_state_bits=state_bits,
        trellis_tail_biting=tail_biting,
    )
    return VectorCodec([ChannelPart(quantizer, None)], dim)


@pytest.mark.parametrize("band_bits", [None, 4])
@pytest.mark.parametrize(
    "trellis", [None, (9, False), (9, True)], ids=["lloyd-max", "trellis", "tail-biting"]
)
def test_layer_attention_matches_the_definition(band_bits, trellis, rng):
    """Prefill and decode steps of one layer attend as the definition does with the codecs'
    own reconstructions, for Lloyd-Max and trellis codes (``tcq``, read from 0 or tail-biting:
    ``tb``; the band stays Lloyd-Max)."""
    seed = seed_of(rng)
    batch, q_heads, kv_heads, dim = 2, 4, 2, 16
    key_codec = _codec(dim, 2, seed, trellis)
    value_codec = _codec(dim, 3, seed + 1, trellis)
    band_codecs = (None, None)
    if band_bits is not None:
        band_codecs = (_codec(dim, band_bits, seed + 2), _codec(dim, band_bits, seed + 3))
    layer = CompressedLayer(0, key_codec, value_codec, 2, 3, band_codecs)
    layer.active = True
    keys = torch.randn(batch, kv_heads, 11, dim, generator=rng)
    values = torch.randn(batch, kv_heads, 11, dim, generator=rng)
    scale = dim**-0.5
    # prefill 8 tokens, then decode 3 single tokens
    for first, last in [(0, 8), (8, 9), (9, 10), (10, 11)]:
        q = torch.randn(batch, q_heads, last - first, dim, generator=rng)
        k_new = keys[:, :, first:last]
        returned, _ = layer.update(k_new, values[:, :, first:last])
        positions = torch.arange(first, last)[:, None]
        mask = (torch.arange(last)[None, :] <= positions)[None, None].expand(batch, 1, -1, -1)
        output = layer.attend(q, returned, mask, scale).transpose(1, 2)
        key_hat = key_codec.decode(key_codec.encode(keys[:, :, :last]))
        value_hat = value_codec.decode(value_codec.encode(values[:, :, :last]))
        band = [None, None]
        for index, (codec, x) in enumerate(zip(band_codecs, (keys, values))):
            if codec is not None:  # each vector is coded on its own: code all, read the band
                band[index] = codec.decode(codec.encode(x[:, :, :last]))
        expected = _reference_attention(
            q, keys[:, :, :last], values[:, :, :last], key_hat, value_hat, 2, 3, scale, *band
        )
        # fp32 against a float64 loop; norms rounded to fp16 identically on both sides
        assert torch.allclose(output.double(), expected, atol=1e-5, rtol=1e-4)
        if band_bits is not None:  # and the 4-bit band is really read: not the exact one
            exact_band = _reference_attention(
                q, keys[:, :, :last], values[:, :, :last], key_hat, value_hat, 2, 3, scale
            )
            assert (output.double() - exact_band).abs().max().item() > 1e-3
    if band_bits is not None:  # what is kept: the codes of the last 3 tokens, nothing exact
        for name in ("band_keys", "band_values"):
            assert not layer.streams[name].is_exact
            assert layer.stored_tokens()[name] == 3


def _centering_errors(rng) -> tuple[float, float]:
    """One draw: the largest score error and the largest decode error of an 8-bit codec with a
    key mean and 8 outlier channels coded apart."""
    dim, kv_heads = 32, 2
    mean = torch.randn(kv_heads, dim, generator=rng) * 3
    outliers = torch.stack(
        [torch.randperm(dim, generator=rng)[:8].sort().values for _ in range(kv_heads)]
    )
    rest = torch.stack(
        [torch.tensor([c for c in range(dim) if c not in set(o.tolist())]) for o in outliers]
    )
    codec = VectorCodec(
        [
            ChannelPart(make_quantizer("turboquant-mse", 8, 8, draw=seed_of(rng)), outliers),
            ChannelPart(make_quantizer("turboquant-mse", dim - 8, 8, draw=seed_of(rng)), rest),
        ],
        dim,
        mean=mean,
        norm_correction=True,
    )
    keys = torch.randn(1, kv_heads, 10, dim, generator=rng) + mean[None, :, None, :]
    q = torch.randn(1, 4, 3, dim, generator=rng)
    compressed = codec.encode(keys)
    exact = torch.einsum("bhld,bhsd->bhls", q, keys.repeat_interleave(2, 1))
    score_error = (codec.scores(q, compressed) - exact).abs().max().item()
    return score_error, (codec.decode(compressed) - keys).abs().max().item()


# Independent draws of the centering check; the test keeps the smallest error of each kind.
CENTERING_DRAWS = 3


@pytest.mark.randomized
def test_centering_and_outliers_are_exact_in_the_score(rng, record_statistic):
    """<q, k> = <q, k - mu> + <q, mu>: with a mean, scores estimate <q, k> for uncentered keys,
    and outlier channels coded apart are put back in place; with 8-bit codes both the scores
    and the decoded keys are close to the exact ones.

    One draw's largest error (over 120 scores, or 640 coordinates) is heavy tailed: a
    coordinate in an outer code cell. Over 5,000 single draws the score error had median 0.090
    and went beyond 0.5 once (0.63); the decode error had median 0.019, worst 0.089 against
    0.2. A defect of the mean or the outlier channels shows in every draw, a large error of a
    correct codec in one, so the test keeps the best of CENTERING_DRAWS draws. With at most one
    exceedance in n = 5000 the rate per draw is below 9.2/n = 1.8e-3 (Poisson, 99.9 %
    confidence), and all three draws beyond a bound has probability below 6e-9. Scores that
    leave out <q, mu> put the best of three at 13-31 (30 seeds)."""
    draws = [_centering_errors(rng) for _ in range(CENTERING_DRAWS)]
    best = f"best of {CENTERING_DRAWS}"
    record_statistic(f"{best}: max |score error|", min(score for score, _ in draws), 0.5)
    record_statistic(f"{best}: max |decoded - key|", min(decode for _, decode in draws), 0.2)


@pytest.mark.randomized
def test_channel_scaling_is_divided_out_in_scores_and_decode(rng, record_statistic):
    # <q, k> = <q / a, a * (k - mu)> + <q, mu>: the score path must equal q . decode(k) for any
    # bit width (same codes, two algebraically equal routes), and at 8 bits both must be close
    # to the exact keys.
    dim, kv_heads = 32, 2
    mean = torch.randn(kv_heads, dim, generator=rng)
    scale = torch.exp(0.5 * torch.randn(kv_heads, dim, generator=rng))
    keys = torch.randn(1, kv_heads, 12, dim, generator=rng) * 2 + mean[None, :, None, :]
    q = torch.randn(1, 4, 3, dim, generator=rng)
    exact = torch.einsum("bhld,bhsd->bhls", q, keys.repeat_interleave(2, 1))
    for bits, check_exact in ((2, False), (8, True)):
        codec = VectorCodec(
            [ChannelPart(make_quantizer("turboquant-mse", dim, bits, draw=seed_of(rng)), None)],
            dim,
            mean=mean,
            scale=scale,
        )
        compressed = codec.encode(keys)
        decoded = codec.decode(compressed)
        via_decode = torch.einsum("bhld,bhsd->bhls", q, decoded.repeat_interleave(2, 1))
        # fp32, two summation orders over 32 channels of magnitude <~ 50: 1e-3 absolute
        assert torch.allclose(codec.scores(q, compressed), via_decode, atol=1e-3, rtol=1e-4)
        if check_exact:
            # 8 bits: D ~ 4e-5, so the score error is ~1e-2 of |q| |a k| / sqrt(d), amplified
            # through 1/a; its largest over 72 scores, relative to the largest score, is heavy
            # tailed (a coordinate in an outer code cell): median 0.0096, worst 0.060 over 10,000
            # draws (tests/audit/randomized-10000-channel-scaling.txt; a bound of 5 % fails
            # about one draw in 5,000). A generalized Pareto law fitted to the worst tenth
            # puts one draw beyond 0.25 at 7e-8 (1.1e-6 with its shape two standard errors
            # heavier). A decode that keeps the scale fails the allclose above in every draw
            relative = (via_decode - exact).abs().max() / exact.abs().max()
            record_statistic("8-bit max |score error| / max |score|", relative, 0.25)
    with pytest.raises(ValueError, match="positive"):
        VectorCodec(codec.parts, dim, scale=-scale)


def test_norm_corrected_norms_keep_the_short_norm_format(rng):
    # norm correction rewrites every stored norm; with nm=4 the rewritten norms must still be
    # e5m4 values (the low 6 of fp16's 10 mantissa bits zero), or the bit count would lie
    dim = 32
    quantizer = make_quantizer("turboquant-mse", dim, 3, draw=seed_of(rng), norm_mantissa_bits=4)
    codec = VectorCodec([ChannelPart(quantizer, None)], dim, norm_correction=True)
    compressed = codec.encode(torch.randn(1, 2, 50, dim, generator=rng) * 5)
    norms = compressed.parts[0].norms
    assert norms.dtype == torch.float16
    assert (norms.view(torch.int16) & 0b111111 == 0).all()


def test_balanced_channel_scale_minimises_the_weighted_error(rng):
    # With errors isotropic in the scaled space, the weighted error is proportional to
    # f(a) = sum(w / a^2) * sum(a^2 e); the scale must reach Cauchy-Schwarz's minimum
    # (sum sqrt(w e))^2 and beat random perturbations of itself.
    kv_heads, dim = 3, 16
    w = torch.exp(2 * torch.randn(kv_heads, dim, generator=rng))
    e = torch.exp(2 * torch.randn(kv_heads, dim, generator=rng))
    a = key_channel_scale(w, e).double()

    def f(a):
        return (w.double() / a**2).sum(-1) * (a**2 * e.double()).sum(-1)

    bound = (w.double() * e.double()).sqrt().sum(-1) ** 2
    assert torch.allclose(f(a), bound, rtol=1e-5)
    assert torch.allclose(a.log().mean(-1), torch.zeros(kv_heads, dtype=torch.float64), atol=1e-5)
    for _ in range(20):
        perturbed = a * torch.exp(0.3 * torch.randn(kv_heads, dim, generator=rng)).double()
        assert (f(perturbed) >= f(a) * (1 - 1e-6)).all()
    # value scale: o_proj [hidden, H * d] with H = 2 heads per KV head; columns summed per group
    weight = torch.randn(24, kv_heads * 2 * dim, generator=rng)
    columns = weight.pow(2).sum(0).reshape(kv_heads, 2, dim).sum(1)
    assert torch.allclose(value_channel_scale(weight, e), key_channel_scale(columns, e), rtol=1e-5)
    with pytest.raises(ValueError, match="multiple"):
        value_channel_scale(torch.randn(8, 50, generator=rng), e)
    with pytest.raises(ValueError, match="same shape"):
        key_channel_scale(w[:, :8], e)


def head_dim_64_model(rng: torch.Generator) -> LlamaForCausalLM:
    """A random Llama with 2 layers, 1 KV head and head_dim 64 (SmolLM2's), in eval mode."""
    torch.manual_seed(seed_of(rng))
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    return LlamaForCausalLM(config).eval()


def test_bytes_per_token_of_3_bit_keys_and_values_at_head_dim_64(rng):
    model = head_dim_64_model(rng)
    with torch.no_grad(), compress(model, "turboquant-mse:k3:v3") as cache:
        model(random_ids(rng, 1, 40), cache=cache)
        per_token = cache.bytes_per_token()
    # per layer, KV head and token: keys 64*3/8 = 24 bytes of codes + 2 bytes of fp16 norm,
    # values the same: 52 bytes; 2 layers x 1 KV head -> 104 bytes
    assert per_token == 104
    fp16 = 2 * 1 * 2 * 64 * 2  # layers x KV heads x (K, V) x d x 2 bytes = 512
    assert per_token < fp16 / 4
    from rqlib.spec.bits import bytes_per_token

    spec = CompressionConfig.parse("turboquant-mse:k3:v3")
    assert bytes_per_token(spec, model.config) == per_token


@pytest.mark.randomized
def test_an_8_bit_band_is_stored_as_codes_and_read(rng, record_statistic):
    model = head_dim_64_model(rng)
    ids = random_ids(rng, 1, 40)
    with torch.no_grad():
        with compress(model, "turboquant-mse:k3:v3:win8") as cache:
            exact_band = model(ids, cache=cache).logits
        with compress(model, "turboquant-mse:k3:v3:win8:wb=8") as cache:
            coded_band = model(ids, cache=cache).logits
            stored = cache.nbytes()
        with compress(model, "turboquant-mse:k3:v3:win8:wb=2") as cache:
            coarse_band = model(ids, cache=cache).logits
    # per layer, K and V: 40 tokens of 3-bit codes (24 bytes + 2 of fp16 norm) and 8 band
    # tokens of 8-bit codes (64 bytes + 2 of norm); 2 layers x 1 KV head
    assert stored == 2 * 2 * (40 * 26 + 8 * 66)
    # an 8-bit band moves the logits far less than a 2-bit one (relative error per vector
    # ~0.6 % against ~34 %); both move them (the band codes are really read). The ratio of the
    # largest moves is one draw's: median 0.033, worst 0.10 over 5,000 draws
    # (tests/audit/randomized-5000-8-bit-band.txt; a bound of 0.1 would be too tight). A
    # generalized Pareto law fitted to the worst tenth puts one draw beyond 0.3 at 7e-13 (7e-8
    # with its shape two standard errors heavier); a band stored at 2 bits instead of 8 gives 1
    coded_move = (coded_band - exact_band).abs().max()
    assert coded_move > 0
    record_statistic(
        "8-bit / 2-bit band's logit move", coded_move / (coarse_band - exact_band).abs().max(), 0.3
    )


def test_model_is_restored_after_an_exception(rng):
    model = tiny_model("llama", seed_of(rng))
    ids = random_ids(rng, 1, 10)
    with torch.no_grad():
        before = model(ids).logits
        with pytest.raises(KeyError, match="boom"):
            with compress(model, "turboquant-mse:k2") as cache:
                model(ids, cache=cache)
                raise KeyError("boom")
        assert model.config._attn_implementation == "sdpa"
        assert all(
            module.config._attn_implementation == "sdpa"
            for module in model.modules()
            if hasattr(module, "config")
        )
        assert not any(module in ACTIVE for module in model.modules())
        assert torch.equal(model(ids).logits, before)


def test_mismatched_caches_raise(rng):
    model = tiny_model("llama", seed_of(rng))
    other = tiny_model("llama", seed_of(rng))
    ids = random_ids(rng, 1, 6)
    with torch.no_grad():
        with compress(model, "turboquant-mse:k2") as cache:
            with pytest.raises(RuntimeError, match="did not produce"):
                model(ids, cache=DynamicCache())
            # a model switched to "rqlib" by hand, without compress()
            other.config._attn_implementation = "rqlib"
            try:
                with pytest.raises(RuntimeError, match="outside an rqlib.hf.compress"):
                    other(ids)
            finally:
                other.config._attn_implementation = "sdpa"
        with pytest.raises(RuntimeError, match="outside its"):
            model(ids, cache=cache)
        with compress(other, "turboquant-mse:k2"):
            with pytest.raises(RuntimeError, match="outside its|did not produce"):
                other(ids, cache=cache)


def test_nested_compress_is_refused(rng):
    model = tiny_model("llama", seed_of(rng))
    with compress(model, "turboquant-mse:k2"):
        with pytest.raises(RuntimeError, match="already inside"):
            with compress(model, "turboquant-mse:k3"):
                pass
    assert model.config._attn_implementation == "sdpa"


def test_model_without_attention_interface_is_refused():
    with pytest.raises(TypeError, match="AttentionInterface"):
        with compress(torch.nn.Linear(4, 4), "turboquant-mse:k3"):
            pass


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kivi:k3", "unknown method"),
        ("turboquant-mse:k9", "key_bits"),
        ("turboquant-mse:k0", "key_bits"),
        ("turboquant-prod:k1", "key_bits"),
        ("turboquant-mse:v12", "value_bits"),
        ("turboquant-mse:k3:foo", "unknown token"),
        ("turboquant-mse:rot=spiral", "rotation"),
        ("turboquant-mse:m=64", "qjl_dim applies"),
        ("turboquant-prod:k3:nc", "norm_correction"),
        ("turboquant-mse:k3:calib=wikitext-2", "evaluation corpus"),
        ("turboquant-mse:k3:vo8", "value_outliers needs"),
        ("turboquant-mse:k3:vs", "scale_values needs"),
        ("turboquant-mse:k3:nm=11", "norm_mantissa"),
        ("turboquant-mse:k3:wb=8", "add winN"),
        ("turboquant-mse:k3:win8:wb=9", "band_bits"),
        ("preset:nonexistent", "unknown preset"),
        ("", "non-empty"),
    ],
)
def test_bad_specs_raise(spec, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig.parse(spec)


def test_out_of_range_layers_and_outliers_raise(rng):
    model = tiny_model("llama", seed_of(rng))
    with pytest.raises(ValueError, match="out of range"):
        build_cache(model, CompressionConfig.parse("turboquant-mse:k3:exact=5"))
    with pytest.raises(ValueError, match="per-layer bits"):
        build_cache(model, CompressionConfig.parse("turboquant-mse:k3:k7=4"))
    with pytest.raises(ValueError, match="below head_dim"):
        build_cache(model, CompressionConfig.parse("turboquant-mse:k3:ko16"))


class ByteTokenizer:
    """Bytes as token ids (vocabulary 256 = VOCAB): a calibration tokenizer for tiny models."""

    name_or_path = "bytes"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


LEVERS = [
    "rot=hadamard",
    "rot=none",
    "rot=rotor",
    "nc",
    "k0=4",
    "v1=5",
    "exact=0",
    "sink2",
    "win4",
    "ctr",
    "ks",
    "vs",
    "nm=4",
    "ko4",
    "vo4",
    "draw=3",
    "law=gaussian",
]


@pytest.mark.parametrize("lever", LEVERS)
def test_every_lever_changes_the_output(lever, rng):
    model = tiny_model("llama", seed_of(rng))
    ids = random_ids(rng, 1, 16)
    base = "turboquant-mse:k2:v2:ctok=256"
    with torch.no_grad():
        with compress(model, base, tokenizer=ByteTokenizer()) as cache:
            reference = model(ids, cache=cache).logits
        with compress(model, f"{base}:{lever}", tokenizer=ByteTokenizer()) as cache:
            logits = model(ids, cache=cache).logits
    assert torch.isfinite(logits).all()
    assert (logits - reference).abs().max().item() > 1e-6


@pytest.mark.parametrize("lever", ["qjl=orthogonal", "m=32", "m=8"])
def test_qjl_levers_change_the_output(lever, rng):
    model = tiny_model("qwen2", seed_of(rng))
    ids = random_ids(rng, 1, 16)
    with torch.no_grad():
        with compress(model, "turboquant-prod:k3") as cache:
            reference = model(ids, cache=cache).logits
        with compress(model, f"turboquant-prod:k3:{lever}") as cache:
            logits = model(ids, cache=cache).logits
    assert (logits - reference).abs().max().item() > 1e-6


def test_calibration_picks_means_and_outlier_channels_from_the_calibration_corpus(rng):
    from rqlib.hf.calibration import calibrate

    model = tiny_model("llama", seed_of(rng))
    calibration = calibrate(model, ByteTokenizer(), "pydoc", 300)
    assert calibration.corpus["name"] == "pydoc" and calibration.n_tokens == 300
    config = CompressionConfig.parse("turboquant-mse:k2:v2:ctr:ko4:vo3:ctok=300")
    cache = build_cache(model, config, calibration)
    layer = cache.layers[1]
    assert torch.equal(layer.key_codec.mean, calibration.key_means[1])
    outliers = layer.key_codec.parts[0].channels  # [KV, 4]
    energy = calibration.key_energy[1]
    for head in range(energy.shape[0]):
        chosen = energy[head, outliers[head]]
        others = energy[head][~torch.isin(torch.arange(energy.shape[1]), outliers[head])]
        assert chosen.min() >= others.max()
    assert layer.value_codec.parts[0].channels.shape == (2, 3)
    # query energies: mean q^2 per channel over the heads of each KV group, first token of the
    # chunk left out, as recorded by the capture (300 tokens = one chunk)
    from rqlib.base.corpora import load_corpus, tokenize_corpus
    from rqlib.hf.capture import capture_attention

    ids = tokenize_corpus(load_corpus("pydoc"), ByteTokenizer(), 300)
    with torch.no_grad(), capture_attention(model) as captured:
        model(ids[None])
    q = captured.calls[1][-1].query[0, :, 1:].double()  # [H, S-1, d]
    expected = q.pow(2).reshape(2, -1, q.shape[-1]).mean(1)
    assert torch.allclose(calibration.query_energy[1].double(), expected, rtol=1e-4)
    assert layer.key_codec.parts[0].quantizer.bits == 3  # outliers at +1 bit
    with pytest.raises(ValueError, match="needs a calibration"):
        build_cache(model, config)
