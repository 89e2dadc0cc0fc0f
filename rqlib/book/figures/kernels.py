"""Figures of chapter 3 (kernels): bytes per key, the packed layout, the instruction count, and
the measured decode step next to the byte model."""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from rqlib.book.figures import legend_below, subplots
from rqlib.core.packing import pack_bits, unpack_bits

__all__ = [
    "benchmark_figure",
    "bytes_figure",
    "issue_figure",
    "packing_figure",
    "byte_ratios",
]


def byte_ratios(per_bits: pd.DataFrame, value_bits: int) -> dict[str, pd.Series]:
    """Bytes of fp16 over bytes stored, per key bit width: for keys alone and for the key and
    value a decode step reads. A ratio of bytes, not of times: what a kernel achieves is
    measured (``rqlib.book.gpu_results``)."""
    fp16_kv = 2 * per_bits["fp16"]
    prod = per_bits["packed codes + QJL"]
    return {
        "keys: packed codes": per_bits["fp16"] / per_bits["packed codes"],
        "keys: packed codes + QJL": per_bits["fp16"] / prod,
        "K + V: codes + QJL, fp16 V": fp16_kv / (prod + per_bits["fp16"]),
        f"K + V: codes + QJL, {value_bits}-bit V": fp16_kv / (prod + per_bits["packed values"]),
    }


def bytes_figure(per_bits: pd.DataFrame, value_bits: int) -> Figure:
    """Left: bytes per key and KV head of each format against the key bits. Right: how many
    times fewer bytes than fp16 each format stores (:func:`byte_ratios`). Every line has its
    own colour and marker, so no legend entry looks like another."""
    fig, (left, right) = subplots(2, width=5.5, height=3.6)
    bits = np.array(per_bits.index)
    for name, style in (("fp16", "k--"), ("one byte per code", "k:")):
        left.plot(bits, per_bits[name], style, label=name)
    for name, marker, color in (("packed codes", "o-", "C0"), ("packed codes + QJL", "s-", "C1")):
        left.plot(bits, per_bits[name], marker, color=color, label=name)
    left.set_xlabel("key bits b (prod: b − 1 code bits + 1 QJL bit)")
    left.set_ylabel("bytes per key and KV head")
    left.set_ylim(0, None)
    styles = zip("^v<>", ("C2", "C3", "C4", "C5"))
    for (name, ratio), (marker, color) in zip(byte_ratios(per_bits, value_bits).items(), styles):
        right.plot(bits, ratio, marker + "-", color=color, label=f"fp16 / {name}")
    right.axhline(1.0, color="k", lw=0.8)
    right.set_xlabel("key bits b")
    right.set_ylabel("fp16 bytes / stored bytes")
    for ax in (left, right):
        ax.set_xticks(bits)
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    legend_below(fig, handles=handles, ncol=2)
    return fig


