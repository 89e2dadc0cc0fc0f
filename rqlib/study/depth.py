"""Per-layer error measurements of compressed keys, and the error of the residual stream.

Chapter 2 of the book asks where the error of a compressed key cache comes from and whether
it grows with depth. This module holds its measurements; everything they compress or score
comes from the rest of rqlib:

- the quantizers are those of the compressed cache itself (:func:`key_quantizers` reads them
  out of :func:`rqlib.hf.build_cache`), so a per-layer number and the all-layers run of
  :func:`residual_stream_errors` use the same rotations, codebooks and sketches;
- estimated scores come from :func:`rqlib.hf.codec.estimate_scores`, the cache's own
  estimator (:func:`rqlib.kernels.fused_scores` on CUDA for the head dims the Triton kernels
  support, the torch estimator elsewhere).

Per layer (:func:`layer_errors`), over every causal query/key pair ``j <= i`` of every head,
with ``s = scaling * <q, k>`` the exact logit and ``ŝ`` its estimate:

- ``slope``: the least-squares slope of ``ŝ`` on ``s``; 1 means unbiased, the MSE estimator's
  shrinkage makes it smaller (:func:`rqlib.core.theory.mse_shrinkage`);
- ``logit_var``: ``Var(s)``, the spread of the exact logits;
- ``bias_var`` and ``noise_var``: ``Var(ŝ - s)`` split exactly into the part a rescaling would
  remove, ``(1 - slope)^2 Var(s)``, and what is left, ``Var(ŝ - slope s)`` (the two add up
  because the regression residual is uncorrelated with ``s``);
- ``attention_kl``: ``KL(p || p̂)`` of the causal softmax rows, averaged over heads and queries;
- ``kl_second_order``: the same KL to second order in the score error ``ε = ŝ - s``,
  ``½ Var_p(ε)`` (the variance of ``ε`` under each row's exact attention ``p``), averaged over
  rows: a shift common to a row drops out, only the spread of the error across keys counts;
- ``kl_shrinkage``: ``KL(p || softmax(slope · s))``, the KL the measured shrinkage alone would
  cause (a softmax temperature ``1 / slope``), averaged over rows;
- ``output_error``: ``‖p̂ V - p V‖ / ‖p V‖`` over the layer's whole attention output (values
  exact: only the keys are compressed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import pandas as pd
import torch

from rqlib.core.gqa import expand_kv_heads
from rqlib.hf import build_cache, compress
from rqlib.hf.codec import estimate_scores
from rqlib.spec.config import CompressionConfig

__all__ = [
    "LayerErrors",
    "causal_mask",
    "hidden_state_errors",
    "key_quantizers",
    "layer_errors",
    "measure_layers",
    "next_token_kl",
    "residual_stream_errors",
    "row_kl",
    "score_statistics",
]


@dataclass(frozen=True)
class LayerErrors:
    """The errors one quantizer makes in one attention layer (see the module docstring)."""

    slope: float
    logit_var: float
    bias_var: float
    noise_var: float
    attention_kl: float
    kl_second_order: float
    kl_shrinkage: float
    output_error: float


def _check_4d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != 4:
        raise ValueError(f"{name} must be [batch, heads, tokens, head_dim], got {tuple(t.shape)}")


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[n_queries, n_keys]``: query ``i`` (the last ``n_queries`` tokens) sees keys
    ``j <= i + n_keys - n_queries``."""
    if not 0 < n_queries <= n_keys:
        raise ValueError(f"need 0 < n_queries <= n_keys, got {n_queries} and {n_keys}")
    offset = n_keys - n_queries
    rows = torch.arange(n_queries, device=device)[:, None]
    cols = torch.arange(n_keys, device=device)[None, :]
    return cols <= rows + offset


