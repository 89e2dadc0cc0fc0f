"""The calibrated transform codes in the cache (spec tokens ``kxf``, ``vxf``): the spec, the
group widths, the codec and the cache's attention over it, the bit accounting, the resolution
against a model and the refusal of the GPU kernels.

Every check here is exact or bounded by float32 rounding (stated where it is used): nothing can
fail by chance.
"""

from __future__ import annotations

import pytest
import torch
from test_hf import ByteTokenizer, _reference_attention, random_ids, seed_of
from transformers import LlamaConfig, LlamaForCausalLM

import rqlib
from rqlib import kernels
from rqlib.core.quantizers import make_quantizer
from rqlib.hf import build_cache
from rqlib.hf.cache import CompressedLayer
from rqlib.hf.calibration import calibrate
from rqlib.hf.codec import ChannelPart, VectorCodec
from rqlib.hf.transform import group_widths, output_metric
from rqlib.kernels.state import Transform
from rqlib.spec.bits import average_bits
from rqlib.spec.codecs import TRANSFORM_GROUP, layer_plan
from rqlib.spec.config import CompressionConfig
from rqlib.study.allocation import resolve

KV_HEADS, DIM = 2, 48  # three groups of 16 components


def _transform(rng) -> Transform:
    """A random per-head map ``Q diag(s)`` with ``Q`` orthogonal and ``s`` in [0.5, 2]: its
    condition number is at most 4."""
    matrices = []
    for _ in range(KV_HEADS):
        q, _ = torch.linalg.qr(torch.randn(DIM, DIM, generator=rng, dtype=torch.float64))
        s = 0.5 + 1.5 * torch.rand(DIM, generator=rng, dtype=torch.float64)
        matrices.append(q @ torch.diag(s))
    matrix = torch.stack(matrices)
    return Transform(matrix.float(), torch.linalg.inv(matrix).float())


def _transform_codec(rng, widths=(3, 2)) -> VectorCodec:
    """Groups 0 and 1 at ``widths`` bits, group 2 not stored; a random mean and transform."""
    parts = [
        ChannelPart(
            make_quantizer("turboquant-mse", TRANSFORM_GROUP, bits, draw=seed_of(rng)),
            torch.arange(g * TRANSFORM_GROUP, (g + 1) * TRANSFORM_GROUP).expand(KV_HEADS, -1),
        )
        for g, bits in enumerate(widths)
    ]
    mean = torch.randn(KV_HEADS, DIM, generator=rng)
    return VectorCodec(parts, DIM, mean=mean, transform=_transform(rng))


def test_a_transform_maps_back_and_moves_queries_so_that_scores_are_unchanged(rng):
    """``T^-1 T x = x`` and ``<T^-T q, T x> = <q, x>`` to float32 rounding (relative 1e-5: a
    few ulps times the condition number, at most 4)."""
    transform = _transform(rng)
    x = torch.randn(2, KV_HEADS, 7, DIM, generator=rng)
    q = torch.randn(2, KV_HEADS, 5, DIM, generator=rng)
    assert torch.allclose(transform.back(transform.forward(x)), x, atol=1e-5, rtol=1e-5)
    scores = transform.queries(q) @ transform.forward(x).transpose(-1, -2)
    assert torch.allclose(scores, q @ x.transpose(-1, -2), atol=1e-4, rtol=1e-5)


def test_the_codec_scores_what_it_decodes_and_drops_the_groups_of_no_bits(rng):
    codec = _transform_codec(rng)
    x = torch.randn(1, KV_HEADS, 9, DIM, generator=rng)
    decoded = codec.decode(codec.encode(x))
    q = torch.randn(1, 2 * KV_HEADS, 4, DIM, generator=rng)
    expected = torch.einsum("bhld,bhsd->bhls", q, decoded.repeat_interleave(2, dim=1))
    assert torch.allclose(codec.scores(q, codec.encode(x)), expected, atol=1e-4, rtol=1e-4)
    # the last group stores nothing: the decoded components there are the mean's (zero in z)
    z = codec.transform.forward(decoded - codec.mean[None, :, None, :])
    assert z[..., 2 * TRANSFORM_GROUP :].abs().max() < 1e-4 * z.abs().max()


