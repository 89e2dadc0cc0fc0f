"""Record the queries, keys and values every attention layer sees.

The capture is a registered transformers attention function (``"rqlib-capture"``): it
copies ``query``/``key``/``value`` of each layer into an :class:`AttentionCapture` and then
calls the stock ``sdpa`` implementation, so the model's outputs are exactly its sdpa outputs.
The matching mask function (``sdpa_mask``) is registered under the same name, so causal
masks, padding and sliding windows are those of sdpa too. No model code is copied or patched::

    with capture_attention(model) as captured:
        model(input_ids)
    keys = captured.keys(layer=3)  # [batch, kv_heads, tokens, head_dim], float32, on CPU

Shapes are those transformers passes to attention functions: query ``[B, H, S, D]``, key and
value ``[B, KV, S, D]`` (not repeated for grouped-query attention), after RoPE.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The name under which the capturing attention is registered.
CAPTURE_NAME = "rqlib-capture"

_ACTIVE: list[AttentionCapture] = []


@dataclass(frozen=True)
class CapturedCall:
    """What one attention layer received in one forward call (float32 copies)."""

    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float | None


@dataclass
class AttentionCapture:
    """Per-layer records of the attention inputs seen inside :func:`capture_attention`."""

    layers: tuple[int, ...] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    calls: dict[int, list[CapturedCall]] = field(default_factory=dict)

    def record(self, layer: int, query, key, value, scaling: float | None) -> None:
        """Store copies of one layer's inputs (skipped for layers not in ``self.layers``)."""
        if self.layers is not None and layer not in self.layers:
            return

        def copy(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=self.device, dtype=torch.float32, copy=True)

        call = CapturedCall(layer, copy(query), copy(key), copy(value), scaling)
        self.calls.setdefault(layer, []).append(call)

    def captured_layers(self) -> list[int]:
        """The layer indices that were recorded, in order."""
        return sorted(self.calls)

    def _stacked(self, kind: str, layer: int) -> torch.Tensor:
        if layer not in self.calls:
            raise KeyError(f"layer {layer} was not captured; captured: {self.captured_layers()}")
        return torch.cat([getattr(call, kind) for call in self.calls[layer]], dim=-2)

    def queries(self, layer: int) -> torch.Tensor:
        """All queries of ``layer``, forward calls concatenated along the token axis."""
        return self._stacked("query", layer)

    def keys(self, layer: int) -> torch.Tensor:
        """All keys of ``layer`` ``[B, KV, tokens, D]``, calls concatenated along tokens."""
        return self._stacked("key", layer)

    def values(self, layer: int) -> torch.Tensor:
        """All values of ``layer``, calls concatenated along the token axis."""
        return self._stacked("value", layer)


def capturing_attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """The registered attention function: record the inputs, then run sdpa unchanged."""
    if not _ACTIVE:
        raise RuntimeError(
            f"attention implementation {CAPTURE_NAME!r} was called outside capture_attention(); "
            "use `with rqlib.hf.capture.capture_attention(model): ...`"
        )
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise TypeError(f"{type(module).__name__} has no layer_idx; cannot tell layers apart")
    _ACTIVE[-1].record(int(layer), query, key, value, kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Register the capturing attention and its (sdpa) mask function; idempotent."""
    AttentionInterface.register(CAPTURE_NAME, capturing_attention)
    AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)


@contextmanager
def capture_attention(
    model, *, layers: list[int] | None = None, device: str | torch.device = "cpu"
) -> Iterator[AttentionCapture]:
    """Switch ``model`` to the capturing attention for the block; restore it on exit.

    Args:
        model: a transformers model whose attention goes through ``AttentionInterface``.
        layers: the layer indices to keep (default all); others run uncaptured.
        device: where the float32 copies are stored (default CPU, to spare GPU memory).
    """
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if layers is not None:
        layers = tuple(int(i) for i in layers)
        n_layers = getattr(model.config, "num_hidden_layers", None)
        bad = [i for i in layers if i < 0 or (n_layers is not None and i >= n_layers)]
        if bad:
            raise ValueError(f"layers {bad} are out of range for a model with {n_layers} layers")
    register()
    previous = model.config._attn_implementation
    capture = AttentionCapture(layers=layers, device=torch.device(device))
    model.set_attn_implementation(CAPTURE_NAME)
    if model.config._attn_implementation != CAPTURE_NAME:
        model.set_attn_implementation(previous)
        raise TypeError(
            f"{type(model).__name__} does not accept registered attention functions "
            "(its attention does not go through AttentionInterface)"
        )
    _ACTIVE.append(capture)
    try:
        yield capture
    finally:
        _ACTIVE.remove(capture)
        model.set_attn_implementation(previous)
