"""What a config stores for each layer: the one factory of quantizers from a config.

:func:`layer_plan` says, for one layer, which codecs the compressed cache uses (keys, values,
the recent band's keys and values) and :func:`codec_plan` which quantizers make up each codec
(one over all channels, or one over calibrated outlier channels at extra bits and one over the
rest; with ``kxf``/``vxf``, :func:`transform_plan`: one per bit width of the groups of
calibrated components). The cache builder (:func:`rqlib.hf.integration.build_cache`) turns
these plans into codecs; the bit accounting (:mod:`rqlib.spec.bits`) sums their
``bits_per_vector``. Both therefore count and build the same quantizers, with the same draws.

Draws: layer ``l`` of a config with ``draw=s`` draws its rotations and sketches from
``s * 1_000_000 + 10 * l`` plus an offset per codec (:data:`DRAW_OFFSETS`); part ``j`` of a
transform codec adds ``j * PART_DRAW_STEP``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rqlib.core.quantizers import Quantizer, make_quantizer

__all__ = [
    "DRAW_OFFSETS",
    "TRANSFORM_GROUP",
    "CodecPlan",
    "LayerPlan",
    "PartPlan",
    "QuantizerOptions",
    "codec_plan",
    "layer_plan",
    "layer_draw",
]

#: Offsets added to a layer's draw for each codec (and for the outlier part of a codec).
DRAW_OFFSETS = {"key": 0, "value": 1, "outliers": 2, "key_band": 3, "value_band": 4}
#: Components per group of one bit width in a calibrated transform codec (``kxf``, ``vxf``).
TRANSFORM_GROUP = 16
#: Draw step between the parts of a transform codec (above any layer's ``10 * layer + offset``).
PART_DRAW_STEP = 100_000


@dataclass(frozen=True)
class QuantizerOptions:
    """The quantizer settings a config fixes for every codec (all but method, size and draw)."""

    rotation: str | None
    qjl_sketch: str | None
    qjl_dim: int | None
    codebook_law: str
    norm_mantissa_bits: int | None
    trellis_state_bits: int | None = None
    trellis_tail_biting: bool = False

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
            config.trellis_tail_biting and trellis,
        )


@dataclass(frozen=True)
class PartPlan:
    """One quantizer of a codec: ``dim`` channels at ``bits`` bits, drawn from ``draw``."""

    dim: int
    bits: int
    draw: int


@functools.cache
def _quantizer(method: str, dim: int, bits: int, draw: int, options: QuantizerOptions):
    return make_quantizer(
        method,
        dim,
        bits,
        draw=draw,
        rotation=options.rotation,
        qjl_sketch=options.qjl_sketch,
        qjl_dim=options.qjl_dim,
        codebook_law=options.codebook_law,
        norm_mantissa_bits=options.norm_mantissa_bits,
        trellis_state_bits=options.trellis_state_bits,
        trellis_tail_biting=options.trellis_tail_biting,
    )


@dataclass(frozen=True)
class CodecPlan:
    """The quantizers of one codec: ``parts[0]`` covers the outlier channels when
    ``outliers > 0`` (then ``parts[1]`` covers the rest), else ``parts[0]`` covers all.

    A transform codec (``groups``: the bit width of each group of :data:`TRANSFORM_GROUP`
    transformed components) has one part per distinct non-zero width, widest first, over the
    components of the groups of that width; groups of 0 bits are not stored."""

    method: str
    bits: int
    outliers: int
    parts: tuple[PartPlan, ...]
    options: QuantizerOptions
    groups: tuple[int, ...] | None = None

    def part_channels(self) -> list[list[int]]:
        """The transformed components each part covers (transform codecs only)."""
        if self.groups is None:
            raise ValueError("only a transform codec has groups of components")
        return [
            [
                g * TRANSFORM_GROUP + i
                for g, b in enumerate(self.groups)
                if b == width
                for i in range(TRANSFORM_GROUP)
            ]
            for width in _widths(self.groups)
        ]

    def quantizers(self) -> tuple[Quantizer, ...]:
        """The quantizers, built from their draws (memoized: equal plans share them)."""
        return tuple(
            _quantizer(self.method, p.dim, p.bits, p.draw, self.options) for p in self.parts
        )

    @property
    def bits_per_vector(self) -> int:
        """Stored bits per (token, KV head): codes, norms, QJL signs and residual norms (the
        count does not depend on the draws)."""
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


def layer_draw(config, layer: int) -> int:
    """The base draw of ``layer``'s codecs."""
    return config.draw * 1_000_000 + layer * 10