def packing_figure(codes: torch.Tensor, bits: int) -> Figure:
    """``pack_bits`` of ``codes``: each code's bits in the stream, the bytes they land in, and
    the codes that straddle two bytes (hatched). Every drawn bit is read back from the packed
    bytes, so the figure shows the real layout."""
    packed = pack_bits(codes, bits)
    if not torch.equal(unpack_bits(packed, bits, len(codes)), codes):
        raise AssertionError("pack_bits and unpack_bits disagree")
    n_stream = 8 * len(packed)
    stream = [(int(packed[t // 8]) >> (t % 8)) & 1 for t in range(n_stream)]
    fig, ax = plt.subplots(figsize=(11, 2.4))
    colors = plt.cm.tab10.colors
    for j, value in enumerate(codes.tolist()):
        straddles = (j * bits) // 8 != (j * bits + bits - 1) // 8
        face = dict(facecolor=colors[j % 10], alpha=0.55, edgecolor="k")
        ax.add_patch(
            plt.Rectangle((j * bits, 2), bits, 0.9, hatch="//" if straddles else None, **face)
        )
        box = dict(facecolor="white", alpha=0.8, lw=0, pad=1)
        ax.text(
            j * bits + bits / 2,
            2.45,
            f"code {j} = {value}",
            ha="center",
            va="center",
            fontsize=8,
            bbox=box,
        )
    for t, bit in enumerate(stream):
        owner = t // bits
        face = colors[owner % 10] if owner < len(codes) else "white"
        ax.add_patch(plt.Rectangle((t, 1), 1, 0.9, facecolor=face, alpha=0.3, edgecolor="k"))
        ax.text(t + 0.5, 1.45, str(bit), ha="center", va="center", fontsize=9)
        ax.text(t + 0.5, 0.05, str(t % 8), ha="center", va="center", fontsize=6, color="0.4")
    for i, byte in enumerate(packed.tolist()):
        ax.add_patch(plt.Rectangle((8 * i, 0.2), 8, 0.7, facecolor="0.92", edgecolor="k", lw=1.5))
        ax.text(8 * i + 4, 0.55, f"byte {i} = 0x{byte:02x}", ha="center", va="center", fontsize=9)
        ax.axvline(8 * i, color="k", lw=2)
    ax.axvline(n_stream, color="k", lw=2)
    ax.set_xlim(-0.2, n_stream + 0.2)
    ax.set_ylim(-0.2, 3)
    ax.set_yticks([0.05, 0.55, 1.45, 2.45], ["bit in byte", "bytes", "stream bits", "codes"])
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def issue_figure(by_class: Mapping[str, float], budgets: Mapping[str, float], label: str) -> Figure:
    """Warp instructions per key of a compiled decode step, stacked by class, against the
    instructions a GPU can issue while its HBM delivers the bytes of one key (``budgets``:
    one vertical line per storage format)."""
    fig, (ax,) = subplots(1, width=7.0, height=2.0)
    left = 0.0
    for (name, value), color in zip(by_class.items(), plt.get_cmap("tab10").colors):
        ax.barh([label], [value], left=left, color=color, label=name)
        left += value
    for (name, budget), style in zip(budgets.items(), ("--", ":", "-.")):
        ax.axvline(budget, color="k", ls=style, label=f"budget: {name}")
    ax.set_xlabel("warp instructions issued per key and KV head")
    handles = ax.get_legend_handles_labels()[0]
    legend_below(fig, handles=handles, ncol=2)
    return fig


def benchmark_figure(
    model_bytes: Mapping[str, float],
    lengths: np.ndarray,
    heads: int,
    hbm_gbps: float,
    measured: pd.DataFrame | None,
    issue_floor: tuple[str, float] | None = None,
) -> Figure:
    """Time of one decode step of one layer against the context length: the byte model
    (dashed: bytes per token and KV head read once at ``hbm_gbps``), the instruction-issue
    model when given (``(label, nanoseconds per token and KV head)``, dotted) and, when
    ``measured`` (columns ``kv_len``, ``kernel``, ``time_us``, ``mb_read``), the measured
    times (left, points) and the bandwidth they achieve (right)."""
    fig, axes = subplots(1 if measured is None else 2, width=5.8, height=3.8)
    ax = axes[0]
    for (name, nbytes), color in zip(model_bytes.items(), ("C0", "C1", "C2")):
        micros = nbytes * lengths * heads / (hbm_gbps * 1e9) * 1e6
        ax.plot(lengths, micros, "--", color=color, label=f"byte model: {name}")
    if issue_floor is not None:
        name, nanos = issue_floor
        ax.plot(lengths, nanos * lengths * heads / 1e3, ":", color="C3", label=name)
    if measured is not None:
        styles = zip("osD^v<>", ("C4", "C5", "C6", "C7", "C8", "C9", "k"))
        for (name, group), (marker, color) in zip(measured.groupby("kernel", sort=False), styles):
            ax.plot(
                group["kv_len"],
                group["time_us"],
                marker + "-",
                color=color,
                label=f"measured: {name}",
            )
            gbps = 1e3 * group["mb_read"] / group["time_us"]
            axes[1].plot(group["kv_len"], gbps, marker + "-", color=color)
        axes[1].axhline(hbm_gbps, color="k", ls=":")
        axes[1].annotate(
            "HBM peak",
            (0.02, hbm_gbps),
            xycoords=("axes fraction", "data"),
            va="bottom",
            fontsize=8,
        )
        axes[1].set_xscale("log", base=2)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("context length (tokens)")
        axes[1].set_ylabel("GB/s (bytes it must read / time)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("µs per decode step, one layer")
    legend_below(fig, handles=ax.get_legend_handles_labels()[0], ncol=2)
    return fig
