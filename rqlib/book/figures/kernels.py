"""Figures of chapter 3 (kernels): bytes per key, the packed layout, the decode-step model."""

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
    "lanes_figure",
    "packing_figure",
    "speedups",
]


def speedups(per_bits: pd.DataFrame, value_bits: int) -> dict[str, pd.Series]:
    """The memory-bound speed-ups over fp16 the byte counts predict, per key bit width."""
    fp16_kv = 2 * per_bits["fp16"]
    prod = per_bits["packed codes + QJL"]
    return {
        "keys only: packed codes": per_bits["fp16"] / per_bits["packed codes"],
        "keys only: packed codes + QJL": per_bits["fp16"] / prod,
        "decode, K + QJL, V fp16": fp16_kv / (prod + per_bits["fp16"]),
        f"decode, K + QJL, V {value_bits}-bit": fp16_kv / (prod + per_bits["packed values"]),
    }


def bytes_figure(per_bits: pd.DataFrame, value_bits: int) -> Figure:
    """Left: bytes per key and KV head of each format against the key bits. Right: the
    speed-ups over fp16 that the byte counts predict."""
    fig, (left, right) = subplots(2, width=5.5, height=3.6)
    bits = np.array(per_bits.index)
    for name, style in (("fp16", "k--"), ("one byte per code", "k:")):
        left.plot(bits, per_bits[name], style, label=name)
    for name, marker in (("packed codes", "o-"), ("packed codes + QJL", "s-")):
        left.plot(bits, per_bits[name], marker, label=name)
    left.set_xlabel("key bits b (prod: b − 1 code bits + 1 QJL bit)")
    left.set_ylabel("bytes per key and KV head")
    left.set_ylim(0, None)
    for (name, ratio), marker in zip(speedups(per_bits, value_bits).items(), "os^v"):
        right.plot(bits, ratio, marker + "-", label=name)
    right.axhline(1.0, color="k", lw=0.8)
    right.set_xlabel("key bits b")
    right.set_ylabel("predicted speed-up over fp16")
    for ax in (left, right):
        ax.set_xticks(bits)
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    legend_below(fig, handles=handles, ncol=3)
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
    """Time of one decode step of one layer against the context length: the byte-count model
    (dashed: bytes per token and KV head read once at ``hbm_gbps``), the instruction-issue
    floor when given (``(label, nanoseconds per token and KV head)``, dotted) and, when
    measured, the kernels' times (left) and achieved bandwidth (right)."""
    fig, axes = subplots(1 if measured is None else 2, width=5.8, height=3.8)
    ax = axes[0]
    for (name, nbytes), color in zip(model_bytes.items(), ("C0", "C1", "C2")):
        micros = nbytes * lengths * heads / (hbm_gbps * 1e9) * 1e6
        ax.plot(lengths, micros, "--", color=color, label=f"model: {name}")
    if issue_floor is not None:
        name, nanos = issue_floor
        ax.plot(lengths, nanos * lengths * heads / 1e3, ":", color="C3", label=name)
    if measured is not None:
        for name, group in measured.groupby("kernel", sort=False):
            ax.plot(group["kv_len"], group["time_us"], "o-", label=f"measured: {name}")
            axes[1].plot(group["kv_len"], group["GB_per_s"], "o-")
        axes[1].axhline(hbm_gbps, color="k", ls=":", label="HBM peak")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("context length (tokens)")
        axes[1].set_ylabel("achieved GB/s (bytes read / time)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("µs per decode step, one layer")
    handles = [h for a in axes for h in a.get_legend_handles_labels()[0]]
    legend_below(fig, handles=handles, ncol=2)
    return fig


def lanes_figure(maps: Mapping[int, torch.Tensor], group: int) -> Figure:
    """One panel per number of lanes: the pairs (tile row, key of the tile) of one key tile
    whose score the softmax reads (``maps[lanes]``, from ``kernel_checks.lane_map``: the tile
    column + 1 where read, 0 where the product is computed and dropped), coloured by the query
    row of the ``group`` a tile row holds (row ``i`` holds query row ``i // lanes``); grey rows
    hold no query."""
    fig, axes = subplots(len(maps), width=3.6, height=3.9)
    colors = plt.cm.tab10.colors
    for ax, (lanes, read) in zip(axes, maps.items()):
        rows, keys = read.shape
        for i in range(rows):
            query = i // lanes
            for j in range(keys):
                if query >= group:
                    face = dict(facecolor="0.85", edgecolor="white")
                elif read[i, j] > 0:
                    face = dict(facecolor=colors[query % 10], edgecolor="white")
                else:
                    face = dict(facecolor=colors[query % 10], alpha=0.15, edgecolor="white")
                ax.add_patch(plt.Rectangle((j, i), 1, 1, **face))
        ax.set_xlim(0, keys)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal")
        ax.set_xticks([0, keys // 2, keys])
        ax.set_yticks([0, rows // 2, rows])
        ax.set_xlabel("key of the tile")
        ax.set_ylabel("row of the tile")
        used = min(rows, group * lanes)
        ax.set_title(
            f"{lanes} lane{'s' * (lanes > 1)}: {used} of {rows} rows hold a query", fontsize=9
        )
    handles = [
        plt.Rectangle((0, 0), 1, 1, facecolor=colors[q % 10], label=f"query row {q}")
        for q in range(group)
    ]
    handles += [
        plt.Rectangle((0, 0), 1, 1, facecolor=colors[0], alpha=0.15, label="product dropped"),
        plt.Rectangle((0, 0), 1, 1, facecolor="0.85", label="no query"),
    ]
    legend_below(fig, handles=handles, ncol=len(handles))
    return fig