def _widths(groups: tuple[int, ...]) -> list[int]:
    return sorted({b for b in groups if b > 0}, reverse=True)


def transform_plan(
    config, method: str, bits: int, head_dim: int, draw: int, groups: tuple[int, ...]
) -> CodecPlan:
    """The parts of a transform codec whose groups have widths ``groups``."""
    if head_dim != TRANSFORM_GROUP * len(groups):
        raise ValueError(
            f"{config.label}: {len(groups)} groups of {TRANSFORM_GROUP} components do not cover "
            f"head_dim {head_dim}"
        )
    options = QuantizerOptions.of(config, method)
    parts = tuple(
        PartPlan(TRANSFORM_GROUP * groups.count(width), width, draw + index * PART_DRAW_STEP)
        for index, width in enumerate(_widths(groups))
    )
    return CodecPlan(method, bits, 0, parts, options, groups)


def _groups_of(config, layer: int, which: str) -> tuple[int, ...]:
    table = dict(config.key_group_bits if which == "k" else config.value_group_bits)
    if layer not in table:
        token = "kxf" if which == "k" else "vxf"
        raise ValueError(
            f"{config.label}: {token} has no group widths for layer {layer}; resolve the config "
            "against its model first (rqlib.study.allocation.resolve, or rqlib.compress)"
        )
    return table[layer]


def codec_plan(
    config,
    method: str,
    bits: int,
    head_dim: int,
    draw: int = 0,
    outliers: int = 0,
    trellis: bool = True,
) -> CodecPlan:
    """The quantizers ``config`` uses for one codec of ``method`` at ``bits`` bits
    (``trellis=False``: the Lloyd-Max code even under ``tcq``, for the recent band)."""
    options = QuantizerOptions.of(config, method, trellis)
    if outliers == 0:
        return CodecPlan(method, bits, 0, (PartPlan(head_dim, bits, draw),), options)
    if not 0 < outliers < head_dim:
        raise ValueError(f"outlier channel count {outliers} must be in 1..{head_dim - 1}")
    parts = (
        PartPlan(outliers, bits + config.outlier_extra_bits, draw + DRAW_OFFSETS["outliers"]),
        PartPlan(head_dim - outliers, bits, draw),
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
    draw = layer_draw(config, layer)
    key_bits, key_draw = config.key_bits_of(layer), draw + DRAW_OFFSETS["key"]
    if config.transform_keys:
        groups = _groups_of(config, layer, "k")
        key = transform_plan(config, config.method, key_bits, head_dim, key_draw, groups)
    else:
        key = codec_plan(config, config.method, key_bits, head_dim, key_draw, config.key_outliers)
    value_bits = config.value_bits_of(layer)
    value = None
    if value_bits is not None and config.transform_values:
        groups = _groups_of(config, layer, "v")
        value_draw = draw + DRAW_OFFSETS["value"]
        value = transform_plan(
            config, config.value_method, value_bits, head_dim, value_draw, groups
        )
    elif value_bits is not None:
        value = codec_plan(
            config,
            config.value_method,
            value_bits,
            head_dim,
            draw + DRAW_OFFSETS["value"],
            config.value_outliers,
        )
    key_band = value_band = None
    if config.band_bits is not None:  # the recent band as codes of the values' MSE family
        key_band = codec_plan(
            config,
            config.value_method,
            config.band_bits,
            head_dim,
            draw + DRAW_OFFSETS["key_band"],
            trellis=False,
        )
        if value is not None:
            value_band = codec_plan(
                config,
                config.value_method,
                config.band_bits,
                head_dim,
                draw + DRAW_OFFSETS["value_band"],
                trellis=False,
            )
    return LayerPlan(False, key, value, key_band, value_band)
