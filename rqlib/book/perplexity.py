"""Chapter 4's bookkeeping: the grid of configurations, the results table, and the storage
arithmetic its prose quotes (what 11-bit norms and an 8-bit recent band save)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from rqlib.core.codebooks import lloyd_max
from rqlib.spec.bits import average_bits
from rqlib.spec.config import CompressionConfig
from rqlib.spec.geometry import model_geometry

__all__ = [
    "TABLE_FORMATS",
    "TABLE_HEADERS",
    "config_grid",
    "qjl_against_mse",
    "results_table",
    "storage_savings",
    "with_full_precision",
]

#: Columns of :func:`results_table` the chapter shows -> their readable headers.
TABLE_HEADERS = {
    "variant": "method",
    "key_bits": "key bits",
    "perplexity": "PPL",
    "delta_ppl_pct": "ΔPPL %",
    "kl": "KL (nats)",
    "top1": "top-1",
    "bits_key": "bits per key coord.",
    "bits_mean": "bits per K+V coord.",
}
#: Readable header -> format.
TABLE_FORMATS = {
    "PPL": "{:.2f}",
    "ΔPPL %": "{:+.1f}",
    "KL (nats)": "{:.4f}",
    "top-1": "{:.3f}",
    "bits per key coord.": "{:.3f}",
    "bits per K+V coord.": "{:.3f}",
}


def config_grid(
    methods: Sequence[str],
    bits: Sequence[int],
    sketches: Sequence[str],
    *,
    exact_window: int = 0,
    draw: int = 0,
) -> dict[tuple, CompressionConfig]:
    """``(variant, method, sketch or None, key bits) -> config`` for every method at every
    bit width; a ``-prod`` method once per QJL sketch (its variant names the sketch when there
    are several)."""
    if isinstance(exact_window, bool) or not isinstance(exact_window, int) or exact_window < 0:
        raise ValueError(f"exact_window must be an int >= 0, got {exact_window!r}")
    suffix = (f":win{exact_window}" if exact_window else "") + (f":draw={draw}" if draw else "")
    grid = {}
    for name in methods:
        for sketch in sketches if name.endswith("-prod") else [None]:
            variant = name if sketch is None or len(sketches) == 1 else f"{name}, {sketch} S"
            for b in sorted(bits):
                spec = f"{name}:k{b}" + (f":qjl={sketch}" if sketch else "") + suffix
                grid[variant, name, sketch, b] = CompressionConfig.parse(spec)
    return grid


def results_table(configs: dict[tuple, CompressionConfig], results: Sequence) -> pd.DataFrame:
    """One row per configuration of :func:`config_grid` from the results of
    :func:`rqlib.study.eval.evaluate` (full precision first, then ``configs`` in order)."""
    fp, *rest = results
    if len(rest) != len(configs):
        raise ValueError(f"{len(rest)} results for {len(configs)} configurations")
    rows = []
    for (variant, name, sketch, bits), result in zip(configs, rest):
        rows.append(
            {
                "variant": variant,
                "method": name,
                "qjl_sketch": sketch,
                "key_bits": bits,
                "spec": result.label,
                "perplexity": result.perplexity,
                "delta_ppl_pct": 100 * (result.perplexity / fp.perplexity - 1),
                "kl": result.kl,
                "top1": result.top1,
                "bits_key": result.bits["key"],
                "bits_mean": result.bits["mean"],
                "bytes_per_token": result.bytes_per_token,
            }
        )
    return pd.DataFrame(rows)


def with_full_precision(table: pd.DataFrame, fp) -> pd.DataFrame:
    """``table`` with a first row for the full-precision result ``fp`` (16-bit keys)."""
    row = {
        "variant": "full precision",
        "key_bits": 16,
        "perplexity": fp.perplexity,
        "delta_ppl_pct": 0.0,
        "kl": 0.0,
        "top1": 1.0,
        "bits_key": fp.bits["key"],
        "bits_mean": fp.bits["mean"],
    }
    return pd.concat([pd.DataFrame([row]), table], ignore_index=True)


def qjl_against_mse(table: pd.DataFrame) -> tuple[int, int]:
    """``(pairs, qjl_worse)``: the (QJL variant, bits) rows whose MSE-only sibling was run at
    the same bits, and how many of them have the larger KL."""
    mse = table.set_index(["method", "key_bits"])["kl"]
    pairs = worse = 0
    for row in table[table["qjl_sketch"].notna()].itertuples():
        sibling = (row.method.replace("-prod", "-mse"), row.key_bits)
        if sibling in mse.index:
            pairs += 1
            worse += bool(row.kl > mse.loc[sibling])
    return pairs, worse


def storage_savings(spec: str, model_config, context: int = 4096) -> dict[str, float]:
    """What three storage choices of ``spec`` save, in average bits per K and V coordinate of
    ``model_config`` at ``context`` tokens (:func:`rqlib.spec.bits.average_bits`):

    - ``norm_bits``, ``norm_saving``: the norms at ``5 + nm`` bits rather than fp16;
    - ``band_tokens``, ``band_bits``, ``band_saving``: the recent band as ``wb``-bit codes
      rather than exact tokens; ``band_relative_error``: the RMS relative error of one
      ``wb``-bit vector, ``sqrt(D)`` of the Lloyd–Max codebook at the head dimension;
    - ``once_saving``: the band stored once (``once``: a token's main codes are written when
      it leaves the band) rather than twice (in the band and in the main codes), whichever of
      the two ``spec`` stores.
    """
    config = CompressionConfig.parse(spec)
    if config.norm_mantissa is None or config.band_bits is None:
        raise ValueError(f"{spec!r} sets no short norms (nm=) or no coded band (wb=)")
    head_dim = model_geometry(model_config).head_dim

    def mean_bits(text: str) -> float:
        return average_bits(CompressionConfig.parse(text), model_config, context)["mean"]

    tokens = spec.split(":")
    base = mean_bits(spec)
    twice = ":".join(t for t in tokens if t not in ("once", "twice"))
    return {
        "norm_bits": 5 + config.norm_mantissa,
        "norm_saving": mean_bits(":".join(t for t in tokens if not t.startswith("nm="))) - base,
        "band_tokens": config.recent_window,
        "band_bits": config.band_bits,
        "band_saving": mean_bits(":".join(t for t in tokens if not t.startswith("wb="))) - base,
        "band_relative_error": lloyd_max(head_dim, config.band_bits).distortion ** 0.5,
        "once_saving": mean_bits(twice) - mean_bits(f"{twice}:once"),
    }
