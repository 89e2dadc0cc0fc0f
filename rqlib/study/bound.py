"""How far the codes are from the rate-distortion bound of attention, per layer and head.

For every KV head of the chosen layers:

1. **Calibration** (``pydoc``, never the evaluation text): the queries, keys and values the
   model produces (:func:`capture`). From them, the *metric* of each error: for keys the
   queries' second moment ``E[q q^T]`` over the query heads of the group (the mean square
   score error of a key error ``e`` is ``e^T M e``); for values ``sum_h W_h^T W_h`` over the
   ``o_proj`` slices of the group (what a value error adds to the residual stream). The
   *weighted spectrum* is that of ``M^(1/2) Cov M^(1/2)`` (:func:`rqlib.core.ratedistortion.
   fit_transform`), and the Shannon bound at each rate is its reverse water-filling.
2. **Held-out text** (the evaluation corpus from a start token): every code encodes and
   decodes the keys and values there, and the study measures the relative weighted error,
   ``sum_n e_n^T M e_n / sum_n (x_n - mean)^T M (x_n - mean)`` with the held-out metric, and, for
   keys, the KL divergence of each query's attention distribution (causal, the model's own
   scaling, values untouched).

The codes, each at ``bits`` code bits a coordinate plus a 16-bit gain (or norm) per vector:

- ``rotation+lloyd-max``: today's code as the cache runs it, TurboQuant (a random rotation
  and the Lloyd-Max code of a rotated coordinate), keys centred with the calibrated mean
  (``ctr``), the least-squares norm (``nc``);
- ``rotation+trellis``: the same, the coordinates coded by a bitshift trellis instead
  (:mod:`rqlib.core.trellis`, the cache's ``tcq``): the granular gain alone;
- ``transform+lloyd-max``: the calibrated transform code (:class:`rqlib.core.ratedistortion.
  TransformCode`), bits per group of 16 components by water-filling;
- ``transform+trellis``: the transform code with each run of equal-bit components coded by the
  trellis.

The calibrated codes also store their transform once per head (``side_bits``), which
:func:`side_bits_per_coordinate` spreads over a context.

:func:`model_effect` then runs the whole model with every layer's keys and values passed
through a code (encoded and decoded, the first token of each window kept exact as ``sink1``
does) and measures the KL divergence and the perplexity change on held-out windows: what the
codes do to the model, before any of them is a stored format of the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rqlib.base.corpora import load_corpus, tokenize_corpus
from rqlib.core.quantizers import make_quantizer
from rqlib.core.ratedistortion import (
    GAIN_BITS,
    TransformCode,
    fit_transform,
    gaussian_code,
    reverse_water_filling,
)
from rqlib.core.trellis import BitshiftTrellis
from rqlib.hf.capture import capture_attention
from rqlib.hf.codec import ChannelPart, VectorCodec
from rqlib.study.eval import windows

__all__ = [
    "CODES",
    "Capture",
    "HeadData",
    "capture",
    "head_frames",
    "measure_head",
    "measure_model",
    "model_effect",
    "side_bits_per_coordinate",
]

CODES = ("rotation+lloyd-max", "rotation+trellis", "transform+lloyd-max", "transform+trellis")
#: Components per group of one bit width in the transform codes.
GROUP_SIZE = 16
CHUNK = 1024


@dataclass(frozen=True)
class HeadData:
    """One KV head's vectors: ``queries`` ``[G, N, d]`` (its query heads), ``keys`` and
    ``values`` ``[N, d]``, ``output`` the ``o_proj`` slices ``[G, hidden, d]``, ``scaling`` the
    model's score scaling, ``chunk_lengths`` the causal windows the tokens came in."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    output: torch.Tensor
    scaling: float
    chunk_lengths: tuple[int, ...] = ()

    def metric(self, kind: str) -> torch.Tensor:
        """``[d, d]``: the weight of an error of a key (``"keys"``) or a value (``"values"``)."""
        if kind == "keys":
            q = self.queries.double()
            return torch.einsum("gnd,gne->de", q, q) / (q.shape[0] * q.shape[1])
        w = self.output.double()
        return torch.einsum("ghd,ghe->de", w, w)

    def vectors(self, kind: str) -> torch.Tensor:
        return (self.keys if kind == "keys" else self.values).double()


