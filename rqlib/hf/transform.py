"""Calibrated transforms (spec tokens ``kxf``, ``vxf``): fitted per layer and KV head on the
calibration corpus, never the evaluation text.

The error of a key that matters is that of the scores, ``e^T M e`` with ``M = E[q q^T]`` the
queries' second moment over the query heads of the group; the error of a value that matters is
what ``o_proj`` makes of it, ``e^T M e`` with ``M = sum_h W_h^T W_h`` over the ``o_proj``
slices of the group. :func:`rqlib.core.ratedistortion.fit_transform` turns the covariance of
the centred vectors and ``M`` into ``T = U^T M^(1/2)``: the components of ``z = T (x - mean)``
are uncorrelated, their variances (the *weighted spectrum*) fall, and the weighted error is the
plain squared error of ``z``.

The codec (:class:`rqlib.hf.codec.VectorCodec`) quantizes ``z`` in groups of
:data:`~rqlib.spec.codecs.TRANSFORM_GROUP` components, one bit width a group: the widths of a
layer are the integer water-filling of :func:`rqlib.core.ratedistortion.allocate_group_bits`
over the group variances summed over its KV heads (every head of a layer has the same groups,
so the codec's parts cover the same components in each). The components of one width are
coded together as one TurboQuant vector (a random rotation, a norm, the Lloyd-Max code);
groups of 0 bits are not stored.

The widths are part of the format, so they live in the config (``kg``/``vg`` tokens):
:func:`rqlib.study.allocation.resolve_transforms` fills them in for a model, and the bit
accounting then counts exactly what the cache stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rqlib.core.ratedistortion import allocate_group_bits, fit_transform
from rqlib.kernels.state import Transform
from rqlib.spec.codecs import TRANSFORM_GROUP

__all__ = ["LayerTransform", "fit_layer", "group_widths", "output_metric"]


@dataclass(frozen=True)
class LayerTransform:
    """One layer's transform of keys or values: the map ``transform`` (``[KV, d, d]`` matrix and
    inverse, float32), the ``mean`` ``[KV, d]`` and the weighted ``spectrum`` ``[KV, d]``
    (float64, falling in each head)."""

    transform: Transform
    mean: torch.Tensor
    spectrum: torch.Tensor


def output_metric(output_weight: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``[KV, d, d]``: ``sum_h W_h^T W_h`` over the ``o_proj`` slices ``W_h`` (``[hidden, d]``)
    of the query heads of each KV head, from the weight ``[hidden, H * d]``."""
    weight = output_weight.detach().double()
    heads = weight.shape[1] // head_dim
    if heads * head_dim != weight.shape[1] or heads % kv_heads:
        raise ValueError(
            f"o_proj has {weight.shape[1]} input columns, not a multiple of KV heads x head_dim "
            f"= {kv_heads} x {head_dim}"
        )
    slices = weight.reshape(weight.shape[0], heads, head_dim).transpose(0, 1)  # [H, hidden, d]
    per_head = slices.transpose(1, 2) @ slices  # [H, d, d]
    return per_head.reshape(kv_heads, heads // kv_heads, head_dim, head_dim).sum(1)


def fit_layer(calibration, layer: int, kind: str, output_weight=None) -> LayerTransform:
    """The transform of ``kind`` (``"keys"`` or ``"values"``) of ``layer``; values need the
    attention's ``o_proj`` weight."""
    if kind == "keys":
        mean = calibration.key_means[layer]
        covariance = calibration.key_covariance[layer].double()
        metric = calibration.query_moment[layer].double()
    elif kind == "values":
        if output_weight is None:
            raise ValueError("the value transform (vxf) needs the attention's o_proj weight")
        mean = calibration.value_means[layer]
        covariance = calibration.value_covariance[layer].double()
        metric = output_metric(output_weight, *covariance.shape[:2]).to(covariance.device)
    else:
        raise ValueError(f"kind must be 'keys' or 'values', got {kind!r}")
    fitted = [fit_transform(c, m) for c, m in zip(covariance, metric)]
    matrix = torch.stack([t for t, _, _ in fitted])
    inverse = torch.stack([i for _, i, _ in fitted])
    spectrum = torch.stack([s for _, _, s in fitted])
    return LayerTransform(Transform(matrix.float(), inverse.float()), mean, spectrum)


def group_widths(spectrum: torch.Tensor, bits: int) -> tuple[int, ...]:
    """The bit width of each group of :data:`TRANSFORM_GROUP` components, averaging exactly
    ``bits``: water-filling on the group variances summed over the KV heads of ``spectrum``
    ``[KV, d]``."""
    kv_heads, head_dim = spectrum.shape
    if head_dim % TRANSFORM_GROUP:
        raise ValueError(
            f"a calibrated transform groups {TRANSFORM_GROUP} components; head_dim {head_dim} is "
            "not a multiple"
        )
    groups = spectrum.reshape(kv_heads, -1, TRANSFORM_GROUP).sum((0, 2))
    return allocate_group_bits(groups, bits)
