"""What one layer's attention reads: its stored streams, the chunk's positions and the mask.

:class:`AttentionState` names, for one call, everything a layer of the compressed cache holds
(built by :mod:`rqlib.hf.cache`, read by both implementations of the attention: the torch one in
:mod:`rqlib.kernels.reference` and the Triton one in :mod:`rqlib.kernels.launch`):

- ``keys`` / ``values``: the main streams, every stored token (:class:`Stream`: packed parts of
  a codec with its per-head mean, channel scale or calibrated :class:`Transform`, or exact
  vectors);
- ``band_keys`` / ``band_values``: the recent band (codes of the band codecs, or exact): query
  ``i`` reads keys ``i - band + 1 .. i`` from them instead of the main streams;
- ``sink_keys`` / ``sink_values``: the first ``n_sink`` tokens, exact; they take precedence over
  the band;
- ``start .. end - 1``: the positions of the queries (the chunk just stored); the main streams
  hold positions ``first .. end - 1`` (``first > 0`` once a sliding-window layer evicted
  tokens).

Masks come in two forms. :class:`CausalMask` is what transformers' plain causal and
sliding-window masks are, kept compact: causal, an optional window, and the 2-d padding mask
(per row and key position), so that no ``[Lq, S]`` tensor is ever built. :class:`DenseMask`
wraps any other boolean mask ``[B, 1, Lq, kv_length]`` (e.g. image tokens attending both ways).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rqlib.kernels.store import VectorRing

__all__ = ["AttentionState", "CausalMask", "DenseMask", "Part", "Stream", "Transform"]


@dataclass(frozen=True)
class Part:
    """One quantizer of a codec over ``channels`` (``[KV, c]``, or ``None`` for all of them)."""

    quantizer: object
    channels: torch.Tensor | None
    ring: VectorRing


@dataclass(frozen=True)
class Transform:
    """A calibrated linear map per KV head: ``matrix`` ``T`` and ``inverse`` ``[KV, d, d]``.

    A codec with a transform quantizes ``z = T (x - mean)`` and reads back ``x = T^-1 z +
    mean``; a score is ``<q, x - mean> = <T^-T q, z>``, so queries go through ``T^-T`` once
    and the codes are never mapped back, and a weighted sum of values is mapped back once."""

    matrix: torch.Tensor
    inverse: torch.Tensor

    def _on(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.to(device=like.device, dtype=like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``T x`` for rows ``[B, KV, R, d]``."""
        return torch.einsum("bkrd,ked->bkre", x, self._on(self.matrix, x))

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``T^-T q`` for rows ``[B, KV, R, d]``: ``<q, T^-1 z> = <T^-T q, z>``."""
        return torch.einsum("bkrd,kde->bkre", q, self._on(self.inverse, q))

    def back(self, z: torch.Tensor) -> torch.Tensor:
        """``T^-1 z`` for rows ``[B, KV, R, d]``."""
        return torch.einsum("bkre,kde->bkrd", z, self._on(self.inverse, z))


@dataclass(frozen=True)
class Stream:
    """Keys or values of one layer: packed ``parts`` of a codec that quantized
    ``(x - mean) * scale`` (``mean``/``scale`` ``[KV, d]`` or ``None``), mapped by ``transform``
    when there is one, or an ``exact`` ring."""

    parts: tuple[Part, ...] = ()
    exact: VectorRing | None = None
    mean: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    transform: Transform | None = None

    def __post_init__(self) -> None:
        if bool(self.parts) == (self.exact is not None):
            raise ValueError("a Stream is either packed parts or one exact ring")

    @property
    def is_exact(self) -> bool:
        return self.exact is not None

    @property
    def rings(self) -> tuple[VectorRing, ...]:
        return (self.exact,) if self.exact is not None else tuple(p.ring for p in self.parts)


@dataclass(frozen=True)
class AttentionState:
    """Everything one layer's attention reads for queries at positions ``start .. end - 1``."""

    keys: Stream
    values: Stream
    band_keys: Stream | None
    band_values: Stream | None
    sink_keys: torch.Tensor | None
    sink_values: torch.Tensor | None
    n_sink: int
    band: int
    start: int
    end: int
    first: int = 0

    @property
    def head_dim(self) -> int:
        ring = self.keys.rings[0]
        return ring.dim if ring.dim is not None else ring.quantizer.d