@dataclass(frozen=True)
class Capture:
    """What :func:`capture` recorded: ``heads[layer]`` (one :class:`HeadData` per KV head) for
    tokens ``start .. start + tokens`` of ``corpus``; ``capture[layer]`` reads ``heads``."""

    corpus: str
    start: int
    tokens: int
    heads: dict[int, list[HeadData]]

    def __getitem__(self, layer: int) -> list[HeadData]:
        return self.heads[layer]

    @property
    def layers(self) -> list[int]:
        return sorted(self.heads)


def _chosen_layers(calibration: Capture, layers: list[int] | None, eval_corpus: str) -> list:
    """``layers`` (default: the calibrated ones), refused unless calibrated, and unless the
    calibration corpus differs from ``eval_corpus``."""
    if calibration.corpus == eval_corpus:
        raise ValueError(
            f"calibration and evaluation use the same corpus {eval_corpus!r}: the codes would be "
            "fitted on the text they are judged on"
        )
    layers = calibration.layers if layers is None else list(layers)
    missing = sorted(set(layers) - set(calibration.layers))
    if missing or not layers:
        raise ValueError(f"layers {missing or layers} have no calibration")
    return layers


def capture(
    model, tokenizer, corpus_name: str, n_tokens: int, layers: list[int], start: int = 0
) -> Capture:
    """Run ``model`` (uncompressed) over tokens ``start .. start + n_tokens`` of the corpus in
    chunks of 1024, and return each chosen layer's KV heads. The first token of each chunk is
    left out (it is an attention sink with atypical keys, as in :mod:`rqlib.hf.calibration`);
    a chunk is one causal window, so held-out attention reads only its own chunk."""
    ids = tokenize_corpus(load_corpus(corpus_name), tokenizer, start + n_tokens)[start:]
    collected: dict[int, list] = {layer: [] for layer in layers}
    scaling = {}
    device = next(model.parameters()).device
    with torch.no_grad(), capture_attention(model, layers=layers) as captured:
        for begin in range(0, len(ids), CHUNK):
            chunk = ids[begin : begin + CHUNK]
            if len(chunk) < 2:
                break
            captured.calls.clear()
            model(chunk[None].to(device))
            for layer in layers:
                call = captured.calls[layer][-1]
                collected[layer].append((call.query[0], call.key[0], call.value[0]))
                scaling[layer] = call.scaling
    from rqlib.hf.integration import attention_modules

    modules = attention_modules(model)
    heads: dict[int, list[HeadData]] = {}
    for layer in layers:
        chunks = collected[layer]  # (query [H, S, d], key [KV, S, d], value [KV, S, d])
        kv_heads, _, d = chunks[0][1].shape
        group = chunks[0][0].shape[0] // kv_heads
        weight = modules[layer].o_proj.weight.detach().float().cpu()  # [hidden, H * d]
        weight = weight.reshape(weight.shape[0], -1, d).permute(1, 0, 2)  # [H, hidden, d]
        scale = scaling[layer] if scaling[layer] is not None else 1 / math.sqrt(d)
        heads[layer] = [
            HeadData(
                queries=torch.cat([q[g * group : (g + 1) * group, 1:] for q, _, _ in chunks], 1),
                keys=torch.cat([k[g, 1:] for _, k, _ in chunks]),
                values=torch.cat([v[g, 1:] for _, _, v in chunks]),
                output=weight[g * group : (g + 1) * group],
                scaling=float(scale),
                chunk_lengths=tuple(k.shape[1] - 1 for _, k, _ in chunks),
            )
            for g in range(kv_heads)
        ]
    return Capture(corpus_name, start, n_tokens, heads)


def side_bits_per_coordinate(code: TransformCode, context: int) -> float:
    """The transform's stored constants spread over ``context`` tokens, per coordinate."""
    return code.side_bits / (context * code.dim)


def _weighted_error(x, x_hat, mean, metric) -> float:
    e = x - x_hat
    c = x - mean
    return float(
        torch.einsum("nd,de,ne->", e, metric, e) / torch.einsum("nd,de,ne->", c, metric, c)
    )


