"""What a config stores for each layer: the one factory of quantizers from a config.

:func:`layer_plan` says, for one layer, which codecs the compressed cache uses (keys, values,
the recent band's keys and values) and :func:`codec_plan` which quantizers make up each codec
(one over all channels, or one over calibrated outlier channels at extra bits and one over the
rest). The cache builder (:func:`rqlib.hf.integration.build_cache`) turns these plans into codecs;
the bit accounting (:mod:`rqlib.spec.bits`) sums their ``bits_per_vector``. Both therefore
count and build the same quantizers, with the same seeds.

Seeds: layer ``l`` of a config with ``seed=s`` draws its rotations and sketches from
``s * 1_000_000 + 10 * l`` plus an offset per codec (:data:`SEED_OFFSETS`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rqlib.core.quantizers import Quantizer, make_quantizer

__all__ = [
    "SEED_OFFSETS",
    "CodecPlan",
    "LayerPlan",
    "PartPlan",
    "QuantizerOptions",
    "codec_plan",
    "layer_plan",
    "layer_seed",
]

#: Offsets added to a layer's seed for each codec (and for the outlier part of a codec).
SEED_OFFSETS = {"key": 0, "value": 1, "outliers": 2, "key_band": 3, "value_band": 4}


@dataclass(frozen=True)
class QuantizerOptions:
    """The quantizer settings a config fixes for every codec (all but method, size and seed)."""

    rotation: str | None
    qjl_sketch: str | None
    qjl_dim: int | None
    codebook_law: str
    norm_mantissa_bits: int | None
    trellis_state_bits: int | None = None

    @classmethod
    def of(cls, config, method: str, trellis: bool = True) -> QuantizerOptions:
        """The options of one codec; ``trellis=False`` keeps the Lloyd-Max code even when the
        config asks for a trellis (the recent band's codecs)."""
        is_prod = method.endswith("-prod")
        return cls(
            config.rotation,
            config.qjl_sketch if is_prod else None,
            config.qjl_dim if is_prod else None,
            config.codebook_law,
            config.norm_mantissa,
            config.trellis_state_bits if trellis else None,
        )


@dataclass(frozen=True)
class PartPlan:
    """One quantizer of a codec: ``dim`` channels at ``bits`` bits, drawn from ``seed``."""

    dim: int
    bits: int
    seed: int


@functools.cache
def _quantizer(method: str, dim: int, bits: int, seed: int, options: QuantizerOptions):
    return make_quantizer(
        method,
        dim,
        bits,
        seed=seed,
        rotation=options.rotation,
        qjl_sketch=options.qjl_sketch,
        qjl_dim=options.qjl_dim,
        codebook_law=options.codebook_law,
        norm_mantissa_bits=options.norm_mantissa_bits,
        trellis_state_bits=options.trellis_state_bits,
    )


@dataclass(frozen=True)
class CodecPlan:
    """The quantizers of one codec: ``parts[0]`` covers the outlier channels when
    ``outliers > 0`` (then ``parts[1]`` covers the rest), else ``parts[0]`` covers all."""

    method: str
    bits: int
    outliers: int
    parts: tuple[PartPlan, ...]
    options: QuantizerOptions

    def quantizers(self) -> tuple[Quantizer, ...]:
        """The quantizers, built from their seeds (memoized: equal plans share them)."""
        return tuple(
            _quantizer(self.method, p.dim, p.bits, p.seed, self.options) for p in self.parts
        )

    @property
    def bits_per_vector(self) -> int:
        """Stored bits per (token, KV head): codes, norms, QJL signs and residual norms (the
        count does not depend on the seeds)."""
        return sum(
            _quantizer(self.method, p.dim, p.bits, 0, self.options).bits_per_vector
            for p in self.parts
        )


@dataclass(frozen=True)
class LayerPlan:
    """The codecs of one layer; ``exact``: keys and values kept exact (no codecs at all).

    ``value`` is ``None`` for full-precision values; the band codecs are ``None`` without
    ``wb=`` (the band is then exact), and ``value_band`` is ``None`` when values are exact.
    """

    exact: bool
    key: CodecPlan | None = None
    value: CodecPlan | None = None
    key_band: CodecPlan | None = None
    value_band: CodecPlan | None = None


def layer_seed(config, layer: int) -> int:
    """The base seed of ``layer``'s codecs."""
    return config.seed * 1_000_000 + layer * 10


def codec_plan(
    config,
    method: str,
    bits: int,
    head_dim: int,
    seed: int = 0,
    outliers: int = 0,
    trellis: bool = True,
) -> CodecPlan:
    """The quantizers ``config`` uses for one codec of ``method`` at ``bits`` bits
    (``trellis=False``: the Lloyd-Max code even under ``tcq``, for the recent band)."""
    options = QuantizerOptions.of(config, method, trellis)
    if outliers == 0:
        return CodecPlan(method, bits, 0, (PartPlan(head_dim, bits, seed),), options)
    if not 0 < outliers < head_dim:
        raise ValueError(f"outlier channel count {outliers} must be in 1..{head_dim - 1}")
    parts = (
        PartPlan(outliers, bits + config.outlier_extra_bits, seed + SEED_OFFSETS["outliers"]),
        PartPlan(head_dim - outliers, bits, seed),
    )
    return CodecPlan(method, bits, outliers, parts, options)


def layer_plan(config, layer: int, n_layers: int, head_dim: int) -> LayerPlan:
    """The codecs of ``layer`` (of ``n_layers``) under a resolved ``config``."""
    if config.budget is not None:
        raise ValueError(
            f"{config.label}: a config with a bit budget (alloc=) must be resolved against its "
            "model first (rqlib.study.allocation.resolve)"
        )
    if layer in config.exact_layer_set(n_layers):
        return LayerPlan(exact=True)
    seed = layer_seed(config, layer)
    key = codec_plan(
        config,
        config.method,
        config.key_bits_of(layer),
        head_dim,
        seed + SEED_OFFSETS["key"],
        config.key_outliers,
    )
    value_bits = config.value_bits_of(layer)
    value = None
    if value_bits is not None:
        value = codec_plan(
            config,
            config.value_method,
            value_bits,
            head_dim,
            seed + SEED_OFFSETS["value"],
            config.value_outliers,
        )
    key_band = value_band = None
    if config.band_bits is not None:  # the recent band as codes of the values' MSE family
        key_band = codec_plan(
            config,
            config.value_method,
            config.band_bits,
            head_dim,
            seed + SEED_OFFSETS["key_band"],
            trellis=False,
        )
        if value is not None:
            value_band = codec_plan(
                config,
                config.value_method,
                config.band_bits,
                head_dim,
                seed + SEED_OFFSETS["value_band"],
                trellis=False,
            )
    return LayerPlan(False, key, value, key_band, value_band)
