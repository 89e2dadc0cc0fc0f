"""The transformers integration: a compressed KV cache and the attention that reads it.

::

    from rqlib.hf import CompressionConfig, compress

    config = CompressionConfig.parse("turboquant-mse:k3:v4:sink1:win32:ctr")
    with compress(model, config, tokenizer=tokenizer) as cache:
        logits = model(input_ids, past_key_values=cache).logits
        cache.reset()                       # before an unrelated sequence
        model.generate(input_ids, past_key_values=cache, max_new_tokens=20)

Integration is only through public extension points: an attention function and a mask
function registered with ``AttentionInterface`` / ``AttentionMaskInterface`` under the name
``"rqlib"`` (:mod:`rqlib.hf.attention`) and a ``transformers.Cache`` subclass
(:mod:`rqlib.hf.cache`). No model code is copied or patched: :func:`compress` only switches
the ``_attn_implementation`` of the model's configs to ``"rqlib"`` and back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rqlib.hf import attention
from rqlib.hf.cache import CompressedCache, CompressedLayer
from rqlib.hf.calibration import Calibration, calibrate, top_channels
from rqlib.hf.codec import ChannelPart, VectorCodec, key_channel_scale, value_channel_scale
from rqlib.hf.config import METHODS, CompressionConfig

__all__ = [
    "METHODS",
    "CompressedCache",
    "CompressionConfig",
    "attention_modules",
    "build_cache",
    "compress",
]

KEY_SEED, VALUE_SEED, OUTLIER_SEED, KEY_BAND_SEED, VALUE_BAND_SEED = 0, 1, 2, 3, 4


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's self-attention modules in layer order (those with a ``layer_idx``).

    Raises ``TypeError`` when the model does not route attention through
    ``AttentionInterface`` (``_supports_attention_backend``) or has no such modules.
    """
    if not getattr(model, "_supports_attention_backend", False):
        raise TypeError(
            f"{type(model).__name__} does not route its attention through transformers' "
            "AttentionInterface, so a compressed cache cannot be installed on it"
        )
    modules = [
        module
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int)
        and hasattr(module, "config")
        and any(hasattr(module, name) for name in ("k_proj", "qkv_proj", "kv_proj"))
    ]
    if not modules:
        raise TypeError(f"{type(model).__name__} has no attention modules with a layer_idx")
    modules.sort(key=lambda module: module.layer_idx)
    indices = [module.layer_idx for module in modules]
    if indices != list(range(len(modules))):
        raise TypeError(f"unexpected attention layer indices {indices} (KV sharing?)")
    return modules


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def _head_geometry(model) -> tuple[int, int, int]:
    config = _text_config(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def _make_codec(
    config: CompressionConfig,
    method: str,
    bits: int,
    head_dim: int,
    seed: int,
    mean: torch.Tensor | None,
    outliers: int,
    energy: torch.Tensor | None,
    scale: torch.Tensor | None = None,
) -> VectorCodec:
    from rqlib.quantizers import make_quantizer

    is_prod = method.endswith("-prod")

    def quantizer(dim: int, part_bits: int, part_seed: int):
        return make_quantizer(
            method,
            dim,
            part_bits,
            seed=part_seed,
            rotation=config.rotation,
            qjl_sketch=config.qjl_sketch if is_prod else None,
            qjl_dim=config.qjl_dim if is_prod else None,
            codebook_law=config.codebook_law,
            norm_mantissa_bits=config.norm_mantissa,
        )

    if outliers == 0:
        parts = [ChannelPart(quantizer(head_dim, bits, seed), None)]
    else:
        if not 0 < outliers < head_dim:
            raise ValueError(f"outlier channel count {outliers} must be in 1..{head_dim - 1}")
        if scale is not None:  # outliers are chosen among the channels as quantized
            energy = energy * scale * scale
        chosen = top_channels(energy, outliers)  # [KV, c]
        mask = torch.ones(energy.shape, dtype=torch.bool)
        mask.scatter_(-1, chosen, False)
        rest = torch.arange(head_dim).expand(energy.shape[0], -1)[mask].reshape(energy.shape[0], -1)
        parts = [
            ChannelPart(
                quantizer(outliers, bits + config.outlier_extra_bits, seed + OUTLIER_SEED), chosen
            ),
            ChannelPart(quantizer(head_dim - outliers, bits, seed), rest),
        ]
    return VectorCodec(
        parts, head_dim, mean=mean, norm_correction=config.norm_correction, scale=scale
    )


def _output_projection(module: torch.nn.Module) -> torch.nn.Linear:
    """The attention output projection (``o_proj``) whose columns weight value errors."""
    projection = getattr(module, "o_proj", None)
    if not isinstance(projection, torch.nn.Linear):
        raise ValueError(
            f"value scaling (vs) needs the attention's output projection 'o_proj'; "
            f"{type(module).__name__} has none"
        )
    return projection


def build_cache(
    model: torch.nn.Module,
    config: CompressionConfig,
    calibration: Calibration | None = None,
) -> CompressedCache:
    """A fresh :class:`CompressedCache` for ``model`` implementing ``config``."""
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
    modules = attention_modules(model)
    n_layers = len(modules)
    _, kv_heads, head_dim = _head_geometry(model)
    exact = config.exact_layer_set(n_layers)
    for count, name in (
        (config.key_outliers, "key_outliers"),
        (config.value_outliers, "value_outliers"),
    ):
        if count and not 0 < count < head_dim:
            raise ValueError(f"{name}={count} must be below head_dim={head_dim}")
    if config.budget is not None:
        raise ValueError(
            "a config with a bit budget (alloc=) must be resolved first: "
            "rqlib.allocation.resolve(config, model, tokenizer), or use compress()"
        )
    if config.needs_calibration and calibration is None:
        raise ValueError("this config needs a calibration (centering or outlier channels)")
    layers = []
    for layer in range(n_layers):
        if layer in exact:
            layers.append(CompressedLayer(layer, None, None))
            continue
        base_seed = config.seed * 1_000_000 + layer * 10
        key_energy = None
        if config.needs_calibration:
            key_energy = calibration.key_energy[layer]
            if not config.center_keys:  # E[k^2] = E[(k - mu)^2] + mu^2
                key_energy = key_energy + calibration.key_means[layer] ** 2
        key_scale = None
        if config.scale_keys:
            key_scale = key_channel_scale(calibration.query_energy[layer], key_energy)
        key_codec = _make_codec(
            config,
            config.method,
            config.key_bits_of(layer),
            head_dim,
            base_seed + KEY_SEED,
            calibration.key_means[layer] if config.center_keys else None,
            config.key_outliers,
            key_energy if config.key_outliers else None,
            key_scale,
        )
        value_bits = config.value_bits_of(layer)
        value_codec = None
        if value_bits is not None:
            value_scale = None
            if config.scale_values:
                value_scale = value_channel_scale(
                    _output_projection(modules[layer]).weight, calibration.value_energy[layer]
                )
            value_codec = _make_codec(
                config,
                config.value_method,
                value_bits,
                head_dim,
                base_seed + VALUE_SEED,
                None,
                config.value_outliers,
                calibration.value_energy[layer] if config.value_outliers else None,
                value_scale,
            )
        key_band = value_band = None
        if config.band_bits is not None:  # the recent band as codes of the values' MSE family

            def band_codec(seed: int, mean: torch.Tensor | None) -> VectorCodec:
                return _make_codec(
                    config, config.value_method, config.band_bits, head_dim, seed, mean, 0, None
                )

            key_band = band_codec(
                base_seed + KEY_BAND_SEED,
                calibration.key_means[layer] if config.center_keys else None,
            )
            if value_codec is not None:
                value_band = band_codec(base_seed + VALUE_BAND_SEED, None)
        layers.append(
            CompressedLayer(
                layer,
                key_codec,
                value_codec,
                config.n_sink,
                config.recent_window,
                (key_band, value_band),
            )
        )
    return CompressedCache(layers, config, id(model))


@contextlib.contextmanager
def compress(
    model: torch.nn.Module,
    config: CompressionConfig | str,
    *,
    tokenizer=None,
) -> Iterator[CompressedCache]:
    """Install a compressed cache on ``model`` for the duration of the block; yield the cache.

    ``config`` is a :class:`CompressionConfig` or a compact spec string. Configs with key
    centering, channel scaling or outlier channels are calibrated first on
    ``config.calibration_corpus`` (never the evaluation text), with ``tokenizer`` (default:
    loaded from the model's ``name_or_path``); a bit budget (``alloc=``) is first resolved
    into per-layer bits for this model (:func:`rqlib.allocation.resolve`). Pass the yielded
    cache as ``past_key_values`` to ``forward`` or ``generate``; call ``cache.reset()``
    between unrelated sequences. On leaving the block, normally or by an exception, the
    model's attention implementation is restored exactly.
    """
    if isinstance(config, str):
        config = CompressionConfig.parse(config)
    if not isinstance(config, CompressionConfig):
        raise TypeError(
            f"config must be a CompressionConfig or a spec string, got {type(config).__name__}"
        )
    modules = attention_modules(model)
    attention.register()
    calibration = None
    if config.needs_calibration or config.budget is not None:
        if tokenizer is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
            except (OSError, ValueError) as error:
                raise ValueError(
                    "this config is calibrated on a corpus; pass compress(..., tokenizer=...) "
                    f"(loading one from {model.name_or_path!r} failed: {error})"
                ) from error
    if config.budget is not None:
        from rqlib.allocation import resolve

        config = resolve(config, model, tokenizer)
    if config.needs_calibration:
        calibration = calibrate(
            model, tokenizer, config.calibration_corpus, config.calibration_tokens
        )
    cache = build_cache(model, config, calibration)
    configs = {id(model.config): model.config}
    for module in model.modules():
        sub = getattr(module, "config", None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            configs[id(sub)] = sub
    saved = {key: c._attn_implementation_internal for key, c in configs.items()}
    busy = [module for module in modules if module in attention.ACTIVE]
    if busy:
        raise RuntimeError("this model is already inside a rqlib.hf.compress(...) block")
    try:
        for module in modules:
            attention.ACTIVE[module] = (cache, module.layer_idx)
        for c in configs.values():
            c._attn_implementation_internal = attention.ATTENTION_NAME
        cache.set_active(True)
        yield cache
    finally:
        cache.set_active(False)
        for key, c in configs.items():
            c._attn_implementation_internal = saved[key]
        for module in modules:
            attention.ACTIVE.pop(module, None)