def _rotation_code(x, mean, bits: int, draw: int, trellis: BitshiftTrellis | None):
    """Today's code as the cache runs it, on ``x`` ``[N, d]``: TurboQuant MSE after subtracting
    ``mean`` (``ctr``), with the least-squares norm (``nc``), through the cache's own codec; with
    a ``trellis``, its state bits code the rotated coordinates (``tcq``)."""
    d = x.shape[-1]
    state_bits = None if trellis is None else trellis.state_bits
    quantizer = make_quantizer("turboquant-mse", d, bits, draw=draw, trellis_state_bits=state_bits)
    codec = VectorCodec(
        [ChannelPart(quantizer, None)], d, mean=mean.float()[None], norm_correction=True
    )
    return codec.decode(codec.encode(x.float()[None, None]))[0, 0].double()


def _attention_kl(head: HeadData, keys_hat: torch.Tensor) -> float:
    """Mean KL(p || p_hat) of the held-out queries' causal attention, per chunk."""
    total, count, begin = 0.0, 0, 0
    for length in head.chunk_lengths:
        q = head.queries[:, begin : begin + length].double()
        k = head.keys[begin : begin + length].double()
        k_hat = keys_hat[begin : begin + length]
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        logits = torch.where(mask, q @ k.T * head.scaling, -torch.inf).log_softmax(-1)
        approx = torch.where(mask, q @ k_hat.T * head.scaling, -torch.inf).log_softmax(-1)
        kl = torch.where(mask, logits.exp() * (logits - approx), 0.0).sum(-1)
        total += float(kl.sum())
        count += kl.numel()
        begin += length
    return total / count


def measure_head(
    calibration: HeadData,
    held_out: HeadData,
    kind: str,
    bits: list[int],
    rates: list[float],
    trellis: BitshiftTrellis,
    draw: int = 0,
) -> dict:
    """Spectrum, bounds and the measured codes of one KV head's ``kind`` (keys or values).

    Returns plain lists and floats (JSON-ready): ``spectrum`` (the calibrated weighted spectrum,
    normalised to sum 1), ``shannon`` (water-filling relative distortion at ``rates``),
    ``lloyd_max_model`` (today's code as the spectrum predicts it: the Lloyd-Max distortion of a
    rotated coordinate times ``tr(M) tr(C) / (d tr(M C))``), and per code the measured relative
    weighted error at each of ``bits`` (and for keys the attention KL)."""
    x_cal = calibration.vectors(kind)
    metric_cal = calibration.metric(kind)
    centered = x_cal - x_cal.mean(0)
    covariance = centered.T @ centered / x_cal.shape[0]
    _, _, spectrum = fit_transform(covariance, metric_cal)
    isotropy = float(
        torch.trace(metric_cal) * torch.trace(covariance) / (x_cal.shape[1] * spectrum.sum())
    )
    out = {
        "spectrum": (spectrum / spectrum.sum()).tolist(),
        "shannon": [reverse_water_filling(spectrum, r).relative_distortion for r in rates],
        "lloyd_max_model": [gaussian_code(b)[2] * isotropy for b in bits],
        "codes": {},
    }
    x = held_out.vectors(kind)
    metric = held_out.metric(kind)
    held_mean = x.mean(0)
    mean = x_cal.mean(0) if kind == "keys" else torch.zeros_like(held_mean)
    for name in CODES:
        errors, kls, side = [], [], None
        for b in bits:
            if name.startswith("rotation"):
                use = trellis if name.endswith("trellis") else None
                x_hat = _rotation_code(x, mean, b, draw, use)
            else:
                quantizer = trellis if name.endswith("trellis") else "lloyd-max"
                code = TransformCode.fit(x_cal, metric_cal, b, GROUP_SIZE, quantizer)
                x_hat = code.roundtrip(x)
                side = code.side_bits
            errors.append(_weighted_error(x, x_hat, held_mean, metric))
            if kind == "keys":
                kls.append(_attention_kl(held_out, x_hat))
        entry = {"relative_error": errors, "gain_bits": GAIN_BITS, "side_bits": side}
        if kind == "keys":
            entry["attention_kl"] = kls
        out["codes"][name] = entry
    return out