def row_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` along the last axis from log-probabilities (``-inf`` where both are
    zero, as a causal mask leaves them); float32, one value per row."""
    if log_p.shape != log_q.shape:
        raise ValueError(f"log_p and log_q shapes differ: {log_p.shape} vs {log_q.shape}")
    p = log_p.exp()
    difference = torch.where(p > 0, log_p - log_q, torch.zeros_like(log_p))
    return (p * difference).sum(dim=-1)


def score_statistics(exact: torch.Tensor, estimate: torch.Tensor) -> tuple[float, float, float]:
    """``(slope, bias_var, noise_var)`` of ``estimate`` regressed on ``exact`` (flat samples).

    ``slope = Cov(ŝ, s) / Var(s)``, ``bias_var = (1 - slope)^2 Var(s)`` and
    ``noise_var = Var(ŝ - slope s)``; ``bias_var + noise_var = Var(ŝ - s)``.
    """
    if exact.shape != estimate.shape or exact.numel() < 2:
        raise ValueError(
            f"exact and estimate must have one shape with >= 2 samples, got "
            f"{tuple(exact.shape)} and {tuple(estimate.shape)}"
        )
    s = exact.double().flatten()
    e = estimate.double().flatten()
    s_centered, e_centered = s - s.mean(), e - e.mean()
    var_s = float((s_centered**2).mean())
    if var_s == 0.0:
        raise ValueError("exact scores are constant; the slope is undefined")
    slope = float((s_centered * e_centered).mean()) / var_s
    bias_var = (1.0 - slope) ** 2 * var_s
    noise_var = float(((e_centered - slope * s_centered) ** 2).mean())
    return slope, bias_var, noise_var


def layer_errors(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    quantizer,
    scaling: float,
) -> LayerErrors:
    """Compress ``key`` with ``quantizer`` and measure the errors of one causal attention layer.

    The attention is full causal attention over the given tokens (no sliding window, no
    padding): the layers of SmolLM2 and Qwen2.5, not Gemma 3's sliding ones.

    Args:
        query: ``[B, H, S, d]`` (after RoPE, as :mod:`rqlib.hf.capture` records it).
        key: ``[B, KV, S, d]``; compressed here.
        value: ``[B, KV, S, d]``; kept exact.
        quantizer: a :class:`rqlib.core.quantizers.Quantizer` for dimension ``d``.
        scaling: the layer's logit scale (usually ``d ** -0.5``).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_4d(name, t)
    if key.shape != value.shape or key.shape[-2] != query.shape[-2]:
        raise ValueError(
            f"need key and value of one shape and as many tokens as query, got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if not isinstance(scaling, (int, float)) or scaling <= 0:
        raise ValueError(f"scaling must be a positive number, got {scaling!r}")
    q_heads = query.shape[1]
    query = query.float()
    keys_full = expand_kv_heads(key.float(), q_heads)
    values_full = expand_kv_heads(value.float(), q_heads)
    exact = scaling * (query @ keys_full.transpose(-1, -2))
    estimate = scaling * estimate_scores(query, quantizer.quantize(key))
    mask = causal_mask(query.shape[-2], key.shape[-2], query.device)
    slope, bias_var, noise_var = score_statistics(exact[..., mask], estimate[..., mask])

    log_p = torch.log_softmax(exact.masked_fill(~mask, float("-inf")), dim=-1)
    log_q = torch.log_softmax(estimate.masked_fill(~mask, float("-inf")), dim=-1)
    kl = float(row_kl(log_p, log_q).mean())
    p = log_p.exp()
    error = (estimate - exact).masked_fill(~mask, 0.0)
    spread = (p * error**2).sum(-1) - (p * error).sum(-1) ** 2  # Var_p(ε) per row
    kl_second_order = float(0.5 * spread.mean())
    log_t = torch.log_softmax((slope * exact).masked_fill(~mask, float("-inf")), dim=-1)
    kl_shrinkage = float(row_kl(log_p, log_t).mean())
    out_exact = log_p.exp() @ values_full
    out_estimate = log_q.exp() @ values_full
    output_error = float((out_estimate - out_exact).norm() / out_exact.norm())
    logit_var = float(exact[..., mask].double().var(unbiased=False))
    return LayerErrors(
        slope, logit_var, bias_var, noise_var, kl, kl_second_order, kl_shrinkage, output_error
    )


def key_quantizers(model: torch.nn.Module, config) -> list:
    """The key quantizer of every layer of the cache that ``config`` builds for ``model``.

    ``config`` is a :class:`rqlib.hf.CompressionConfig` or a spec string; it must compress the
    keys of every layer with a single quantizer (no exact layers, outlier channels or
    centering), so that the quantizer alone describes what the cache does to a key.
    """
    if isinstance(config, str):
        config = CompressionConfig.parse(config)
    if config.needs_calibration or config.exact_layers or config.norm_correction:
        raise ValueError(
            f"{config.spec()!r}: per-layer measurements need a plain config (no centering, "
            "outlier channels, norm correction or exact layers)"
        )
    cache = build_cache(model, config)
    quantizers = []
    for layer in cache.layers:
        parts = layer.key_codec.parts
        if len(parts) != 1:
            raise ValueError(f"{config.spec()!r} splits keys into {len(parts)} channel parts")
        quantizers.append(parts[0].quantizer)
    return quantizers


def measure_layers(
    model: torch.nn.Module,
    captured,
    configs: Mapping[str, object],
    *,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> pd.DataFrame:
    """:func:`layer_errors` for every captured layer and every config: one row per pair.

    Args:
        model: the model the activations were captured from (for its cache geometry).
        captured: a :class:`rqlib.hf.capture.AttentionCapture` of one forward pass.
        configs: label -> :class:`rqlib.hf.CompressionConfig` or spec string.
        device: where the scores are computed (the capture lives on the CPU).
        progress: show a progress bar.

    Returns a DataFrame with columns ``method``, ``layer`` and the fields of
    :class:`LayerErrors`.
    """
    from tqdm.auto import tqdm

    if not configs:
        raise ValueError("configs is empty; give at least one label -> config")
    quantizers = {label: key_quantizers(model, config) for label, config in configs.items()}
    layers = captured.captured_layers()
    rows = []
    for layer in tqdm(layers, desc="layers", disable=not progress):
        calls = captured.calls[layer]
        if len(calls) != 1:
            raise ValueError(f"layer {layer} was captured {len(calls)} times; capture one pass")
        call = calls[0]
        query, key, value = (t.to(device) for t in (call.query, call.key, call.value))
        scaling = call.scaling if call.scaling is not None else query.shape[-1] ** -0.5
        for label, per_layer in quantizers.items():
            errors = layer_errors(query, key, value, per_layer[layer], float(scaling))
            rows.append({"method": label, "layer": layer, **asdict(errors)})
    return pd.DataFrame(rows)


def hidden_state_errors(reference: tuple, states: tuple) -> list[float]:
    """Relative error ``‖h - h_ref‖ / ‖h_ref‖`` of each hidden state, per token, averaged
    over tokens (so that a token with a huge residual norm, such as an attention sink's,
    does not stand in for all of them).

    ``reference`` and ``states`` are the ``hidden_states`` tuples of two forward passes
    (``output_hidden_states=True``): entry 0 is the embeddings, entry ``l`` the residual
    stream after layer ``l`` (the last one after the final norm, in transformers models).
    """
    if len(reference) != len(states):
        raise ValueError(f"{len(reference)} reference states against {len(states)} states")
    return [
        float(((h.float() - r.float()).norm(dim=-1) / r.float().norm(dim=-1)).mean())
        for r, h in zip(reference, states)
    ]


def next_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean ``KL(p_ref || p)`` of the next-token distributions over all positions (nats)."""
    return float(
        row_kl(
            torch.log_softmax(reference_logits.float(), -1), torch.log_softmax(logits.float(), -1)
        ).mean()
    )


def residual_stream_errors(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    configs: Mapping[str, object],
    *,
    tokenizer=None,
    progress: bool = True,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Compress the keys of every layer at once and follow the error through the model.

    Runs ``input_ids`` (``[S]`` or ``[1, S]``) once exactly and once per config through
    :func:`rqlib.hf.compress`, with ``output_hidden_states=True``.

    Returns ``(per_layer, final)``: ``per_layer`` has one row per ``(method, layer)`` with the
    relative error of the residual stream after that layer (layer 0: the first block's
    output); ``final`` one row per method with ``next_token_kl`` (mean over positions) and
    ``top1`` (agreement of the argmax with the exact model).
    """
    from tqdm.auto import tqdm

    if not configs:
        raise ValueError("configs is empty; give at least one label -> config")
    ids = input_ids if input_ids.ndim == 2 else input_ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [S] or [1, S], got {tuple(input_ids.shape)}")
    ids = ids.to(next(model.parameters()).device)
    with torch.no_grad():
        exact = model(ids, use_cache=False, output_hidden_states=True)
        per_layer, final = [], []
        for label, config in tqdm(configs.items(), desc="configs", disable=not progress):
            with compress(model, config, tokenizer=tokenizer) as cache:
                out = model(ids, cache=cache, use_cache=True, output_hidden_states=True)
            errors = hidden_state_errors(exact.hidden_states, out.hidden_states)
            per_layer += [
                {"method": label, "layer": layer, "hidden_error": error}
                for layer, error in enumerate(errors[1:])
            ]
            top1 = (out.logits.argmax(-1) == exact.logits.argmax(-1)).float().mean()
            final.append(
                {
                    "method": label,
                    "next_token_kl": next_token_kl(exact.logits, out.logits),
                    "top1": float(top1),
                }
            )
            del out
    return pd.DataFrame(per_layer), pd.DataFrame(final)
