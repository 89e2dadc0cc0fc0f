"""CompressionConfig: the compact spec, serialisation, per-layer bits and presets."""

from __future__ import annotations

import json

import pytest

from rqlib.spec.config import CompressionConfig
from rqlib.spec.presets import PRESETS


def test_parse_reads_every_lever():
    config = CompressionConfig.parse(
        "turboquant-prod:k4:v3:k0-1=5:v29=fp:sink2:win32:exact=0,-1:ctr:ko32:vo16:obits=2"
        ":rot=hadamard:qjl=orthogonal:m=128:law=gaussian:draw=7:ctok=512"
    )
    assert config.method == "turboquant-prod" and config.value_method == "turboquant-mse"
    assert (config.key_bits, config.value_bits) == (4, 3)
    assert config.key_bits_of(0) == config.key_bits_of(1) == 5 and config.key_bits_of(2) == 4
    assert config.value_bits_of(29) is None and config.value_bits_of(28) == 3
    assert (config.n_sink, config.recent_window, config.exact_layers) == (2, 32, (0, -1))
    assert config.center_keys and config.needs_calibration
    assert (config.key_outliers, config.value_outliers, config.outlier_extra_bits) == (32, 16, 2)
    assert (config.rotation, config.qjl_sketch, config.qjl_dim) == ("hadamard", "orthogonal", 128)
    assert (config.codebook_law, config.draw, config.calibration_tokens) == ("gaussian", 7, 512)
    assert config.exact_layer_set(30) == {0, 29}


@pytest.mark.parametrize(
    "spec",
    [
        "turboquant-mse:k3",
        "rotorquant-mse:b2:nc:win8",
        "turboquant-prod:k3:v4:qjl=orthogonal:m=96:sink1",
        "turboquant-mse:k2:v2:out32:ctr:exact=0,29:k1-3=4",
    ],
)
def test_spec_and_dict_round_trip(spec):
    config = CompressionConfig.parse(spec)
    assert CompressionConfig.parse(config.spec()) == config
    assert CompressionConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.label == spec


def test_short_and_long_tokens_agree():
    assert CompressionConfig.parse("turboquant-mse:k3:v4") == CompressionConfig.parse(
        "turboquant-mse:k=3:v=4"
    )
    assert CompressionConfig.parse("turboquant-mse:b3") == CompressionConfig.parse(
        "turboquant-mse:k3:v3"
    )


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown CompressionConfig fields"):
        CompressionConfig.from_dict({"method": "turboquant-mse", "bogus": 1})


def test_config_is_frozen():
    config = CompressionConfig()
    with pytest.raises(AttributeError):
        config.key_bits = 4  # type: ignore[misc]


def test_presets_resolve_through_the_table(monkeypatch):
    monkeypatch.setitem(PRESETS, "demo", "turboquant-mse:k3:v3:sink1")
    config = CompressionConfig.preset("demo")
    assert config.n_sink == 1 and config.label == "preset:demo"
    overridden = CompressionConfig.parse("preset:demo:win16")
    assert overridden.n_sink == 1 and overridden.recent_window == 16
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        CompressionConfig.preset("nope")