def measure_model(
    model,
    tokenizer,
    calibration: Capture,
    *,
    bits: list[int],
    rates: list[float],
    layers: list[int] | None = None,
    eval_corpus: str = "wikitext-2",
    eval_start: int = 100_000,
    eval_tokens: int = 1024,
    state_bits: int = 10,
    draw: int = 0,
    progress: bool = True,
) -> list[dict]:
    """:func:`measure_head` for the keys and values of every KV head of ``layers`` (default:
    those of ``calibration``, a :func:`capture` on another corpus than ``eval_corpus``): one
    record per (layer, head, kind), with ``layer``, ``head`` and ``kind`` added."""
    from tqdm.auto import tqdm

    layers = _chosen_layers(calibration, layers, eval_corpus)
    held_out = capture(model, tokenizer, eval_corpus, eval_tokens, layers, start=eval_start)
    trellis = BitshiftTrellis(state_bits=state_bits, draw=draw)
    jobs = [
        (layer, head, kind)
        for layer in layers
        for head in range(len(calibration[layer]))
        for kind in ("keys", "values")
    ]
    records = []
    for layer, head, kind in tqdm(jobs, desc="rate-distortion", unit="head", disable=not progress):
        result = measure_head(
            calibration[layer][head], held_out[layer][head], kind, bits, rates, trellis, draw
        )
        records.append({"layer": layer, "head": head, "kind": kind, **result})
    return records


# ---- the whole model -------------------------------------------------------------------------
#: The registered attention function that passes keys and values through codes, then runs sdpa.
ROUNDTRIP_NAME = "rqlib-roundtrip"
_ROUNDTRIPS: list[dict] = []  # the active {layer: (key codes per head, value codes per head)}


