"""The recent band stored once (spec token ``once``): a token gets its main codes when it leaves
the band, coded from the band's copy of it.

- One layer attends as the definition does, where a token outside a query's band reads the main
  codec's reconstruction of the band codec's reconstruction (a 4-bit band, so that coding the
  main codes from the exact token instead moves the output far beyond the tolerance), over a
  prompt, decode steps and a chunk.
- The main streams hold every token but the newest ``W``; a rolled-back step leaves them as they
  were.
- The bit accounting counts the codes of ``context - W`` tokens, the allocation spends the
  bits this frees, and the cache's stored bytes are what the accounting promises.
- An explicit (non-causal) mask and a spec without a band are refused, naming ``once``;
  ``twice`` undoes a preset's ``once``, needs a band too, and cannot be given with ``once``.

Every comparison is exact, or fp32 against a float64 loop at the tolerance of
``tests/test_hf.py``'s definition test (both sides round the norms to fp16 identically).
"""

from __future__ import annotations

import pytest
import torch
from test_hf import _codec, _reference_attention, seed_of
from tiny_models import ByteTokenizer, preset_config, tiny_model

from rqlib.hf import compress
from rqlib.hf.cache import CompressedLayer
from rqlib.kernels.state import CausalMask
from rqlib.spec.bits import average_bits, bytes_per_token
from rqlib.spec.config import CompressionConfig
from rqlib.spec.geometry import model_geometry
from rqlib.study.allocation import allocate
from rqlib.study.tiny import synthetic_sensitivity

WINDOW, SINK = 3, 2
# a prompt shorter than the band (no main codes yet), decode steps, a chunk, decode steps
STEPS = [(0, 2), (2, 3), (3, 4), (4, 5), (5, 9), (9, 10), (10, 14), (14, 15)]


def _layer(rng, band_bits: int | None):
    seed = seed_of(rng)
    dim = 16
    codecs = (_codec(dim, 2, seed), _codec(dim, 3, seed + 1))
    bands = (None, None)
    if band_bits is not None:
        bands = (_codec(dim, band_bits, seed + 2), _codec(dim, band_bits, seed + 3))
    layer = CompressedLayer(0, *codecs, SINK, WINDOW, bands, band_once=True)
    layer.active = True
    return layer, codecs, bands


def _expected(q, keys, values, codecs, bands, scale, from_band: bool = True):
    """The definition: band and sink as stored, every other token through the main codec, coded
    from the band's copy (``from_band``) or from the token itself."""
    hats, band_copies = [], []
    for codec, band, x in zip(codecs, bands, (keys, values)):
        copy = x if band is None else band.decode(band.encode(x))
        band_copies.append(None if band is None else copy)
        hats.append(codec.decode(codec.encode(copy if from_band else x)))
    return _reference_attention(q, keys, values, *hats, SINK, WINDOW, scale, *band_copies)


@pytest.mark.parametrize("band_bits", [None, 4], ids=["exact band", "4-bit band"])
def test_a_layer_attends_as_the_definition_with_main_codes_from_the_band(band_bits, rng):
    layer, codecs, bands = _layer(rng, band_bits)
    batch, q_heads, kv_heads, dim = 2, 4, 2, 16
    total = STEPS[-1][1]
    keys = torch.randn(batch, kv_heads, total, dim, generator=rng)
    values = torch.randn(batch, kv_heads, total, dim, generator=rng)
    scale = dim**-0.5
    for first, last in STEPS:
        q = torch.randn(batch, q_heads, last - first, dim, generator=rng)
        returned, _ = layer.update(keys[:, :, first:last], values[:, :, first:last])
        mask = CausalMask(batch, first, last - first, 0, last)
        output = layer.attend(q, returned, mask, scale).transpose(1, 2).double()
        truth = (q, keys[:, :, :last], values[:, :, :last], codecs, bands, scale)
        assert torch.allclose(output, _expected(*truth), atol=1e-5, rtol=1e-4)
        if band_bits is not None and last - WINDOW > SINK:  # coded from the band, not the token
            assert (output - _expected(*truth, from_band=False)).abs().max().item() > 1e-3
        for name in ("keys", "values"):  # the newest W tokens are in the band only
            coded = max(0, last - WINDOW)
            assert [ring.end for ring in layer.streams[name].rings] == [coded]
            assert layer.stored_tokens()[name] == coded
        assert layer.stored_tokens()["band_keys"] == min(last, WINDOW)