@dataclass(frozen=True)
class CausalMask:
    """A causal mask, with an optional sliding ``window`` (query ``i`` sees keys ``i - window + 1
    .. i``) and a 2-d ``padding`` mask (``bool [B, P]``, False for padding; positions ``>= P``
    are hidden), over key positions ``kv_offset .. kv_offset + kv_length - 1`` and query
    positions ``q_offset .. q_offset + q_length - 1``."""

    batch: int
    q_offset: int
    q_length: int
    kv_offset: int
    kv_length: int
    window: int | None = None
    padding: torch.Tensor | None = None

    def block(self, t0: int, t1: int, k0: int, k1: int) -> torch.Tensor:
        """Visibility of key positions ``k0 .. k1 - 1`` to queries ``t0 .. t1 - 1`` (indices
        into this mask's queries): bool, broadcastable to ``[B, 1, t1 - t0, k1 - k0]``."""
        device = self.padding.device if self.padding is not None else "cpu"
        queries = torch.arange(self.q_offset + t0, self.q_offset + t1, device=device)[:, None]
        keys = torch.arange(k0, k1, device=device)[None, :]
        visible = (keys <= queries) & (keys >= self.kv_offset)
        visible = visible & (keys < self.kv_offset + self.kv_length)
        if self.window is not None:
            visible = visible & (keys > queries - self.window)
        visible = visible[None, None]
        if self.padding is not None:
            width = self.padding.shape[-1]
            padding = self.padding[:, max(0, min(k0, width)) : max(0, min(k1, width))]
            padding = torch.nn.functional.pad(padding, (0, k1 - k0 - padding.shape[-1]))
            visible = visible & padding[:, None, None, :]
        return visible

    def hidden(self, t0: int, t1: int, k0: int, k1: int) -> torch.Tensor | None:
        """``~block(...)``, or ``None`` when every key of the block is visible to every query
        (a causal block below the diagonal, no padding, no window cutting it)."""
        first_query = self.q_offset + t0
        if (
            self.padding is None
            and k0 >= self.kv_offset
            and k1 <= min(first_query + 1, self.kv_offset + self.kv_length)
            and (self.window is None or k0 > self.q_offset + t1 - 1 - self.window)
        ):
            return None
        return ~self.block(t0, t1, k0, k1)

    def dense(self) -> torch.Tensor:
        """The mask as a boolean tensor ``[B, 1, q_length, kv_length]``."""
        k0 = self.kv_offset
        visible = self.block(0, self.q_length, k0, k0 + self.kv_length)
        return visible.expand(self.batch, 1, self.q_length, self.kv_length)


@dataclass(frozen=True)
class DenseMask:
    """Any boolean mask ``tensor [B, 1, Lq, kv_length]`` (True = attend) whose column ``c``
    is key position ``kv_offset + c``."""

    tensor: torch.Tensor
    kv_offset: int = 0

    @property
    def batch(self) -> int:
        return self.tensor.shape[0]

    @property
    def q_length(self) -> int:
        return self.tensor.shape[2]

    @property
    def kv_length(self) -> int:
        return self.tensor.shape[3]

    def hidden(self, t0: int, t1: int, k0: int, k1: int) -> torch.Tensor:
        """``~block(...)``."""
        return ~self.block(t0, t1, k0, k1)

    def block(self, t0: int, t1: int, k0: int, k1: int) -> torch.Tensor:
        """As :meth:`CausalMask.block`; positions outside the mask's columns are hidden."""
        c0 = min(max(k0 - self.kv_offset, 0), self.kv_length)
        c1 = min(max(k1 - self.kv_offset, 0), self.kv_length)
        columns = self.tensor[:, :, t0:t1, c0:c1]
        before = min(max(self.kv_offset - k0, 0), k1 - k0)
        return torch.nn.functional.pad(columns, (before, k1 - k0 - before - (c1 - c0)))
