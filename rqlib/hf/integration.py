"""Install a compressed cache on a model: :func:`compress` and :func:`build_cache`.

:func:`compress` takes a resolved :class:`~rqlib.spec.config.CompressionConfig` (a spec string,
or the configs of :func:`rqlib.study.allocation.resolve` for presets and budgets; the one call
for those is :func:`rqlib.compress`), builds the cache and switches the model's attention to
``"rqlib"`` for the block; the package docstring (:mod:`rqlib.hf`) shows the use and the
extension points.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from rqlib import kernels
from rqlib.hf import attention
from rqlib.hf.cache import CompressedCache, CompressedLayer
from rqlib.hf.calibration import Calibration, calibrate, top_channels
from rqlib.hf.codec import ChannelPart, VectorCodec, key_channel_scale, value_channel_scale
from rqlib.hf.transform import LayerTransform, fit_layer
from rqlib.spec.codecs import CodecPlan, layer_plan
from rqlib.spec.config import CompressionConfig
from rqlib.spec.geometry import model_geometry

__all__ = [
    "attention_modules",
    "build_cache",
    "calibration_tokenizer",
    "check_config",
    "compress",
    "output_projection",
]


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


def _transform_codec(plan: CodecPlan, fitted: LayerTransform, norm_correction: bool) -> VectorCodec:
    """The codec of a transform plan: its parts over the groups of each width, in every head."""
    quantizers = plan.quantizers()
    kv_heads, head_dim = fitted.mean.shape
    parts = [
        ChannelPart(quantizer, torch.tensor(channels).expand(kv_heads, -1))
        for quantizer, channels in zip(quantizers, plan.part_channels())
    ]
    return VectorCodec(
        parts,
        head_dim,
        mean=fitted.mean,
        norm_correction=norm_correction,
        transform=fitted.transform,
    )


def _codec(
    plan: CodecPlan,
    head_dim: int,
    mean: torch.Tensor | None = None,
    energy: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    norm_correction: bool = False,
) -> VectorCodec:
    """The :class:`VectorCodec` of ``plan``; ``energy`` ``[KV, d]`` chooses outlier channels."""
    quantizers = plan.quantizers()
    if plan.outliers == 0:
        parts = [ChannelPart(quantizers[0], None)]
    else:
        if scale is not None:  # outliers are chosen among the channels as quantized
            energy = energy * scale * scale
        chosen = top_channels(energy, plan.outliers)  # [KV, c]
        mask = torch.ones(energy.shape, dtype=torch.bool)
        mask.scatter_(-1, chosen, False)
        rest = torch.arange(head_dim).expand(energy.shape[0], -1)[mask].reshape(energy.shape[0], -1)
        parts = [ChannelPart(quantizers[0], chosen), ChannelPart(quantizers[1], rest)]
    return VectorCodec(parts, head_dim, mean=mean, norm_correction=norm_correction, scale=scale)


def output_projection(module: torch.nn.Module) -> torch.nn.Linear:
    """The attention output projection (``o_proj``) whose columns weight value errors."""
    projection = getattr(module, "o_proj", None)
    if not isinstance(projection, torch.nn.Linear):
        raise ValueError(
            f"value scaling and transforms (vs, vxf) need the attention's output projection "
            f"'o_proj'; "
            f"{type(module).__name__} has none"
        )
    return projection


def calibration_tokenizer(model: torch.nn.Module, tokenizer=None):
    """``tokenizer``, or the one of ``model.name_or_path`` (a calibrated config needs one)."""
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model.name_or_path)
    except (OSError, ValueError) as error:
        raise ValueError(
            "this config is calibrated on a corpus; pass compress(..., tokenizer=...) "
            f"(loading one from {model.name_or_path!r} failed: {error})"
        ) from error


def _check_buildable(config: CompressionConfig, head_dim: int, calibration) -> None:
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
    for count, name in (
        (config.key_outliers, "key_outliers"),
        (config.value_outliers, "value_outliers"),
    ):
        if count and not 0 < count < head_dim:
            raise ValueError(f"{name}={count} must be below head_dim={head_dim}")
    if config.budget is not None:
        raise ValueError(
            f"{config.label}: a config with a bit budget (alloc=) must be resolved against the "
            "model first: use rqlib.compress(model, config, tokenizer=tokenizer), which "
            "resolves and installs in one call (or rqlib.study.allocation.resolve first)"
        )
    if config.needs_calibration and calibration is None:
        raise ValueError("this config needs a calibration (centering, scaling or outlier channels)")


def check_config(model: torch.nn.Module, config: CompressionConfig) -> None:
    """Check, without calibrating or building anything, that ``config`` fits ``model``: its
    exact layers and per-layer bits name layers the model has, its outlier counts are below
    the head dimension. A config with a budget passes (its bits are chosen later by
    :func:`rqlib.study.allocation.resolve`). ``ValueError`` naming the config otherwise."""
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
    geometry = model_geometry(model)
    try:
        config.exact_layer_set(geometry.layers)
        for count, name in (
            (config.key_outliers, "key_outliers"),
            (config.value_outliers, "value_outliers"),
        ):
            if count and not 0 < count < geometry.head_dim:
                raise ValueError(f"{name}={count} must be below head_dim={geometry.head_dim}")
    except ValueError as error:
        raise ValueError(f"{config.label}: {error}") from None


def _layer(
    config: CompressionConfig,
    layer: int,
    module: torch.nn.Module,
    head_dim: int,
    n_layers: int,
    calibration: Calibration | None,
) -> CompressedLayer:
    """One layer of the cache: its codecs from :func:`rqlib.spec.codecs.layer_plan`, with the
    calibrated means, channel scales and outlier channels filled in."""
    plan = layer_plan(config, layer, n_layers, head_dim)
    sliding_window = getattr(module, "sliding_window", None)  # Gemma 3's local layers
    if plan.exact:
        return CompressedLayer(layer, None, None, sliding_window=sliding_window)
    key_mean = calibration.key_means[layer] if config.center_keys else None
    key_energy = None
    if config.needs_calibration:
        key_energy = calibration.key_energy[layer]
        if not config.center_keys:  # E[k^2] = E[(k - mu)^2] + mu^2
            key_energy = key_energy + calibration.key_means[layer] ** 2
    key_scale = None
    if config.scale_keys:
        key_scale = key_channel_scale(calibration.query_energy[layer], key_energy)
    nc = config.norm_correction
    if plan.key.groups is not None:
        fitted = fit_layer(calibration, layer, "keys")
        key_codec = _transform_codec(plan.key, fitted, nc)
        key_mean = fitted.mean  # the band's keys are centred with the same mean
    else:
        key_codec = _codec(plan.key, head_dim, key_mean, key_energy, key_scale, nc)
    value_codec = None
    if plan.value is not None and plan.value.groups is not None:
        weight = output_projection(module).weight
        value_codec = _transform_codec(
            plan.value, fit_layer(calibration, layer, "values", weight), nc
        )
    elif plan.value is not None:
        value_scale = None
        if config.scale_values:
            value_scale = value_channel_scale(
                output_projection(module).weight, calibration.value_energy[layer]
            )
        value_energy = calibration.value_energy[layer] if config.value_outliers else None
        value_codec = _codec(plan.value, head_dim, None, value_energy, value_scale, nc)
    key_band = value_band = None
    if plan.key_band is not None:
        key_band = _codec(plan.key_band, head_dim, key_mean, norm_correction=nc)
    if plan.value_band is not None:
        value_band = _codec(plan.value_band, head_dim, norm_correction=nc)
    return CompressedLayer(
        layer,
        key_codec,
        value_codec,
        config.n_sink,
        config.recent_window,
        (key_band, value_band),
        sliding_window=sliding_window,
        band_once=config.band_once,
    )


def _on_cuda(model: torch.nn.Module) -> bool:
    """Whether the model's weights (hence its keys and values) live on a CUDA device."""
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cuda"


