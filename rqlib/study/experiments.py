"""Preset and ablation experiments: a preset and its one-lever-changed variants in one run.

:func:`run_experiment` evaluates, with :func:`rqlib.study.eval.evaluate` (so the
full-precision model is run once per window and every config sees exactly the same tokens and
windows):

- each preset of :mod:`rqlib.spec.presets`,
- for each preset, every applicable lever of :data:`LEVERS` applied to it (an ingredient
  removed, swapped for an alternative, or added on top),
- optional baseline specs (e.g. plain ``turboquant-mse:b3``),

and writes a self-describing JSON file (model and its geometry, corpus with its sha256, tokens,
window, calibration corpus, command line, and one row per config with its spec, the lever
changed, its average bits per K / V coordinate and their mean at the given context, PPL,
ΔPPL %, mean KL and top-1 agreement). :func:`rqlib.book.loaders.load_ablation` reads such a
file into a ``pandas.DataFrame`` for the book.

Command line::

    python -m rqlib experiment --model smollm2-135m --tokens 8192 \\
        --presets rq-3.5 rq-3 rq-2.5 rq-2 --levers none --json results/presets-smollm2.json --force
    python -m rqlib experiment --model smollm2-135m --tokens 1024 --presets rq-3.5 rq-3 \\
        --json results/ablation-smollm2.json --force

(``--force`` replaces the committed file; without it an existing file is refused.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rqlib.base.corpora import load_corpus, tokenize_corpus
from rqlib.base.files import atomic_write_text
from rqlib.hf.models import load_model
from rqlib.spec.config import CompressionConfig, get_preset
from rqlib.spec.geometry import model_geometry
from rqlib.spec.presets import TARGETS
from rqlib.study.allocation import resolve
from rqlib.study.eval import evaluate

__all__ = [
    "LEVERS",
    "Lever",
    "ablation_configs",
    "run_experiment",
]

CHANGES = ("removed", "swapped", "added")


@dataclass(frozen=True)
class Lever:
    """One ingredient of a preset and how an ablation changes it.

    ``apply`` returns the changed config, or ``None`` when the lever does not apply to this
    preset (e.g. removing centering from a preset that does not centre).
    """

    name: str
    change: str
    description: str
    apply: Callable[[CompressionConfig], CompressionConfig | None]

    def __post_init__(self) -> None:
        if self.change not in CHANGES:
            raise ValueError(f"change must be one of {CHANGES}, got {self.change!r}")


def _without_centering(c: CompressionConfig) -> CompressionConfig | None:
    return c.replace(center_keys=False) if c.center_keys else None


def _without_sink(c: CompressionConfig) -> CompressionConfig | None:
    return c.replace(n_sink=0) if c.n_sink else None


def _without_window(c: CompressionConfig) -> CompressionConfig | None:
    if not c.recent_window:
        return None
    return c.replace(recent_window=0, band_bits=None, band_once=False)


def _exact_band(c: CompressionConfig) -> CompressionConfig | None:
    return None if c.band_bits is None else c.replace(band_bits=None)


def _without_norm_correction(c: CompressionConfig) -> CompressionConfig | None:
    return c.replace(norm_correction=False) if c.norm_correction else None


def _without_allocation(c: CompressionConfig) -> CompressionConfig | None:
    """Uniform bits instead of per-layer ones: the allocation's mean code bits, rounded down.

    Applies to configs that list every layer's key and value bits, as
    :func:`rqlib.study.allocation.allocate` returns them (a partial list does not say the
    layer count).
    """
    keys = dict(c.layer_key_bits)
    values = dict(c.layer_value_bits)
    n_layers = len(keys)
    if not keys or set(keys) != set(range(n_layers)) or set(values) != set(keys):
        return None
    if any(bits is None for bits in values.values()):
        return None
    total = sum(keys.values()) + sum(values.values())
    uniform = max(1, total // (2 * n_layers))
    return c.replace(key_bits=uniform, value_bits=uniform, layer_key_bits=(), layer_value_bits=())


def _kv_swapped(c: CompressionConfig) -> CompressionConfig | None:
    if c.value_bits is None or c.key_bits == c.value_bits or c.is_prod:
        return None
    if any(bits is None for _, bits in c.layer_value_bits):
        return None
    return c.replace(
        key_bits=c.value_bits,
        value_bits=c.key_bits,
        layer_key_bits=c.layer_value_bits,
        layer_value_bits=c.layer_key_bits,
    )


def _rotation(kind: str) -> Callable[[CompressionConfig], CompressionConfig | None]:
    def apply(c: CompressionConfig) -> CompressionConfig | None:
        current = c.rotation or ("rotor" if c.method.startswith("rotorquant") else "dense")
        return None if current == kind else c.replace(rotation=kind)

    return apply


def _qjl(qjl_dim: int | None) -> Callable[[CompressionConfig], CompressionConfig | None]:
    """Keys through ``turboquant-prod`` at the same key bits: one MSE bit becomes QJL signs."""

    def apply(c: CompressionConfig) -> CompressionConfig | None:
        if c.is_prod or not c.method.startswith("turboquant"):
            return None
        return c.replace(
            method="turboquant-prod",
            qjl_sketch="orthogonal",
            norm_correction=False,
            qjl_dim=qjl_dim,
        )

    return apply


def _with_key_outliers(c: CompressionConfig) -> CompressionConfig | None:
    return None if c.key_outliers else c.replace(key_outliers=8)


def _fp16_norms(c: CompressionConfig) -> CompressionConfig | None:
    return None if c.norm_mantissa is None else c.replace(norm_mantissa=None)


def _with_key_scaling(c: CompressionConfig) -> CompressionConfig | None:
    return None if c.scale_keys else c.replace(scale_keys=True)


def _wider_window(c: CompressionConfig) -> CompressionConfig | None:
    return c.replace(recent_window=2 * c.recent_window) if c.recent_window else None


def _with_first_layer_exact(c: CompressionConfig) -> CompressionConfig | None:
    return None if c.exact_layers else c.replace(exact_layers=(0,))


LEVERS: dict[str, Lever] = {
    lever.name: lever
    for lever in (
        Lever("centering", "removed", "no per-head key centering", _without_centering),
        Lever("sink", "removed", "first token no longer exact", _without_sink),
        Lever("recent-window", "removed", "no recent band", _without_window),
        Lever(
            "band-codes",
            "removed",
            "recent band kept exact at 16 bits instead of 8-bit codes (same per-layer bits)",
            _exact_band,
        ),
        Lever(
            "norm-correction",
            "removed",
            "no norm correction: the shrinkage of the scores is left in",
            _without_norm_correction,
        ),
        Lever(
            "short-norms",
            "removed",
            "fp16 norms instead of 11-bit ones (same per-layer bits, more storage)",
            _fp16_norms,
        ),
        Lever(
            "allocation",
            "removed",
            "uniform bits (the allocation's mean, rounded down) instead of per-layer ones",
            _without_allocation,
        ),
        Lever("kv-asymmetry", "swapped", "key and value bits exchanged", _kv_swapped),
        Lever(
            "rot-hadamard", "swapped", "randomized Hadamard instead of dense", _rotation("hadamard")
        ),
        Lever("rot-rotor", "swapped", "3x3 rotor blocks instead of dense", _rotation("rotor")),
        Lever("qjl-m=d", "swapped", "keys: (b-1)-bit MSE + QJL, orthogonal S, m = d", _qjl(None)),
        Lever(
            "qjl-m=128", "swapped", "keys: (b-1)-bit MSE + QJL, orthogonal S, m = 128", _qjl(128)
        ),
        Lever("key-outliers", "added", "8 calibrated key channels at +1 bit", _with_key_outliers),
        Lever("layer0-exact", "added", "layer 0 kept exact", _with_first_layer_exact),
        Lever(
            "key-scaling",
            "added",
            "key channels weighted by (query / key energy)^1/4 (ks)",
            _with_key_scaling,
        ),
        Lever("window-x2", "swapped", "recent band twice as wide", _wider_window),
    )
}


def ablation_configs(
    preset: str, levers: list[str] | None = None, base: CompressionConfig | None = None
) -> list[tuple[Lever, CompressionConfig]]:
    """``(lever, changed config)`` for each applicable lever of ``levers`` (default: all).

    ``base`` is the preset's config; pass it resolved against the model when the preset has a
    bit budget (``alloc=``), so that every lever changes one thing and keeps the per-layer bits
    (a lever applied to the budget instead would need a new sensitivity table per lever).
    """
    if base is None:
        base = get_preset(preset)
    if base.budget is not None and levers != []:
        raise ValueError(
            f"resolve preset {preset!r} against its model first "
            "(rqlib.study.allocation.resolve): levers apply to its per-layer bits"
        )
    names = list(LEVERS) if levers is None else levers
    unknown = [name for name in names if name not in LEVERS]
    if unknown:
        raise ValueError(f"unknown levers {unknown}; known: {list(LEVERS)}")
    out = []
    for name in names:
        lever = LEVERS[name]
        changed = lever.apply(base)
        if changed is not None:
            out.append((lever, changed.replace(name=f"{preset}/{lever.change}:{lever.name}")))
    return out


def _row(result: dict, fp_perplexity: float, **fields: Any) -> dict:
    return {
        **fields,
        "label": result["label"],
        "spec": None if result["config"] is None else _spec(result["config"]),
        "bits_key": result["bits"]["key"],
        "bits_value": result["bits"]["value"],
        "bits_mean": result["bits"]["mean"],
        "bytes_per_token": result["bytes_per_token"],
        "perplexity": result["perplexity"],
        "delta_ppl_pct": 100 * (result["perplexity"] / fp_perplexity - 1),
        "kl": result["kl"],
        "top1": result["top1"],
        "n_scored": result["n_scored"],
    }


def _spec(config_dict: dict) -> str:
    return CompressionConfig.from_dict({**config_dict, "name": None}).spec()


def run_experiment(
    model_name: str,
    presets: list[str],
    *,
    levers: list[str] | dict[str, list[str]] | None = None,
    baselines: list[str] = (),
    corpus: str = "wikitext-2",
    tokens: int = 8192,
    window: int = 1024,
    context: int = 4096,
    json_path: Path | str | None = None,
    progress: bool = True,
    command: str | None = None,
) -> dict:
    """Evaluate presets, their lever ablations and baselines in one :func:`evaluate` call.

    ``levers`` are names from :data:`LEVERS` (``None``: all; ``[]``: presets only), or a dict
    preset -> names for different levers per preset (a preset missing from it gets none).
    Returns the JSON-ready payload and writes it to ``json_path`` if given.
    """
    if not presets and not baselines:
        raise ValueError("give at least one preset or baseline")
    started = time.time()
    model, tokenizer = load_model(model_name)
    plan: list[tuple[dict, CompressionConfig]] = []
    for preset in presets:
        resolved = resolve(get_preset(preset), model, tokenizer, context=context, progress=progress)
        plan.append(
            (
                {"role": "preset", "preset": preset, "lever": None, "change": None},
                resolved,
            )
        )
        chosen = levers.get(preset, []) if isinstance(levers, dict) else levers
        for lever, config in ablation_configs(preset, chosen, resolved):
            fields = {
                "role": "ablation",
                "preset": preset,
                "lever": lever.name,
                "change": lever.change,
                "description": lever.description,
            }
            plan.append((fields, config))
    for spec in baselines:
        fields = {"role": "baseline", "preset": None, "lever": None, "change": None}
        plan.append((fields, CompressionConfig.parse(spec)))
    labels = [config.label for _, config in plan]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate configs in the plan: {labels}")

    text = load_corpus(corpus)
    ids = tokenize_corpus(text, tokenizer, tokens)
    results = evaluate(
        model,
        ids,
        [config for _, config in plan],
        window=window,
        tokenizer=tokenizer,
        context=context,
        progress=progress,
    )
    dicts = [result.to_dict() for result in results]
    fp_perplexity = results[0].perplexity
    rows = [_row(dicts[0], fp_perplexity, role="fp", preset=None, lever=None, change=None)]
    for (fields, _), result in zip(plan, dicts[1:]):
        row = _row(result, fp_perplexity, **fields)
        if fields["role"] == "preset" and fields["preset"] in TARGETS:
            target = TARGETS[fields["preset"]]
            row["target"] = {
                "max_bits_mean": target.max_bits,
                "max_delta_ppl_pct": target.max_delta_ppl_pct,
                "max_kl": target.max_kl,
            }
            row["meets_target"] = bool(
                row["bits_mean"] <= target.max_bits
                and row["delta_ppl_pct"] <= target.max_delta_ppl_pct
                and (target.max_kl is None or row["kl"] <= target.max_kl)
            )
        rows.append(row)
    payload = {
        "kind": "ablation" if any(row["role"] == "ablation" for row in rows) else "presets",
        "command": command,
        "model": model_name,
        "geometry": model_geometry(model).to_dict(),
        "corpus": text.provenance(),
        "tokens": int(ids.numel()),
        "window": window,
        "context_for_bits": context,
        "calibration": {
            "corpus": "pydoc",
            "tokens": 2048,
            "used_for": "key means (ctr), outliers, channel scales; per-layer bits (alloc=) from "
            "a sensitivity table measured on the pydoc tokens after those",
        },
        "torch_threads": torch.get_num_threads(),
        "seconds": round(time.time() - started, 1),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(payload, indent=2) + "\n")
    return payload