def _through(codes, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, KV, S, d]`` with tokens ``1..S-1`` of each KV head through its code."""
    if codes is None or x.shape[-2] < 2:
        return x
    out = x.clone()
    for head, code in enumerate(codes):  # the codes compute on the CPU, in float64
        rows = x[:, head, 1:].reshape(-1, x.shape[-1]).cpu()
        decoded = code(rows).reshape(x.shape[0], -1, x.shape[-1])
        out[:, head, 1:] = decoded.to(device=x.device, dtype=x.dtype)
    return out


def _roundtrip_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _ROUNDTRIPS:
        raise RuntimeError(f"attention {ROUNDTRIP_NAME!r} was called outside model_effect()")
    key_codes, value_codes = _ROUNDTRIPS[-1].get(module.layer_idx, (None, None))
    key, value = _through(key_codes, key), _through(value_codes, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _code_functions(name: str, bits: int, calibration: HeadData, kind: str, trellis, draw: int):
    """The encode-and-decode function of one code for one head, fitted on ``calibration``."""
    x_cal = calibration.vectors(kind)
    if name.startswith("rotation"):
        mean = x_cal.mean(0) if kind == "keys" else torch.zeros(x_cal.shape[-1])
        use = trellis if name.endswith("trellis") else None
        return lambda x: _rotation_code(x.double(), mean, bits, draw, use)
    quantizer = trellis if name.endswith("trellis") else "lloyd-max"
    code = TransformCode.fit(x_cal, calibration.metric(kind), bits, GROUP_SIZE, quantizer)
    return code.roundtrip


def model_effect(
    model,
    tokenizer,
    calibration: Capture,
    codes: list[str],
    bits: list[int],
    *,
    kinds: tuple[str, ...] = ("keys", "values"),
    layers: list[int] | None = None,
    eval_corpus: str = "wikitext-2",
    eval_start: int = 100_000,
    eval_tokens: int = 2048,
    window: int = 1024,
    state_bits: int = 10,
    draw: int = 0,
    progress: bool = True,
) -> list[dict]:
    """KL divergence and perplexity change of the model with ``kinds`` of ``layers`` (default
    all) through each code at each of ``bits``, on windows of ``window`` tokens of held-out
    text (tokens ``eval_start ..`` of ``eval_corpus``).

    ``calibration`` is :func:`capture` of every layer on a calibration corpus (not the
    evaluation text); the codes are fitted on it per layer and KV head. One record per (code,
    bits): ``kl`` and ``nll`` (mean per scored token), ``kl_windows``, ``nll_windows`` and
    ``fp_nll_windows`` (per window), ``delta_ppl`` (relative to the exact model's perplexity on
    the same tokens). The first token of every window stays exact."""
    from tqdm.auto import tqdm
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    unknown = sorted(set(codes) - set(CODES))
    if unknown or not codes:
        raise ValueError(f"unknown codes {unknown or codes}; known: {list(CODES)}")
    if not kinds or set(kinds) - {"keys", "values"}:
        raise ValueError(f"kinds must be 'keys' and/or 'values', got {kinds!r}")
    layers = _chosen_layers(calibration, layers, eval_corpus)
    ids = tokenize_corpus(load_corpus(eval_corpus), tokenizer, eval_start + eval_tokens)
    ids = ids[eval_start:]
    spans = windows(len(ids), window)
    weights = torch.tensor([end - begin - 1 for begin, end, _ in spans], dtype=torch.float64)
    device = next(model.parameters()).device
    trellis = BitshiftTrellis(state_bits=state_bits, draw=draw)
    AttentionInterface.register(ROUNDTRIP_NAME, _roundtrip_attention)
    AttentionMaskInterface.register(ROUNDTRIP_NAME, sdpa_mask)

    def log_probs(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(tokens[None].to(device)).logits[0, :-1].float(), -1)

    def mean(values: list[float]) -> float:
        return float((torch.tensor(values, dtype=torch.float64) * weights).sum() / weights.sum())

    exact = [log_probs(ids[begin:end]) for begin, end, _ in spans]
    previous = model.config._attn_implementation
    records = []
    jobs = [(name, b) for name in codes for b in bits]
    try:
        model.set_attn_implementation(ROUNDTRIP_NAME)
        for name, b in tqdm(jobs, desc="codes through the model", disable=not progress):
            table = {
                layer: tuple(
                    [
                        _code_functions(name, b, head, kind, trellis, draw)
                        for head in calibration[layer]
                    ]
                    if kind in kinds
                    else None
                    for kind in ("keys", "values")
                )
                for layer in layers
            }
            kl_windows, nll_windows, fp_windows = [], [], []
            _ROUNDTRIPS.append(table)
            try:
                for (begin, end, _), reference in zip(spans, exact):
                    approx = log_probs(ids[begin:end])
                    targets = ids[begin + 1 : end, None].to(approx.device)
                    kl = (reference.exp() * (reference - approx)).sum(-1)
                    kl_windows.append(float(kl.mean()))
                    nll_windows.append(float(-approx.gather(-1, targets).mean()))
                    fp_windows.append(float(-reference.gather(-1, targets).mean()))
            finally:
                _ROUNDTRIPS.pop()
            records.append(
                {
                    "code": name,
                    "bits": b,
                    "kinds": list(kinds),
                    "layers": layers,
                    "kl": mean(kl_windows),
                    "nll": mean(nll_windows),
                    "delta_ppl": math.exp(mean(nll_windows) - mean(fp_windows)) - 1,
                    "kl_windows": kl_windows,
                    "nll_windows": nll_windows,
                    "fp_nll_windows": fp_windows,
                }
            )
    finally:
        model.set_attn_implementation(previous)
    return records


def head_frames(records: list[dict], bits: list[int], rates: list[float]):
    """:func:`measure_model`'s records as two DataFrames: ``per_head`` (one row per layer,
    head, kind, code and bits: ``relative_error``, ``attention_kl`` for keys,
    ``lloyd_max_model``) and ``shannon`` (kind, rate and the bound, the mean over heads)."""
    import pandas as pd

    rows, bound_rows = [], []
    for r in records:
        for name, entry in r["codes"].items():
            for i, b in enumerate(bits):
                rows.append(
                    {
                        "layer": r["layer"],
                        "head": r["head"],
                        "kind": r["kind"],
                        "code": name,
                        "bits": b,
                        "relative_error": entry["relative_error"][i],
                        "attention_kl": entry["attention_kl"][i]
                        if "attention_kl" in entry
                        else None,
                        "lloyd_max_model": r["lloyd_max_model"][i],
                    }
                )
        for rate, shannon in zip(rates, r["shannon"]):
            bound_rows.append({"kind": r["kind"], "rate": rate, "shannon": shannon})
    per_head = pd.DataFrame(rows)
    per_head["attention_kl"] = per_head["attention_kl"].astype(float)
    shannon = pd.DataFrame(bound_rows).groupby(["kind", "rate"]).mean().reset_index()
    return per_head, shannon
