"""Per-layer bit allocation: spend the bits where the model is sensitive.

A uniform cache gives every layer's keys and values the same bits, but the layers do not suffer
equally. The **sensitivity** of an item (the keys, or the values, of one layer) at ``b`` bits is
the mean KL(full precision || compressed) of the next-token distribution when that item alone is
compressed at ``b`` bits and everything else is exact, measured on the calibration corpus
(``pydoc``, never the evaluation text) with the rest of the config as given: centering, sink,
recent band and so on.

For small perturbations the items' KLs add up (independent errors perturb the logits
independently, to first order), so choosing the bits is a multiple-choice knapsack::

    minimise  sum_i KL_i(b_i)   subject to   average_bits(config with b_i) <= budget

which :func:`allocate` solves exactly by dynamic programming over the integer number of stored
bits per vector. :func:`resolve` turns a config with a budget (spec token ``alloc=3.5``) into a
concrete one for a given model: the sensitivity table is read from the tables shipped with
rqlib (``rqlib/study/allocations/``, measured with the command below), from the user cache, or
measured on the spot and cached. A table is found by the signature of the weights it was
measured on (:mod:`rqlib.hf.weights`): the same model loaded in fp32, fp16 or bf16 finds it, a
model whose weights changed does not. A budget below the cheapest allocation is refused before
anything is measured (:func:`check_budget`).

::

    python -m rqlib allocate --model smollm2-135m --budget 3.5 3 2.5 \\
        --json rqlib/study/allocations/smollm2-135m.json --force

Without ``--base`` the table is measured for the presets of :mod:`rqlib.spec.presets` (their
storage format, bits aside), so that ``resolve`` finds it for them.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import torch

from rqlib.base.corpora import load_corpus, tokenize_corpus
from rqlib.base.files import CorruptFileError, atomic_write_text, file_lock, read_json
from rqlib.base.paths import cache_dir
from rqlib.hf.calibration import calibrate
from rqlib.hf.integration import attention_modules, calibration_tokenizer, output_projection
from rqlib.hf.models import load_model
from rqlib.hf.transform import fit_layer, group_widths
from rqlib.hf.weights import signature_digest, signatures_match, weight_signature
from rqlib.spec.bits import average_bits, codec_bits, coded_share
from rqlib.spec.config import CompressionConfig, get_preset
from rqlib.spec.geometry import model_geometry
from rqlib.spec.presets import PRESETS
from rqlib.study.eval import evaluate

__all__ = [
    "KINDS",
    "Sensitivity",
    "allocate",
    "check_budget",
    "find_sensitivity",
    "measure_sensitivity",
    "refingerprint_table",
    "shipped_sensitivity",
    "resolve",
    "resolve_transforms",
    "with_budget",
]

KINDS = ("key", "value")
#: Bits tried per item; values may go lower than keys (their errors are averaged by attention).
KEY_BITS = (2, 3, 4, 5)
VALUE_BITS = (1, 2, 3, 4)
#: Key bits used while measuring a value item: D(8 bits) ~ 4e-5, negligible next to the values'.
NEAR_EXACT_KEY_BITS = 8
SHIPPED = Path(__file__).resolve().parent / "allocations"


@dataclass(frozen=True)
class Sensitivity:
    """``kl[(kind, layer, bits)]``: mean KL with only that item compressed at ``bits``.

    ``base`` is the spec the items were compressed with (its per-layer bits ignored),
    ``fingerprint`` identifies the model's weights in any dtype
    (:func:`rqlib.hf.weights.weight_signature`), ``corpus`` is the provenance of the measuring
    text, ``tokens``/``offset`` which of its tokens were used.
    """

    base: str
    fingerprint: dict
    n_layers: int
    corpus: dict
    tokens: int
    offset: int
    kl: dict

    def options(self, kind: str, layer: int) -> dict[int, float]:
        """``{bits: KL}`` of one item."""
        return {b: v for (k, lay, b), v in self.kl.items() if k == kind and lay == layer}

    def predicted_kl(self, config: CompressionConfig) -> float:
        """The knapsack's objective for ``config``'s per-layer bits: the summed item KLs.

        ``KeyError`` if a layer's bits were not measured (e.g. 8-bit keys).
        """
        return sum(
            self.kl[("key", layer, config.key_bits_of(layer))]
            + self.kl[("value", layer, config.value_bits_of(layer))]
            for layer in range(self.n_layers)
        )

    def to_dict(self) -> dict:
        rows = [
            {"kind": kind, "layer": layer, "bits": bits, "kl": value}
            for (kind, layer, bits), value in sorted(self.kl.items())
        ]
        return {
            "base": self.base,
            "fingerprint": self.fingerprint,
            "n_layers": self.n_layers,
            "corpus": self.corpus,
            "tokens": self.tokens,
            "offset": self.offset,
            "rows": rows,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Sensitivity:
        """Read :meth:`to_dict` output; ``ValueError`` naming what is missing or malformed."""
        try:
            kl = {
                (r["kind"], int(r["layer"]), int(r["bits"])): float(r["kl"]) for r in data["rows"]
            }
            return cls(
                data["base"],
                data["fingerprint"],
                int(data["n_layers"]),
                data["corpus"],
                int(data["tokens"]),
                int(data["offset"]),
                kl,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a sensitivity table ({type(error).__name__}: {error})") from None

    @classmethod
    def read(cls, path: Path) -> Sensitivity:
        """The table in ``path``; :class:`rqlib.base.files.CorruptFileError` naming the file if
        it is truncated or not a table."""
        data = read_json(path)
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise CorruptFileError(path, str(error)) from None


def _uniform(config: CompressionConfig) -> CompressionConfig:
    """``config`` with its bits reset to a uniform 3/3 and no budget: what the costs use."""
    if config.exact_layers:
        raise ValueError("alloc= chooses every layer's bits; it cannot be combined with exact=")
    return config.replace(
        key_bits=3,
        value_bits=3,
        layer_key_bits=(),
        layer_value_bits=(),
        budget=None,
        name=None,
    )


# a recent band stored with at least this many bits per coordinate reads as exact for a table
NEAR_EXACT_BAND_BITS = 8


def _base_of(config: CompressionConfig) -> CompressionConfig:
    """What a sensitivity table is measured for (its identity): :func:`_uniform` of ``config``
    with fp16 norms and an exact recent band, stored twice. Three formats are left out on
    purpose, as too fine to move a table:

    - rounding the norms to ``nm`` >= 6 mantissa bits moves a vector by at most 2^-7 of its
      norm, far below the quantization error even at 5 bits (``tests/test_quantizers.py``
      checks the bound);
    - a band of codes of at least :data:`NEAR_EXACT_BAND_BITS` bits (``wb=8``) reconstructs a
      vector to under 1 % of its norm, while a 6-bit band does not (``tests/test_allocation.py``
      checks both on fresh Gaussian vectors); re-measured items of a table move by far less
      than the differences between bit widths that the allocation chooses from;
    - the band stored once (``once``) changes what a band token costs, not what attention
      reads: a token's main codes are coded from the band's copy of it, which is the token
      itself for an exact band, and within the error above for ``wb=8``.

    The trellis code (``tcq``, read tail-biting or not) is left out for another reason: the
    layers are ranked by their sensitivity under the Lloyd-Max code, whose table exists, instead
    of measuring a table with the much slower trellis encoder; the trellis then lowers the error
    at each chosen width (chapter 6 measures by how much), so the ranking is an approximation,
    stated as such.
    """
    base = _uniform(config).replace(
        norm_mantissa=None, trellis_state_bits=None, trellis_tail_biting=False, band_once=False
    )
    if base.band_bits is not None and base.band_bits >= NEAR_EXACT_BAND_BITS:
        base = base.replace(band_bits=None)
    return base


def measure_sensitivity(
    model: torch.nn.Module,
    tokenizer,
    config: CompressionConfig,
    *,
    key_bits: tuple[int, ...] = KEY_BITS,
    value_bits: tuple[int, ...] = VALUE_BITS,
    tokens: int = 1024,
    offset: int | None = None,
    layers: tuple[int, ...] | None = None,
    progress: bool = True,
) -> Sensitivity:
    """Measure every item's KL at every bit width on ``config.calibration_corpus``.

    The text is ``tokens`` tokens starting at ``offset`` (default: just after the tokens the
    calibration statistics use), one window. Costs ``n_layers * (len(key_bits) +
    len(value_bits))`` forward passes with one layer compressed; ``layers`` restricts the
    measurement to some layers (a partial table, for spot checks).
    """
    base = _base_of(config)
    if base.is_prod:
        raise ValueError("allocation is implemented for the -mse methods")
    if offset is None:
        offset = base.calibration_tokens
    n_layers = model_geometry(model).layers
    corpus = load_corpus(base.calibration_corpus)
    ids = tokenize_corpus(corpus, tokenizer, offset + tokens)[offset:]
    if ids.numel() < tokens:
        raise ValueError(
            f"{base.calibration_corpus} has only {ids.numel() + offset} tokens; "
            f"need offset {offset} + {tokens}"
        )
    plan = []
    for layer in range(n_layers) if layers is None else layers:
        others = tuple(i for i in range(n_layers) if i != layer)
        for bits in key_bits:
            plan.append(
                (
                    ("key", layer, bits),
                    base.replace(key_bits=bits, value_bits=None, exact_layers=others),
                )
            )
        for bits in value_bits:
            plan.append(
                (
                    ("value", layer, bits),
                    base.replace(
                        key_bits=NEAR_EXACT_KEY_BITS, value_bits=bits, exact_layers=others
                    ),
                )
            )
    results = evaluate(
        model,
        ids,
        [c for _, c in plan],
        window=tokens,
        tokenizer=tokenizer,
        progress=progress,
    )
    kl = {item: result.kl for (item, _), result in zip(plan, results[1:])}
    return Sensitivity(
        base.spec(),
        weight_signature(model),
        n_layers,
        corpus.provenance(),
        int(ids.numel()),
        offset,
        kl,
    )


def allocate(
    sensitivity: Sensitivity, config: CompressionConfig, model_config, context: int = 4096
) -> CompressionConfig:
    """Per-layer key and value bits minimising the summed KL within ``config.budget``.

    Returns ``config`` with ``layer_key_bits``/``layer_value_bits`` listing every layer (so the
    resolved config says each layer's bits on its own; ``key_bits``/``value_bits`` are set to
    the most common choice) and ``budget`` cleared; ``ValueError`` if even the cheapest choice
    exceeds the budget.
    """
    if config.budget is None:
        raise ValueError("config has no budget (spec token alloc=BITS)")
    base = _uniform(config)  # costs: this config's storage format, norms included
    geometry = model_geometry(model_config)
    n_layers, head_dim = geometry.layers, geometry.head_dim
    if n_layers != sensitivity.n_layers:
        raise ValueError(
            f"the sensitivity table is for {sensitivity.n_layers} layers, the model has {n_layers}"
        )
    items = [(kind, layer) for layer in range(n_layers) for kind in KINDS]
    # cost of a choice: stored bits per vector (an integer), exactly as average_bits counts it
    choices = []
    for kind, layer in items:
        method, outliers = (
            (base.method, base.key_outliers)
            if kind == "key"
            else (base.value_method, base.value_outliers)
        )
        options = sensitivity.options(kind, layer)
        if not options:
            raise ValueError(f"the sensitivity table has no entries for the {kind}s of {layer}")
        choices.append(
            [
                (round(codec_bits(base, method, bits, head_dim, outliers) * head_dim), kl, bits)
                for bits, kl in sorted(options.items())
            ]
        )
    # the budget in summed bits per vector: what is left once the bits-independent overhead
    # (exact tokens, means, ...) is paid; measured on a uniform config, then made exact below
    uniform = base.replace(
        key_bits=min(c[2] for c in choices[0]), value_bits=min(c[2] for c in choices[1])
    )
    uniform_cost = sum(min(c[0] for c in options) for options in choices)
    coded = coded_share(base, context)  # the share of tokens that pay for the codes
    overhead = average_bits(uniform, model_config, context)["mean"] - coded * uniform_cost / (
        2 * n_layers * head_dim
    )
    capacity = math.floor((config.budget - overhead) / coded * 2 * n_layers * head_dim + 1e-6)
    unit = reduce(math.gcd, [c[0] for options in choices for c in options])
    capacity //= unit
    if capacity < uniform_cost // unit:
        raise ValueError(
            f"budget {config.budget} bits is below the cheapest allocation "
            f"({average_bits(uniform, model_config, context)['mean']:.3f} bits)"
        )
    best = _knapsack(
        [[(cost // unit, kl, bits) for cost, kl, bits in o] for o in choices], capacity
    )
    layer_keys = tuple((layer, best[2 * layer]) for layer in range(n_layers))
    layer_values = tuple((layer, best[2 * layer + 1]) for layer in range(n_layers))
    common_key = max(set(best[0::2]), key=best[0::2].count)
    common_value = max(set(best[1::2]), key=best[1::2].count)
    resolved = config.replace(
        key_bits=common_key,
        value_bits=common_value,
        layer_key_bits=layer_keys,
        layer_value_bits=layer_values,
        budget=None,
    )
    spent = average_bits(resolved, model_config, context)["mean"]
    if spent > config.budget + 1e-9:
        raise AssertionError(f"allocation spends {spent} > budget {config.budget}")
    return resolved


def _knapsack(choices: list[list[tuple[int, float, int]]], capacity: int) -> list[int]:
    """Exact multiple-choice knapsack: one ``(cost, value, label)`` per group, min total value.

    ``table[c]`` is the least total KL of the groups so far at total cost exactly ``c``.
    """
    inf = float("inf")
    table = torch.full((capacity + 1,), inf, dtype=torch.float64)
    table[0] = 0.0
    picks = []
    for options in choices:
        new = torch.full_like(table, inf)
        pick = torch.full((capacity + 1,), -1, dtype=torch.long)
        for index, (cost, value, _) in enumerate(options):
            if cost > capacity:
                continue
            candidate = torch.full_like(table, inf)
            candidate[cost:] = table[: capacity + 1 - cost] + value
            better = candidate < new
            new = torch.where(better, candidate, new)
            pick = torch.where(better, torch.tensor(index), pick)
        table = new
        picks.append(pick)
    if not torch.isfinite(table).any():
        raise ValueError("no allocation fits the budget")
    total = int(torch.argmin(table))
    labels = []
    for options, pick in zip(reversed(choices), reversed(picks)):
        index = int(pick[total])
        labels.append(options[index][2])
        total -= options[index][0]
    return labels[::-1]


def check_budget(config: CompressionConfig, model_config, context: int = 4096) -> None:
    """Refuse a budget below the cheapest allocation (every layer at the fewest bits a table
    offers) for this model, before anything is measured; ``ValueError`` saying both numbers."""
    if config.budget is None:
        return
    cheapest = _uniform(config).replace(key_bits=min(KEY_BITS), value_bits=min(VALUE_BITS))
    floor = average_bits(cheapest, model_config, context)["mean"]
    if config.budget < floor:
        raise ValueError(
            f"{config.label}: budget {config.budget:g} bits is below the cheapest allocation for "
            f"this model ({floor:.3f} bits: keys at {min(KEY_BITS)} and values at "
            f"{min(VALUE_BITS)} bits in every layer, at a context of {context} tokens)"
        )


def _cache_folder() -> Path:
    return cache_dir() / "allocations"


def _cache_stem(signature: dict, base: CompressionConfig) -> str:
    """The file-name stem of the cached tables for a model geometry and base config."""
    spec_hash = hashlib.sha256(base.spec().encode()).hexdigest()[:12]
    return f"sensitivity-{signature_digest(signature)}-{spec_hash}"


def _cached_path(signature: dict, base: CompressionConfig) -> Path:
    """Where a measured table for these weights and base lives in the user cache."""
    weights = json.dumps(signature["tensors"], sort_keys=True).encode()
    return _cache_folder() / (
        f"{_cache_stem(signature, base)}-{hashlib.sha256(weights).hexdigest()[:12]}.json"
    )


def _read_cached(path: Path) -> Sensitivity | None:
    """A cached table, or None after reporting (and removing) a corrupt one: it is a cache, so
    it is measured again."""
    try:
        return Sensitivity.read(path)
    except CorruptFileError as error:
        print(f"rqlib.study.allocation: {error}; removing it (measured again)", file=sys.stderr)
        path.unlink(missing_ok=True)
        return None


def find_sensitivity(model: torch.nn.Module, config: CompressionConfig) -> Sensitivity | None:
    """The stored table for this model's weights (in any dtype) and base config: shipped with
    rqlib, else in the user cache; None when there is none.

    A shipped table that does not parse raises :class:`rqlib.base.files.CorruptFileError`
    naming it; a corrupt cached table is reported on stderr, removed and ignored.
    """
    signature = weight_signature(model)
    base = _base_of(config).spec()
    shipped = sorted(SHIPPED.glob("*.json")) if SHIPPED.is_dir() else []
    cached = sorted(_cache_folder().glob(f"{_cache_stem(signature, _base_of(config))}-*.json"))
    for path in shipped + cached:
        table = Sensitivity.read(path) if path in shipped else _read_cached(path)
        if (
            table is not None
            and table.base == base
            and signatures_match(table.fingerprint, signature)
        ):
            return table
    return None


def shipped_sensitivity(model_name: str, config: CompressionConfig) -> Sensitivity:
    """The table shipped with rqlib for packaged model ``model_name`` (a name of
    ``rqlib.hf.models``) and ``config``'s storage format: the table :func:`resolve` allocates
    ``config`` from on that model, read without loading the model. ``FileNotFoundError`` names
    the folder, the model and the format when none ships."""
    base = _base_of(config).spec()
    for path in sorted(SHIPPED.glob("*.json")):
        data = read_json(path)
        if data.get("model") == model_name and data.get("base") == base:
            return Sensitivity.read(path)
    raise FileNotFoundError(
        f"no sensitivity table in {SHIPPED} is for {model_name} and the format {base}"
    )


def resolve(
    config: CompressionConfig | str,
    model: torch.nn.Module,
    tokenizer,
    *,
    context: int = 4096,
    progress: bool = True,
) -> CompressionConfig:
    """``config`` (or a spec string) with its budget turned into per-layer bits for ``model``,
    and the group widths of its calibrated transforms (``kxf``, ``vxf``) chosen for it
    (:func:`resolve_transforms`); a config with neither is returned
    unchanged.

    An impossible budget is refused first (:func:`check_budget`). The sensitivity table is
    looked up with :func:`find_sensitivity`; if there is none it is measured (announced on
    stderr: it costs a few hundred forward passes) and cached, under a lock so that two
    processes do not both measure it, written atomically so that none reads half of it.
    """
    if isinstance(config, str):
        config = CompressionConfig.parse(config)
    if config.budget is None:
        return resolve_transforms(config, model, tokenizer)
    check_budget(config, model.config, context)
    sensitivity = find_sensitivity(model, config)
    if sensitivity is None:
        base = _base_of(config)
        signature = weight_signature(model)
        with file_lock(_cache_folder() / f".{_cache_stem(signature, base)}.lock"):
            sensitivity = find_sensitivity(model, config)  # another process may have measured
            if sensitivity is None:
                n_layers = model_geometry(model).layers
                passes = n_layers * (len(KEY_BITS) + len(VALUE_BITS))
                print(
                    f"rqlib.study.allocation: no sensitivity table for this model and "
                    f"{base.spec()}; measuring it on {config.calibration_corpus} ({passes} "
                    "forward passes, cached)",
                    file=sys.stderr,
                )
                sensitivity = measure_sensitivity(model, tokenizer, config, progress=progress)
                atomic_write_text(
                    _cached_path(signature, base), json.dumps(sensitivity.to_dict(), indent=1)
                )
    resolved = allocate(sensitivity, config, model.config, context)
    return resolved.replace(name=config.name)


def refingerprint_table(path: Path | str, model: torch.nn.Module) -> Path:
    """Replace the fingerprint of the table in ``path`` by ``model``'s weight signature (when
    the fingerprint scheme changes; the measurements are kept). The caller vouches that the
    table was measured on this model; its layer count is checked. Written atomically."""
    path = Path(path)
    data = read_json(path)
    table = Sensitivity.from_dict(data)
    if table.n_layers != model_geometry(model).layers:
        raise ValueError(
            f"{path} is for {table.n_layers} layers, the model has {model_geometry(model).layers}"
        )
    data["fingerprint"] = weight_signature(model)
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    return path


def with_budget(base: CompressionConfig, budget: float) -> CompressionConfig:
    """``base``'s storage format with a bit budget (its bits reset to the uniform start)."""
    return _uniform(base).replace(budget=budget)