def test_layer_attention_over_transform_codes_matches_the_definition(rng):
    """Prefill and decode steps of one layer with transform codecs for keys and values attend
    as the definition does with the codecs' own reconstructions (fp32 against a float64 loop;
    the transform's condition number, at most 4, widens the rounding of the Lloyd-Max test's
    1e-5 to 1e-4)."""
    batch, q_heads = 2, 4
    key_codec, value_codec = _transform_codec(rng), _transform_codec(rng, (4, 1))
    layer = CompressedLayer(0, key_codec, value_codec, 2, 3)
    layer.active = True
    keys = torch.randn(batch, KV_HEADS, 11, DIM, generator=rng)
    values = torch.randn(batch, KV_HEADS, 11, DIM, generator=rng)
    scale = DIM**-0.5
    for first, last in [(0, 8), (8, 9), (9, 10), (10, 11)]:
        q = torch.randn(batch, q_heads, last - first, DIM, generator=rng)
        returned, _ = layer.update(keys[:, :, first:last], values[:, :, first:last])
        positions = torch.arange(first, last)[:, None]
        mask = (torch.arange(last)[None, :] <= positions)[None, None].expand(batch, 1, -1, -1)
        output = layer.attend(q, returned, mask, scale).transpose(1, 2)
        key_hat = key_codec.decode(key_codec.encode(keys[:, :, :last]))
        value_hat = value_codec.decode(value_codec.encode(values[:, :, :last]))
        expected = _reference_attention(
            q, keys[:, :, :last], values[:, :, :last], key_hat, value_hat, 2, 3, scale
        )
        assert torch.allclose(output.double(), expected, atol=1e-4, rtol=1e-4)


def test_group_widths_average_the_bits_and_follow_the_spectrum():
    """Water-filling: the widths average exactly the bits, fall with the variances, and a group
    far below the others gets nothing."""
    spectrum = torch.tensor([[100.0] * 16 + [10.0] * 16 + [1.0] * 16 + [1e-6] * 16] * 2)
    widths = group_widths(spectrum, 3)
    assert sum(widths) == 3 * 4 and list(widths) == sorted(widths, reverse=True)
    assert widths[-1] == 0 and widths[0] > widths[1] > widths[2]
    with pytest.raises(ValueError, match="not a multiple"):
        group_widths(torch.ones(1, 40), 3)


def test_the_output_metric_sums_the_o_proj_slices_of_each_group(rng):
    weight = torch.randn(24, 4 * 8, generator=rng, dtype=torch.float64)  # 4 heads of d = 8
    metric = output_metric(weight, kv_heads=2, head_dim=8)
    slices = [weight[:, h * 8 : (h + 1) * 8] for h in range(4)]
    expected = torch.stack([slices[0].T @ slices[0] + slices[1].T @ slices[1],
                            slices[2].T @ slices[2] + slices[3].T @ slices[3]])  # fmt: skip
    assert torch.allclose(metric, expected)


def test_the_tokens_read_write_and_refuse_what_they_cannot_honour():
    config = CompressionConfig.parse("turboquant-mse:k3:v2:ctr:kxf:vxf:kg0-2=5331:vg0-2=4211")
    assert config.transform_keys and config.transform_values
    assert dict(config.key_group_bits)[2] == (5, 3, 3, 1)
    assert CompressionConfig.parse(config.spec()) == config
    assert CompressionConfig.from_dict(config.to_dict()) == config
    for spec, message in [
        ("turboquant-mse:k3:kg0=5331", "add kxf"),
        ("turboquant-mse:k3:kxf:kg0=5321", "average 2.75 bits, not the layer's 3"),
        ("turboquant-mse:k3:kxf:ks", "replaces key channel scaling"),
        ("turboquant-mse:k3:v3:vxf:vo4", "replaces value channel scaling"),
        ("turboquant-mse:k3:vxf", "needs compressed values"),
        ("turboquant-prod:k3:kxf", "-mse methods"),
        ("turboquant-mse:b3:kxf:alloc=3", "give the bits per layer"),
        ("turboquant-mse:k3:kxf:kg0=5331:kg0=4431", "again"),
    ]:
        with pytest.raises(ValueError, match=message):
            CompressionConfig.parse(spec)


def test_an_unresolved_transform_is_refused_with_the_token(rng):
    config = CompressionConfig.parse("turboquant-mse:k3:v3:kxf")
    with pytest.raises(ValueError, match="kxf has no group widths for layer 0.*resolve"):
        layer_plan(config, 0, 4, 64)


