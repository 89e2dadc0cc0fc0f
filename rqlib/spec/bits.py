"""Honest bit accounting: what a config stores per key and per value coordinate.

:func:`average_bits` counts, per layer, the codecs :func:`rqlib.spec.codecs.layer_plan` says the
cache builds (codes, norms, QJL signs and residual norms: ``bits_per_vector``), the exact sink
tokens at 16 bits and the recent band (16 bits, or its codec's bits with ``wb=``) amortized
over ``context`` tokens (with ``once`` the band's tokens have no main codes yet, so the codes
count for the ``context - W`` older tokens only), exact layers at 16 bits, and per-layer
calibrated constants (key means and channel scales at 16 bits per coordinate, outlier channel
indices at 8 bits) amortized the same way. A calibrated transform (``kxf``, ``vxf``) stores,
per layer and KV head, its ``d x d`` matrix and its mean at 16 bits and one 8-bit width per
group, amortized the same way. Every layer is counted as storing every token; a sliding-window layer
of the cache of :mod:`rqlib.hf` (Gemma 3's local layers) evicts the tokens its window can no
longer see, so for such models the count is an upper bound on what is stored.
"""

from __future__ import annotations

from rqlib.spec.codecs import TRANSFORM_GROUP, codec_plan, layer_plan
from rqlib.spec.geometry import model_geometry

__all__ = ["EXACT_BITS", "average_bits", "bytes_per_token", "codec_bits", "coded_share"]

EXACT_BITS = 16  # a deployed cache keeps exact tokens in fp16/bf16


def codec_bits(config, method: str, bits: int, head_dim: int, outliers: int = 0) -> float:
    """Bits per coordinate of one vector under ``method`` (with an outlier split if any)."""
    return codec_plan(config, method, bits, head_dim, outliers=outliers).bits_per_vector / head_dim


def _transform_side_bits(head_dim: int, context: int) -> float:
    """A transform's matrix (16 bits a constant) and group widths (8 bits each) per coordinate
    of ``context`` tokens (its mean is counted with the other per-head vectors)."""
    groups = head_dim // TRANSFORM_GROUP
    return (EXACT_BITS * head_dim * head_dim + 8 * groups) / (head_dim * context)


def coded_share(config, context: int) -> float:
    """The share of ``context`` tokens that hold main codes: all of them, or with ``once`` all
    but the recent band's ``W`` tokens (those are in the band only)."""
    if not config.band_once:
        return 1.0
    return 1.0 - min(config.recent_window, context) / context


def _check_context(context) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be an int >= 1, got {context!r}")


def average_bits(config, model_config, context: int = 4096) -> dict:
    """Average stored bits per key coordinate, per value coordinate and their mean.

    ``config`` ``None`` means the uncompressed cache (16 bits). ``model_config`` is the model's
    transformers config (or the model). Returns
    ``{"key": .., "value": .., "mean": .., "context": context}``.
    """
    _check_context(context)
    geometry = model_geometry(model_config)
    if config is None:
        exact = float(EXACT_BITS)
        return {"key": exact, "value": exact, "mean": exact, "context": context}
    head_dim = geometry.head_dim
    sink = min(config.n_sink, context) / context
    recent = min(config.recent_window, context) / context
    coded = coded_share(config, context)
    per_head = EXACT_BITS / context  # one calibrated vector per KV head, amortized
    key_total = value_total = 0.0
    for layer in range(geometry.layers):
        plan = layer_plan(config, layer, geometry.layers, head_dim)
        if plan.exact:
            key_total += EXACT_BITS
            value_total += EXACT_BITS
            continue

        def band(codec) -> float:  # bits per coordinate of a recent-band token
            return EXACT_BITS if codec is None else codec.bits_per_vector / head_dim

        key = coded * plan.key.bits_per_vector / head_dim
        key += EXACT_BITS * sink + band(plan.key_band) * recent
        key += per_head * ((config.center_keys or config.transform_keys) + config.scale_keys)
        if config.transform_keys:
            key += _transform_side_bits(head_dim, context)
        key += 8 * config.key_outliers / (head_dim * context)  # channel indices per head
        if plan.value is None:
            value = float(EXACT_BITS)
        else:
            value = coded * plan.value.bits_per_vector / head_dim
            value += EXACT_BITS * sink + band(plan.value_band) * recent
            value += 8 * config.value_outliers / (head_dim * context)
            value += per_head * (config.scale_values + config.transform_values)
            if config.transform_values:
                value += _transform_side_bits(head_dim, context)
        key_total += key
        value_total += value
    key_bits, value_bits = key_total / geometry.layers, value_total / geometry.layers
    return {
        "key": key_bits,
        "value": value_bits,
        "mean": (key_bits + value_bits) / 2,
        "context": context,
    }


def bytes_per_token(config, model_config, context: int = 4096) -> float:
    """Cache bytes per token (all layers, K and V) implied by :func:`average_bits`."""
    geometry = model_geometry(model_config)
    bits = average_bits(config, model_config, context)
    return (
        (bits["key"] + bits["value"]) * geometry.layers * geometry.kv_heads * geometry.head_dim / 8
    )