def test_a_rolled_back_step_leaves_the_streams_as_they_were(rng):
    layer, _, _ = _layer(rng, 4)
    keys = torch.randn(1, 2, 12, 16, generator=rng)
    layer.update(keys[:, :, :9], keys[:, :, :9])
    before = {name: [r.end for r in s.rings] for name, s in layer.streams.items()}
    stored = layer.streams["keys"].rings[0].read(0, 9 - WINDOW)
    layer.update(keys[:, :, 9:12], keys[:, :, 9:12])
    layer.rollback()
    assert {name: [r.end for r in s.rings] for name, s in layer.streams.items()} == before
    again = layer.streams["keys"].rings[0].read(0, 9 - WINDOW)
    assert torch.equal(again.codes, stored.codes) and torch.equal(again.norms, stored.norms)
    # and the band still holds what the next step codes: the step runs again as it did
    layer.update(keys[:, :, 9:12], keys[:, :, 9:12])
    assert layer.streams["keys"].rings[0].end == 12 - WINDOW


def test_an_explicit_mask_is_refused(rng):
    layer, _, _ = _layer(rng, None)
    keys = torch.randn(1, 2, 5, 16, generator=rng)
    returned, _ = layer.update(keys, keys)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    with pytest.raises(RuntimeError, match="spec token once"):
        layer.attend(torch.randn(1, 4, 5, 16, generator=rng), returned, mask, 0.25)


@pytest.mark.parametrize("context", [64, 1024, 4096])
def test_the_accounting_counts_the_codes_of_the_older_tokens_only(context, rng):
    model = tiny_model("llama", seed_of(rng))
    twice = CompressionConfig.parse("turboquant-mse:k3:v2:sink1:win32:wb=8:nc:nm=6")
    once = CompressionConfig.parse("turboquant-mse:k3:v2:sink1:win32:wb=8:nc:nm=6:once")
    codes = {  # bits per coordinate of a 3- and a 2-bit code with its 11-bit norm
        "key": 3 + 11 / model_geometry(model).head_dim,
        "value": 2 + 11 / model_geometry(model).head_dim,
    }
    saved = min(32, context) / context
    for kind in ("key", "value"):
        got = average_bits(once, model.config, context)[kind]
        assert got == pytest.approx(
            average_bits(twice, model.config, context)[kind] - saved * codes[kind]
        )


def test_the_allocation_spends_the_bits_the_band_frees(rng):
    model = tiny_model("llama", seed_of(rng))
    table = synthetic_sensitivity(model_geometry(model).layers)
    preset = CompressionConfig.parse("preset:rq-3").replace(calibration_tokens=512)
    resolved = {
        once: allocate(table, preset.replace(band_once=once), model.config, context=512)
        for once in (False, True)
    }
    for config in resolved.values():
        assert average_bits(config, model.config, 512)["mean"] <= 3.0 + 1e-9

    def total(config):
        return sum(bits for _, bits in config.layer_key_bits + config.layer_value_bits)

    # the band's tokens no longer pay for main codes, so the layers get more bits
    assert total(resolved[True]) > total(resolved[False])


def test_the_stored_bytes_are_what_the_accounting_promises(rng):
    model = tiny_model("llama", seed_of(rng)).to(torch.bfloat16)
    config = preset_config("rq-3", model).replace(band_once=True)
    context = 136
    ids = torch.randint(1, 256, (1, context), generator=rng)
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        stored = cache.nbytes()
    geometry = model_geometry(model)
    means = geometry.layers * geometry.kv_heads * geometry.head_dim * 2  # ctr, at 16 bits
    promised = bytes_per_token(config, model.config, context) * context
    assert stored + means == pytest.approx(promised, rel=0, abs=1e-6)


def test_once_needs_a_band():
    with pytest.raises(ValueError, match="once"):
        CompressionConfig.parse("turboquant-mse:k3:v3:once")
    config = CompressionConfig.parse("turboquant-mse:k3:v3:win8:wb=8:once")
    assert config.band_once and CompressionConfig.parse(config.spec()) == config


def test_twice_undoes_a_presets_once_and_needs_a_band(monkeypatch):
    from rqlib.spec import presets

    spec = presets.PRESETS["rq-3"]
    monkeypatch.setitem(
        presets.PRESETS, "rq-3", spec if "once" in spec.split(":") else spec + ":once"
    )
    stored_once = CompressionConfig.parse("preset:rq-3")
    twice = CompressionConfig.parse("preset:rq-3:twice")
    assert stored_once.band_once and not twice.band_once
    assert twice == stored_once.replace(band_once=False, name="preset:rq-3:twice")
    with pytest.raises(ValueError, match="'twice'.*needs winN"):
        CompressionConfig.parse("turboquant-mse:k3:v3:twice")
    with pytest.raises(ValueError, match="'twice'.*already set by 'once'"):
        CompressionConfig.parse("turboquant-mse:k3:v3:win8:once:twice")