def _model(rng) -> LlamaForCausalLM:
    """A tiny random Llama with head_dim 32 (two groups) and two KV heads."""
    torch.manual_seed(seed_of(rng))
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def test_a_resolved_transform_counts_what_the_cache_stores(rng):
    """Resolving chooses widths for every layer; the bit accounting counts each part's codes and
    norm, and the transform's matrix and mean amortized over the context; the cache stores
    exactly the counted codes and norms."""
    model, tokenizer = _model(rng), ByteTokenizer()
    base = "turboquant-mse:k3:v2:ctr:nm=6:ctok=300"
    config = resolve(f"{base}:kxf:vxf", model, tokenizer)
    assert [layer for layer, _ in config.key_group_bits] == [0, 1, 2]
    assert all(sum(widths) == 3 * 2 for _, widths in config.key_group_bits)
    context = 64
    bits = average_bits(config, model.config, context)
    plain = average_bits(CompressionConfig.parse(base), model.config, context)
    d = 32
    for kind, stored in (("key", 3), ("value", 2)):
        plans = [getattr(layer_plan(config, i, 3, d), kind) for i in range(3)]
        codes_and_norms = sum(p.bits_per_vector for p in plans) / (3 * d)
        side = (16 * d * d + 8 * 2) / (d * context) + (16 / context if kind == "value" else 0)
        assert bits[kind] == pytest.approx(plain[kind] - stored - 11 / d + codes_and_norms + side)
    ids = random_ids(rng, 1, context)
    with torch.no_grad(), rqlib.compress(model, config, tokenizer=tokenizer) as cache:
        model(ids, cache=cache)
        stored_bits = 8 * cache.nbytes() / context
    plans = [layer_plan(config, i, 3, d) for i in range(3)]
    counted = sum(p.key.bits_per_vector + p.value.bits_per_vector for p in plans) * 2  # 2 heads
    assert stored_bits == pytest.approx(counted, rel=0.02)  # byte padding of the packed rows


def test_the_transforms_change_the_output(rng):
    model, tokenizer = _model(rng), ByteTokenizer()
    ids = random_ids(rng, 1, 24)
    outputs = {}
    with torch.no_grad():
        for spec in ("ctr", "ctr:kxf", "ctr:vxf"):
            with rqlib.compress(
                model, f"turboquant-mse:b3:{spec}:ctok=300", tokenizer=tokenizer
            ) as c:
                outputs[spec] = model(ids, cache=c).logits
    assert torch.isfinite(outputs["ctr:kxf"]).all() and torch.isfinite(outputs["ctr:vxf"]).all()
    assert (outputs["ctr:kxf"] - outputs["ctr"]).abs().max() > 1e-6
    assert (outputs["ctr:vxf"] - outputs["ctr"]).abs().max() > 1e-6


def test_the_gpu_kernels_refuse_a_transform_naming_its_token(rng):
    codec = _transform_codec(rng)
    with pytest.raises(ValueError, match="spec token kxf"):
        kernels.check_layer(codec, None)
    with pytest.raises(ValueError, match="spec token vxf"):
        kernels.check_layer(None, codec)
    model, tokenizer = _model(rng), ByteTokenizer()
    config = resolve("turboquant-mse:k3:v3:kxf:ctok=300", model, tokenizer)
    calibration = calibrate(model, tokenizer, "pydoc", 300)
    layer = build_cache(model, config, calibration).layers[0]
    with pytest.raises(ValueError, match="spec token kxf"):
        kernels.check_layer(layer.key_codec, layer.value_codec)


def test_the_calibration_chunk_sets_the_positions_the_statistics_see(rng):
    """``clen`` reads and writes; chunks of another length give other key statistics after
    RoPE (other positions), memoized apart; a chunk below 2 tokens is refused."""
    config = CompressionConfig.parse("turboquant-mse:k3:ctr:ctok=300:clen=150")
    assert config.calibration_chunk == 150 and config.spec().endswith(":ctok=300:clen=150")
    assert CompressionConfig.parse(config.spec()) == config
    with pytest.raises(ValueError, match="token 'clen=1'"):
        CompressionConfig.parse("turboquant-mse:k3:clen=1")
    model, tokenizer = _model(rng), ByteTokenizer()
    short = calibrate(model, tokenizer, "pydoc", 300, chunk=150)
    whole = calibrate(model, tokenizer, "pydoc", 300, chunk=300)
    assert short is calibrate(model, tokenizer, "pydoc", 300, chunk=150)
    assert not torch.allclose(short.key_covariance[1], whole.key_covariance[1])
    with pytest.raises(ValueError, match="chunk must be an int >= 2"):
        calibrate(model, tokenizer, "pydoc", 300, chunk=1)
