"""Per-layer codecs: how one layer's keys or values become packed codes and come back.

A :class:`VectorCodec` compresses ``[B, KV, S, d]`` vectors of one layer. It may

- subtract a calibrated per-KV-head mean before quantizing (keys: ``<q, k> = <q, k - mu> +
  <q, mu>``, the second term added back exactly, so centering only changes what is quantized);
- split the channels of each KV head into outlier channels (calibrated, quantized at more bits)
  and the rest, each subset with its own quantizer (its own rotation, norm and codes);
- replace each stored norm by the least-squares scale of the reconstruction (norm correction).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rqlib.hf.scores import estimate_scores

__all__ = ["ChannelPart", "VectorCodec", "CompressedParts"]


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

    def map(self, fn) -> CompressedParts:
        """Apply ``fn`` to every tensor field of every part (batch slicing, devices)."""
        return CompressedParts(tuple(part.map(fn) for part in self.parts))


def _gather_channels(
    x: torch.Tensor, channels: torch.Tensor | None, group: int = 1
) -> torch.Tensor:
    """``x[b, h, s, channels[h // group]]`` for ``x`` ``[B, H, S, d]``."""
    if channels is None:
        return x
    index = channels.to(x.device).repeat_interleave(group, dim=0)  # [H, c]
    index = index[None, :, None, :].expand(x.shape[0], -1, x.shape[2], -1)
    return torch.gather(x, -1, index)


class VectorCodec:
    """Compress / decompress / score the keys or values of one layer.

    ``parts`` are the channel subsets with their quantizers; ``mean`` (``[KV, d]`` or
    ``None``) is subtracted before quantizing; ``norm_correction`` stores, for each vector,
    the scale ``<x, x_hat> / ||x_hat||^2`` times the norm instead of the norm.
    """

    def __init__(
        self,
        parts: list[ChannelPart],
        head_dim: int,
        mean: torch.Tensor | None = None,
        norm_correction: bool = False,
    ) -> None:
        if not parts:
            raise ValueError("a codec needs at least one channel part")
        self.parts = tuple(parts)
        self.head_dim = head_dim
        self.mean = mean
        self.norm_correction = norm_correction

    @property
    def bits_per_vector(self) -> int:
        """Stored bits per (token, KV head): codes, norms, QJL signs and residual norms."""
        return sum(part.quantizer.bits_per_vector for part in self.parts)

    def _centered(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return x
        return x - self.mean.to(x.device, x.dtype)[None, :, None, :]

    def encode(self, x: torch.Tensor) -> CompressedParts:
        """Compress ``x`` ``[B, KV, S, d]``."""
        x = self._centered(x.float())
        out = []
        for part in self.parts:
            sub = _gather_channels(x, part.channels)
            compressed = part.quantizer.quantize(sub)
            if self.norm_correction:
                compressed = _correct_norms(sub, compressed)
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
        if self.mean is not None:
            out = out + self.mean.to(device)[None, :, None, :]
        return out

    def scores(self, q: torch.Tensor, c: CompressedParts) -> torch.Tensor:
        """Estimated ``<q_i, k_j>`` ``[B, Hq, Lq, S]`` (unscaled): sum over parts + ``<q, mu>``."""
        kv_heads = c.parts[0].shape[1]
        group = q.shape[1] // kv_heads
        q = q.float()
        total = None
        for part, compressed in zip(self.parts, c.parts):
            estimate = estimate_scores(_gather_channels(q, part.channels, group), compressed)
            total = estimate if total is None else total + estimate
        if self.mean is not None:
            mean = self.mean.to(q.device).repeat_interleave(group, dim=0)  # [Hq, d]
            total = total + torch.einsum("bhld,hd->bhl", q, mean)[..., None]
        return total


def _correct_norms(x: torch.Tensor, compressed):
    """Store ``norm * <x, x_hat>/||x_hat||^2`` so the reconstruction is the least-squares fit."""
    x_hat = compressed.quantizer.dequantize(compressed).float()
    numerator = (x * x_hat).sum(-1)
    denominator = (x_hat * x_hat).sum(-1)
    scale = torch.where(denominator > 0, numerator / denominator.clamp_min(1e-30), 1.0)
    norms = (compressed.norms.float() * scale).to(compressed.norms.dtype)
    return dataclasses.replace(compressed, norms=norms)