def build_cache(
    model: torch.nn.Module,
    config: CompressionConfig,
    calibration: Calibration | None = None,
) -> CompressedCache:
    """A fresh :class:`CompressedCache` for ``model`` implementing a resolved ``config``.

    On CUDA the attention runs in one fused Triton kernel; a config it cannot serve (e.g.
    outlier channel splits ``ko``/``vo``/``out``) is refused here with a message naming the
    feature, rather than run on a slow path."""
    modules = attention_modules(model)
    head_dim = model_geometry(model).head_dim
    _check_buildable(config, head_dim, calibration)
    n_layers = len(modules)
    config.exact_layer_set(n_layers)  # validates exact= and per-layer bits against the model
    layers = [
        _layer(config, index, module, head_dim, n_layers, calibration)
        for index, module in enumerate(modules)
    ]
    if _on_cuda(model):
        for layer in layers:  # the fused kernel serves every preset; refuse what it cannot
            kernels.check_layer(
                layer.key_codec, layer.value_codec, layer.key_band_codec, layer.value_band_codec
            )
    return CompressedCache(layers, config, id(model))


class _Installed:
    """One transformers config switched to the rqlib attention, and the blocks holding it."""

    def __init__(self, config) -> None:
        self.config = config
        self.saved = config._attn_implementation_internal
        self.holders: set[int] = set()


