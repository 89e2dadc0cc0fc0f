"""The shape of a model's attention, read from its transformers config (no import of
transformers: any object with the config's attributes works)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelGeometry", "model_geometry"]


@dataclass(frozen=True)
class ModelGeometry:
    """Layers, query heads, KV heads and head dimension of a decoder's attention."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.heads // self.kv_heads

    def to_dict(self) -> dict[str, int]:
        return {
            "layers": self.layers,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
        }


def model_geometry(model_or_config) -> ModelGeometry:
    """The attention geometry of a model, or of its (possibly multimodal) config.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` and ``num_key_value_heads``
    to ``num_attention_heads``, as transformers does.
    """
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelGeometry(config.num_hidden_layers, heads, kv_heads, head_dim)
