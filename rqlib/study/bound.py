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

- ``rotation+lloyd-max``: today's code, TurboQuant (a random rotation and the Lloyd-Max code
  of a rotated coordinate), keys centred with the calibrated mean as ``ctr`` does;
- ``rotation+trellis``: the same rotation, the coordinates coded by a bitshift trellis
  (:mod:`rqlib.core.trellis`) instead: the granular gain alone;
- ``transform+lloyd-max``: the calibrated transform code (:class:`rqlib.core.ratedistortion.
  TransformCode`), bits per group of 16 components by water-filling;
- ``transform+trellis``: the transform code with each run of equal-bit components coded by the
  trellis.

The calibrated codes also store their transform once per head (``side_bits``), which
:func:`side_bits_per_coordinate` spreads over a context.
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

__all__ = [
    "CODES",
    "HeadData",
    "capture",
    "measure_head",
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


def capture(
    model, tokenizer, corpus_name: str, n_tokens: int, layers: list[int], start: int = 0
) -> dict[int, list[HeadData]]:
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
    return heads


def side_bits_per_coordinate(code: TransformCode, context: int) -> float:
    """The transform's stored constants spread over ``context`` tokens, per coordinate."""
    return code.side_bits / (context * code.dim)


def _weighted_error(x, x_hat, mean, metric) -> float:
    e = x - x_hat
    c = x - mean
    return float(
        torch.einsum("nd,de,ne->", e, metric, e) / torch.einsum("nd,de,ne->", c, metric, c)
    )


def _rotation_code(x, mean, bits: int, seed: int, trellis: BitshiftTrellis | None):
    """Today's code (TurboQuant MSE) on ``x - mean``, or its coordinates by the trellis."""
    d = x.shape[-1]
    quantizer = make_quantizer("turboquant-mse", d, bits, seed=seed)
    centered = (x - mean).float()
    if trellis is None:
        return mean + quantizer.dequantize(quantizer.quantize(centered)).double()
    norms, unit = quantizer.rotated_unit(centered)
    y = unit.double() * math.sqrt(d)
    c = trellis.decode(trellis.encode(y, bits), bits)
    denominator = (c * c).sum(-1, keepdim=True)
    gain = torch.where(denominator > 0, (y * c).sum(-1, keepdim=True) / denominator, 0.0)
    gain = (gain * norms.double()[:, None] / math.sqrt(d)).to(torch.float16).double()
    return mean + quantizer.rotation.inverse((gain * c).float()).double()


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
    seed: int = 0,
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
                x_hat = _rotation_code(x, mean, b, seed, use)
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
    layers: list[int],
    *,
    bits: list[int],
    rates: list[float],
    calibration_corpus: str = "pydoc",
    calibration_tokens: int = 4096,
    eval_corpus: str = "wikitext-2",
    eval_start: int = 100_000,
    eval_tokens: int = 1024,
    state_bits: int = 10,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """:func:`measure_head` for the keys and values of every KV head of ``layers``: one record
    per (layer, head, kind), with ``layer``, ``head`` and ``kind`` added. Calibration and
    evaluation must be different corpora (the codes are fitted on the first only)."""
    from tqdm.auto import tqdm

    if calibration_corpus == eval_corpus:
        raise ValueError(
            f"calibration and evaluation use the same corpus {eval_corpus!r}: the codes would be "
            "fitted on the text they are judged on"
        )
    n_layers = model.config.num_hidden_layers
    bad = [layer for layer in layers if not 0 <= layer < n_layers]
    if bad or not layers:
        raise ValueError(f"layers {bad or layers} are out of range for {n_layers} layers")
    calibration = capture(model, tokenizer, calibration_corpus, calibration_tokens, layers)
    held_out = capture(model, tokenizer, eval_corpus, eval_tokens, layers, start=eval_start)
    trellis = BitshiftTrellis(state_bits=state_bits, seed=seed)
    jobs = [
        (layer, head, kind)
        for layer in layers
        for head in range(len(calibration[layer]))
        for kind in ("keys", "values")
    ]
    records = []
    for layer, head, kind in tqdm(jobs, desc="rate-distortion", unit="head", disable=not progress):
        result = measure_head(
            calibration[layer][head], held_out[layer][head], kind, bits, rates, trellis, seed
        )
        records.append({"layer": layer, "head": head, "kind": kind, **result})
    return records