#: id(config) -> the config switched to "rqlib" while at least one compress() block holds it.
#: Models may share a config object (or sub-configs); the original setting is restored when the
#: last block holding it ends, whatever the order in which blocks end.
_INSTALLED: dict[int, _Installed] = {}
_INSTALL_LOCK = threading.Lock()


def _attention_configs(model: torch.nn.Module) -> list:
    """The model's config and every sub-config that carries an attention implementation."""
    configs = {id(model.config): model.config}
    for module in model.modules():
        sub = getattr(module, "config", None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            configs[id(sub)] = sub
    return list(configs.values())


def _install(configs: list, block: int) -> None:
    with _INSTALL_LOCK:
        for config in configs:
            entry = _INSTALLED.get(id(config))
            if entry is None:
                entry = _INSTALLED[id(config)] = _Installed(config)
                config._attn_implementation_internal = attention.ATTENTION_NAME
            entry.holders.add(block)


def _uninstall(configs: list, block: int) -> None:
    with _INSTALL_LOCK:
        for config in configs:
            entry = _INSTALLED.get(id(config))
            if entry is None or block not in entry.holders:
                continue
            entry.holders.discard(block)
            if not entry.holders:  # the last block holding this config: restore it exactly
                config._attn_implementation_internal = entry.saved
                del _INSTALLED[id(config)]


@contextlib.contextmanager
def compress(
    model: torch.nn.Module,
    config: CompressionConfig | str,
    *,
    tokenizer=None,
) -> Iterator[CompressedCache]:
    """Install a compressed cache on ``model`` for the duration of the block; yield the cache.

    ``config`` is a resolved :class:`CompressionConfig` or a compact spec string without a bit
    budget. For a budget (``alloc=``, every preset) use :func:`rqlib.compress`, the same block
    with the budget first turned into per-layer bits for this model
    (:func:`rqlib.study.allocation.resolve`, which may measure the model: an evaluation, a
    layer above this one). Configs with key centering, channel scaling
    or outlier channels are calibrated first on ``config.calibration_corpus`` (never the
    evaluation text), with ``tokenizer`` (default: loaded from the model's ``name_or_path``).
    Pass the yielded cache as ``cache=`` to ``forward`` or ``generate``; call
    ``cache.reset()`` between unrelated sequences.

    The cache is usable only inside this block: it refuses updates once the block ends. A model
    can be inside one block at a time. On leaving the block, normally or by an exception, the
    model's attention implementation is restored exactly; when several models share a config
    (or a sub-config), it is restored when the last of their blocks ends, in whatever order
    they end (until then the shared config stays on the rqlib attention, and a model sharing it
    outside its block gets an error, never attention without its cache).
    """
    if isinstance(config, str):
        config = CompressionConfig.parse(config)
    if not isinstance(config, CompressionConfig):
        raise TypeError(
            f"config must be a CompressionConfig or a spec string, got {type(config).__name__}"
        )
    modules = attention_modules(model)
    _check_buildable(config, model_geometry(model).head_dim, calibration=True)
    if any(module in attention.ACTIVE for module in modules):
        raise RuntimeError("this model is already inside a rqlib.hf.compress(...) block")
    attention.register()
    calibration = None
    if config.needs_calibration:
        calibration = calibrate(
            model,
            calibration_tokenizer(model, tokenizer),
            config.calibration_corpus,
            config.calibration_tokens,
            config.calibration_chunk,
        )
    cache = build_cache(model, config, calibration)
    configs = _attention_configs(model)
    block = id(cache)  # unique while the block runs: the cache lives until its end
    try:
        for module in modules:
            attention.ACTIVE[module] = (cache, module.layer_idx)
        _install(configs, block)
        cache.set_active(True)
        yield cache
        cache.check_finite()  # decode steps on the Triton path check on the device
    finally:
        cache.set_active(False)
        _uninstall(configs, block)
        for module in modules:
            if attention.ACTIVE.get(module, (None,))[0] is cache:
                attention.ACTIVE.pop(module, None)