def presets_base() -> CompressionConfig:
    """The storage format the presets' sensitivity tables are measured for (bits aside)."""
    return _uniform(get_preset(next(iter(PRESETS))))


def measure_table(
    model_name: str,
    base: CompressionConfig | None = None,
    *,
    tokens: int = 1024,
    command: str | None = None,
    progress: bool = True,
    loaded: tuple | None = None,
) -> tuple[Sensitivity, dict]:
    """Measure ``model_name``'s sensitivity table for ``base`` (default: the presets' format).

    ``loaded`` is ``(model, tokenizer)`` when the caller has loaded ``model_name`` already.
    Returns the table and its JSON payload (the table, the model, the command and the time).
    """
    started = time.time()
    model, tokenizer = load_model(model_name) if loaded is None else loaded
    base = presets_base() if base is None else base
    sensitivity = measure_sensitivity(model, tokenizer, base, tokens=tokens, progress=progress)
    payload = sensitivity.to_dict()
    payload["model"] = model_name
    payload["command"] = command
    payload["seconds"] = round(time.time() - started, 1)
    return sensitivity, payload


def resolve_transforms(config, model, tokenizer):
    """``config`` with the group widths of its transforms (``kxf``, ``vxf``) chosen for
    ``model``, from a calibration on ``config.calibration_corpus`` with ``tokenizer`` (default:
    the model's own); unchanged without them, or when every layer has its widths already."""
    if not (config.transform_keys or config.transform_values):
        return config
    modules = attention_modules(model)
    exact = config.exact_layer_set(len(modules))
    keys, values = dict(config.key_group_bits), dict(config.value_group_bits)
    layers = [i for i in range(len(modules)) if i not in exact]
    missing_keys = config.transform_keys and any(i not in keys for i in layers)
    missing_values = config.transform_values and any(
        i not in values for i in layers if config.value_bits_of(i) is not None
    )
    if not (missing_keys or missing_values):
        return config
    tokenizer = calibration_tokenizer(model, tokenizer)
    calibration = calibrate(
        model,
        tokenizer,
        config.calibration_corpus,
        config.calibration_tokens,
        config.calibration_chunk,
    )
    for layer in layers:
        if config.transform_keys and layer not in keys:
            spectrum = fit_layer(calibration, layer, "keys").spectrum
            keys[layer] = group_widths(spectrum, config.key_bits_of(layer))
        value_bits = config.value_bits_of(layer)
        if config.transform_values and value_bits is not None and layer not in values:
            weight = output_projection(modules[layer]).weight
            spectrum = fit_layer(calibration, layer, "values", weight).spectrum
            values[layer] = group_widths(spectrum, value_bits)
    return config.replace(
        key_group_bits=tuple(sorted(keys.items())),
        value_group_bits=tuple(sorted(values.items())),
        name=config.name,
    )
