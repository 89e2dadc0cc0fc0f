"""Per-layer codecs: how one layer's keys or values become packed codes and come back.

A :class:`VectorCodec` compresses ``[B, KV, S, d]`` vectors of one layer. It may

- subtract a calibrated per-KV-head mean before quantizing (keys: ``<q, k> = <q, k - mu> +
  <q, mu>``, the second term added back exactly, so centering only changes what is quantized);
- split the channels of each KV head into outlier channels (calibrated, quantized at more bits)
  and the rest, each subset with its own quantizer (its own rotation, norm and codes);
- multiply each channel by a calibrated weight before quantizing and divide it out after
  (channel scaling, :func:`key_channel_scale` / :func:`value_channel_scale`): the rotation makes
  the quantization error isotropic in the scaled space, so the weights decide which channels
  get the error. ``<q, k> = <q / a, a * k>`` is exact, so scaling only moves the error;
- map the centred vectors by a calibrated per-KV-head transform ``T`` before quantizing
  (:mod:`rqlib.hf.transform`, spec tokens ``kxf``/``vxf``), its parts then covering groups of
  transformed components; ``<q, k - mu> = <T^-T q, T (k - mu)>`` is exact, so, as with
  scaling, only the error moves;
- replace each stored norm by the least-squares scale of the reconstruction (norm correction).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rqlib import kernels
from rqlib.core.estimator import centroid_values
from rqlib.core.gqa import expand_kv_heads, group_size
from rqlib.core.packing import pack_codes
from rqlib.core.quantizers import CompressedVectors
from rqlib.kernels import limits, reference
from rqlib.kernels.state import Transform

__all__ = [
    "ChannelPart",
    "estimate_scores",
    "CompressedParts",
    "VectorCodec",
    "key_channel_scale",
    "value_channel_scale",
]


def estimate_scores(q: torch.Tensor, keys) -> torch.Tensor:
    """Estimated ``<q_i, k_j>`` (unscaled, no mask) as float32 ``[B, Hq, Lq, S]``.

    ``q`` is ``[B, Hq, Lq, d]``; ``keys`` a ``CompressedVectors`` of shape ``[B, KV, S]``. On
    CUDA, keys whose geometry the Triton kernels support go through
    :func:`rqlib.kernels.fused_scores`; everything else (CPU, and channel subsets of widths the
    kernels do not cover, such as an outlier split's) through its torch reference, the same
    estimator (:mod:`rqlib.core.estimator`).
    """
    group_size(q.shape[1], keys.shape[1])
    if q.is_cuda:
        try:
            limits.check_compressed(keys, "keys", ndim=3)
        except ValueError:
            pass
        else:
            return kernels.fused_scores(q.contiguous(), keys, scale=1.0, backend="triton")
    return reference.fused_scores(q, keys, scale=1.0)


def _balanced_scale(weight_energy: torch.Tensor, energy: torch.Tensor) -> torch.Tensor:
    """``a = (w / e) ** (1/4)`` per channel, normalised to a geometric mean of 1 per head.

    With the error of a rotated quantizer isotropic in the scaled space, the error that matters,
    ``sum_i w_i (e_i / a_i)^2`` for weights ``w`` and channel energies ``e``, is proportional
    to ``sum_i w_i / a_i^2 * sum_i a_i^2 e_i``; by Cauchy-Schwarz it is smallest, at
    ``(sum_i sqrt(w_i e_i))^2``, when ``a_i^2 = sqrt(w_i / e_i)``. Energies below 1e-6 of
    their head's mean are floored there so a dead channel cannot blow the scale up.
    """
    w = weight_energy.double()
    e = energy.double()
    w = w.clamp_min(1e-6 * w.mean(-1, keepdim=True))
    e = e.clamp_min(1e-6 * e.mean(-1, keepdim=True))
    log_a = 0.25 * (w.log() - e.log())
    return (log_a - log_a.mean(-1, keepdim=True)).exp().float()


def key_channel_scale(query_energy: torch.Tensor, key_energy: torch.Tensor) -> torch.Tensor:
    """Per-channel key weights ``[KV, d]`` that minimise the expected score error.

    The score error of a key error ``err`` is ``<q, err>``; its mean square over queries is
    ``sum_i E[q_i^2] err_i^2`` (channels taken as uncorrelated), so the weights are the query
    energies: ``a_i = (E[q_i^2] / E[k_i^2]) ** (1/4)`` (see :func:`_balanced_scale`).
    Channels the queries hardly read get the error; channels they read get the bits.
    """
    if query_energy.shape != key_energy.shape:
        raise ValueError(
            f"query and key energies must have the same shape, got {tuple(query_energy.shape)} "
            f"and {tuple(key_energy.shape)}"
        )
    return _balanced_scale(query_energy, key_energy)


def value_channel_scale(output_weight: torch.Tensor, value_energy: torch.Tensor) -> torch.Tensor:
    """Per-channel value weights ``[KV, d]`` that minimise the error after ``o_proj``.

    ``output_weight`` is the ``o_proj`` weight ``[hidden, H * d]``; a value error ``err`` of KV
    head ``g`` reaches the residual stream as ``sum_h W_h err`` over the query heads ``h`` of
    its group, whose mean square is ``sum_i ||W[:, i]||^2 err_i^2`` with the column norms summed
    over the group (columns taken as orthogonal). ``a_i = (||W_i||^2 / E[v_i^2]) ** (1/4)``.
    """
    kv_heads, head_dim = value_energy.shape
    columns = output_weight.detach().double().pow(2).sum(0)  # [H * d]
    if columns.numel() % (kv_heads * head_dim):
        raise ValueError(
            f"o_proj has {columns.numel()} input columns, not a multiple of KV heads x head_dim "
            f"= {kv_heads} x {head_dim}"
        )
    group = columns.numel() // (kv_heads * head_dim)
    weight = columns.reshape(kv_heads, group, head_dim).sum(1).to(value_energy.device)
    return _balanced_scale(weight, value_energy)


@dataclass(frozen=True)
class ChannelPart:
    """A quantizer applied to a subset of channels: ``channels`` ``[KV, c]`` or ``None`` (all)."""

    quantizer: object
    channels: torch.Tensor | None


@dataclass(frozen=True)
class CompressedParts:
    """The compressed form of ``[B, KV, S, d]`` vectors: one ``CompressedVectors`` per part."""

    parts: tuple

    @property
    def length(self) -> int:
        return self.parts[0].shape[-1]

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)

    def cat(self, other: CompressedParts) -> CompressedParts:
        """Append ``other`` along the token axis."""
        cls = type(self.parts[0])
        return CompressedParts(
            tuple(cls.cat([a, b], dim=2) for a, b in zip(self.parts, other.parts))
        )

    def tail(self, n: int) -> CompressedParts:
        """The last ``n`` tokens (all of them when there are fewer)."""
        if n < 1:
            raise ValueError(f"tail needs n >= 1, got {n!r}")
        return self.map(lambda t: t[:, :, -n:])

    def map(self, fn) -> CompressedParts:
        """Apply ``fn`` to every tensor field of every part (batch slicing, devices)."""
        return CompressedParts(tuple(part.map(fn) for part in self.parts))


def _gather_channels(x: torch.Tensor, channels: torch.Tensor | None) -> torch.Tensor:
    """``x[b, h, s, channels[h // G]]`` for ``x`` ``[B, H, S, d]`` and ``channels`` ``[KV, c]``
    (``G = H / KV``: query head ``h`` reads the channels of its KV head)."""
    if channels is None:
        return x
    index = expand_kv_heads(channels.to(x.device), x.shape[1], dim=0)  # [H, c]
    index = index[None, :, None, :].expand(x.shape[0], -1, x.shape[2], -1)
    return torch.gather(x, -1, index)


class VectorCodec:
    """Compress / decompress / score the keys or values of one layer.

    ``parts`` are the channel subsets with their quantizers; ``mean`` (``[KV, d]`` or
    ``None``) is subtracted before quantizing; ``scale`` (``[KV, d]`` or ``None``) multiplies
    each channel after that and is divided out after decoding; ``transform`` (a
    :class:`~rqlib.kernels.state.Transform` or ``None``) maps the result before the parts
    quantize it; ``norm_correction`` stores, for each vector, the scale ``<x, x_hat> /
    ||x_hat||^2`` times the norm instead of the norm.
    """

    def __init__(
        self,
        parts: list[ChannelPart],
        head_dim: int,
        mean: torch.Tensor | None = None,
        norm_correction: bool = False,
        scale: torch.Tensor | None = None,
        transform: Transform | None = None,
    ) -> None:
        if not parts:
            raise ValueError("a codec needs at least one channel part")
        if scale is not None and (scale.shape[-1] != head_dim or not bool((scale > 0).all())):
            raise ValueError(f"scale must be positive with last dim {head_dim}")
        if transform is not None and tuple(transform.matrix.shape[-2:]) != (head_dim, head_dim):
            raise ValueError(
                f"a transform must be [KV, {head_dim}, {head_dim}], got "
                f"{tuple(transform.matrix.shape)}"
            )
        self.parts = tuple(parts)
        self.head_dim = head_dim
        self.mean = mean
        self.norm_correction = norm_correction
        self.scale = scale
        self.transform = transform

    @property
    def bits_per_vector(self) -> int:
        """Stored bits per (token, KV head): codes, norms, QJL signs and residual norms."""
        return sum(part.quantizer.bits_per_vector for part in self.parts)

    def _prepared(self, x: torch.Tensor) -> torch.Tensor:
        """What is quantized: ``T ((x - mean) * scale)``."""
        if self.mean is not None:
            x = x - self.mean.to(x.device, x.dtype)[None, :, None, :]
        if self.scale is not None:
            x = x * self.scale.to(x.device, x.dtype)[None, :, None, :]
        if self.transform is not None:
            x = self.transform.forward(x)
        return x

    def encode(
        self, x: torch.Tensor, *, backend: str = "torch", validate: bool = True
    ) -> CompressedParts:
        """Compress ``x`` ``[B, KV, S, d]``; the quantizers run on ``backend``
        (:func:`rqlib.kernels.quantize`; on the torch backend an MSE quantizer's steps run here,
        from its own primitives, so that the rotated vectors feed the norm correction).
        ``validate=False`` skips the checks that read values back to the host (finite input, no
        norm overflow): the caller checks the norms."""
        x = self._prepared(x.float())
        out = []
        for part in self.parts:
            sub = _gather_channels(x, part.channels)
            qz = part.quantizer
            if backend == "torch" and qz.mse_bits and not qz.has_qjl and qz.trellis is None:
                norms, y = qz.rotated_unit(sub, validate)
                indices = torch.bucketize(y, _on(qz.boundaries, y))
                codes = pack_codes(indices, qz.mse_bits)
                if self.norm_correction:
                    c_hat = _on(qz.centroids, y)[indices]
                    norms = _least_squares_norms(qz, norms, y, c_hat)
                stored = qz.store_norms(norms, validate=validate)
                out.append(CompressedVectors(codes, stored, None, None, qz))
                continue
            compressed = kernels.quantize(qz, sub, backend=backend, validate=validate)
            if self.norm_correction:
                norms, y = qz.rotated_unit(sub, False)
                norms = _least_squares_norms(qz, norms, y, centroid_values(compressed))
                compressed = dataclasses.replace(
                    compressed, norms=qz.store_norms(norms, validate=validate)
                )
            out.append(compressed)
        return CompressedParts(tuple(out))

    def decode(self, c: CompressedParts) -> torch.Tensor:
        """The reconstruction ``[B, KV, S, d]`` (mean added back)."""
        first = c.parts[0]
        batch, heads, length = first.shape
        device = first.norms.device
        out = torch.zeros(batch, heads, length, self.head_dim, device=device)
        for part, compressed in zip(self.parts, c.parts):
            decoded = part.quantizer.dequantize(compressed).float()
            if part.channels is None:
                out = out + decoded
            else:
                index = part.channels.to(device)[None, :, None, :].expand(batch, -1, length, -1)
                out = out.scatter(-1, index, decoded)
        if self.transform is not None:
            out = self.transform.back(out)
        if self.scale is not None:
            out = out / self.scale.to(device)[None, :, None, :]
        if self.mean is not None:
            out = out + self.mean.to(device)[None, :, None, :]
        return out

    def scores(self, q: torch.Tensor, c: CompressedParts) -> torch.Tensor:
        """Estimated ``<q_i, k_j>`` ``[B, Hq, Lq, S]`` (unscaled): sum over parts + ``<q, mu>``."""
        kv_heads = c.parts[0].shape[1]
        group_size(q.shape[1], kv_heads)
        q = q.float()
        q_scaled = q
        if self.scale is not None:  # <q, k - mu> = <q / a, a * (k - mu)>
            q_scaled = (
                q / expand_kv_heads(self.scale.to(q.device), q.shape[1], dim=0)[None, :, None]
            )
        if self.transform is not None:  # <q, T^-1 z> = <T^-T q, z>, per query head
            inverse = expand_kv_heads(self.transform.inverse.to(q.device), q.shape[1], dim=0)
            q_scaled = torch.einsum("bhld,hde->bhle", q_scaled, inverse.float())
        total = None
        for part, compressed in zip(self.parts, c.parts):
            estimate = estimate_scores(_gather_channels(q_scaled, part.channels), compressed)
            total = estimate if total is None else total + estimate
        if self.mean is not None:
            mean = expand_kv_heads(self.mean.to(q.device), q.shape[1], dim=0)  # [Hq, d]
            total = total + torch.einsum("bhld,hd->bhl", q, mean)[..., None]
        return total


def _on(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` on ``like``'s device (no dispatch when it is there already)."""
    return t if t.device == like.device else t.to(like.device)


def _least_squares_norms(qz, norms: torch.Tensor, y: torch.Tensor, c_hat: torch.Tensor):
    """Norm correction: ``<x, x_hat> / ||x_hat / norm||^2`` instead of ``||x||``, so that the
    reconstruction ``x_hat`` is the least-squares fit of ``x`` along its direction.

    In the rotated space ``x_hat / norm = R^T c_hat`` and ``y = R x / ||x||``, so ``<x, R^T c_hat>
    = ||x|| <y, c_hat>``; ``||R^T c_hat|| = ||c_hat||`` for square rotations (rotor blocks pad
    ``d``: there the norm is taken after rotating back). An all-zero ``c_hat`` keeps the norm."""
    numerator = (y * c_hat).sum(-1)
    if qz.rotated_dim == qz.d:
        denominator = (c_hat * c_hat).sum(-1)
    else:
        denominator = (c_hat @ _on(qz.rotation.matrix, c_hat)).pow(2).sum(-1)
    return torch.where(denominator > 0, norms * numerator / denominator.clamp_min(1e-30), norms)
