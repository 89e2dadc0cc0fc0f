"""Figures of chapter 6 (toward the rate-distortion bound of attention)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from rqlib.book.figures import legend_below, subplots

__all__ = [
    "curves_figure",
    "layers_figure",
    "levers_figure",
    "position_figure",
    "spectrum_figure",
    "window_figure",
]

KINDS = ("keys", "values")


def spectrum_figure(spectra: pd.DataFrame) -> Figure:
    """The calibrated weighted spectrum (share of the total, log scale) of keys and values,
    one line per layer (mean over its KV heads)."""
    fig, axes = subplots(2, width=4.6, height=3.4, sharey=True)
    layers = sorted(spectra.layer.unique())
    colors = dict(zip(layers, sns.color_palette("viridis", n_colors=len(layers))))
    for ax, kind in zip(axes, KINDS):
        for layer in layers:
            rows = spectra[(spectra.kind == kind) & (spectra.layer == layer)]
            share = np.mean(np.stack(rows.spectrum.to_numpy()), axis=0)
            ax.semilogy(np.arange(1, len(share) + 1), share, color=colors[layer], label=f"{layer}")
        ax.set_title(f"{kind}: weighted spectrum", fontsize=10)
        ax.set_xlabel("component (falling variance)")
    axes[0].set_ylabel("share of the weighted variance")
    legend_below(fig, axes[0], ncol=min(len(layers), 6))
    return fig


def curves_figure(curves: pd.DataFrame, bound: pd.DataFrame) -> Figure:
    """Relative weighted error against code bits per coordinate (log scale), mean over heads:
    the Shannon bound (line), today's code as the spectrum predicts it (dashed) and every code
    measured on held-out text (markers)."""
    fig, axes = subplots(2, width=4.6, height=3.6, sharey=True)
    codes = list(dict.fromkeys(curves.code))
    colors = dict(zip(codes, sns.color_palette(n_colors=len(codes))))
    markers = dict(zip(codes, "osD^v<>"))
    for ax, kind in zip(axes, KINDS):
        line = bound[bound.kind == kind]
        ax.semilogy(line.rate, line.shannon, "k-", label="Shannon bound (water-filling)")
        model = curves[(curves.kind == kind) & (curves.code == codes[0])]
        ax.semilogy(
            model.bits, model.lloyd_max_model, "k--", lw=1, label="rotation + Lloyd-Max, model"
        )
        for code in codes:
            rows = curves[(curves.kind == kind) & (curves.code == code)]
            ax.semilogy(
                rows.bits, rows.relative_error, markers[code] + ":", color=colors[code], label=code
            )
        ax.set_title(f"{kind}: weighted error on held-out text", fontsize=10)
        ax.set_xlabel("code bits per coordinate")
    axes[0].set_ylabel("relative weighted error")
    legend_below(fig, axes[0], ncol=3)
    return fig


def layers_figure(per_layer: pd.DataFrame) -> Figure:
    """The model's KL divergence with one layer's keys through each code, layer by layer."""
    fig, axes = subplots(1, width=8.5, height=3.4)
    ax = axes[0]
    codes = list(dict.fromkeys(per_layer.code))
    for code, color in zip(codes, sns.color_palette(n_colors=len(codes))):
        rows = per_layer[per_layer.code == code].sort_values("layer")
        ax.semilogy(rows.layer, rows.kl, "o-", ms=3, color=color, label=code)
    ax.set_xlabel("layer whose keys go through the code")
    ax.set_ylabel("next-token KL (nats)")
    legend_below(fig, ax, ncol=len(codes))
    return fig


def position_figure(by_position: pd.DataFrame, calibrated_positions: int) -> Figure:
    """The ratio of a code's mean squared score error to today's code's by block of positions:
    one line a calibration (the median over layers), one faint point a layer; the positions
    of the default calibration chunks shaded."""
    fig, axes = subplots(1, width=8.5, height=3.4)
    ax = axes[0]
    labels = list(dict.fromkeys(by_position.calibration))
    for label, color in zip(labels, sns.color_palette(n_colors=len(labels))):
        rows = by_position[by_position.calibration == label]
        ax.semilogy(rows.position, rows.ratio, ".", ms=4, alpha=0.35, color=color)
        median = rows.groupby("position").ratio.median()
        ax.semilogy(median.index, median.values, "o-", ms=4, color=color, label=label)
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.axvspan(
        0,
        calibrated_positions,
        color="0.92",
        zorder=0,
        label=f"positions of a {calibrated_positions}-token chunk",
    )
    ax.set_xlabel("first position of the block of queries and keys")
    ax.set_ylabel("score error / today's code's")
    legend_below(fig, ax, ncol=len(labels) + 1)
    return fig


def seam_figure(by_position: pd.DataFrame, lloyd_max: float) -> Figure:
    """The trellis's mean squared error at each position of a sequence, one line a reading of
    the register (``by_position``: ``reading``, ``position``, ``mse``), next to the Lloyd-Max
    code's distortion (dashed)."""
    fig, axes = subplots(1, width=8.5, height=3.4)
    ax = axes[0]
    readings = list(dict.fromkeys(by_position.reading))
    for reading, color in zip(readings, sns.color_palette(n_colors=len(readings))):
        rows = by_position[by_position.reading == reading].sort_values("position")
        ax.semilogy(rows.position, rows.mse, "o-", ms=3, color=color, label=reading)
    ax.axhline(lloyd_max, color="0.4", lw=0.8, ls="--", label="Lloyd-Max code")
    ax.set_xlabel("position of the sample in its sequence")
    ax.set_ylabel("mean squared error")
    legend_below(fig, ax, ncol=len(readings) + 1)
    return fig


def window_figure(by_window: pd.DataFrame, preset_windows: dict[float, int]) -> Figure:
    """The mean KL against the length of the recent window at equal stored bits: one line a
    budget (colour) and context (line style), the least KL of each line filled in, and the
    window each budget's preset keeps ringed (``preset_windows``: budget -> tokens).

    ``by_window`` has the columns ``budget``, ``context``, ``window`` and ``kl``."""
    fig, axes = subplots(1, width=7.5, height=3.6)
    ax = axes[0]
    budgets = sorted(by_window.budget.unique(), reverse=True)
    contexts = sorted(by_window.context.unique())
    colors = dict(zip(budgets, sns.color_palette(n_colors=len(budgets))))
    styles = dict(zip(contexts, ("-", "--", ":", "-.")))
    for context, budget in ((c, b) for c in contexts for b in budgets):  # a legend column a context
        rows = by_window[(by_window.budget == budget) & (by_window.context == context)]
        if rows.empty:
            continue
        rows = rows.sort_values("window")
        color = colors[budget]
        ax.loglog(
            rows.window,
            rows.kl,
            styles[context],
            marker="o",
            mfc="white",
            ms=5,
            color=color,
            label=f"{budget:g} bits, context {context}",
        )
        best = rows.loc[rows.kl.idxmin()]
        ax.loglog(best.window, best.kl, "o", ms=5, color=color)
        preset = rows[rows.window == preset_windows.get(budget)]
        ax.loglog(preset.window, preset.kl, "o", ms=12, mfc="none", mew=1.2, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(by_window.window.unique()), map(str, sorted(by_window.window.unique())))
    ax.minorticks_off()
    ax.set_xlabel("recent window (tokens at 8 bits)")
    ax.set_ylabel("mean KL to full precision")
    legend_below(fig, ax, ncol=2)
    return fig


#: The marker of each storage in :func:`levers_figure`, in the order of its legend.
LEVER_MARKERS = {"preset": "o", "chosen band": "s", "trellis": "^", "both": "*"}


def levers_figure(levers: pd.DataFrame, goals: dict[tuple, tuple[float, float]]) -> Figure:
    """One panel a case (``model``, ``preset``, ``context``): the ΔPPL against the KL of each
    storage of the case (one marker a storage, :data:`LEVER_MARKERS`), and the case's goals as
    dashed lines (``goals``: case -> (most ΔPPL %, most KL)), so that a point below and left of
    both lines meets both. The panel's limits follow the points; a goal outside them is named,
    with an arrow, at the edge it lies beyond.

    ``levers`` has the columns ``model``, ``preset``, ``context``, ``storage``, ``kl`` and
    ``delta_ppl_pct``."""
    cases = list(dict.fromkeys(zip(levers.model, levers.preset, levers.context)))
    columns = min(3, len(cases))
    rows_of_panels = -(-len(cases) // columns)
    fig, axes = plt.subplots(
        rows_of_panels, columns, figsize=(2.7 * columns, 2.5 * rows_of_panels), squeeze=False
    )
    panels = list(axes.flat)
    colors = dict(zip(LEVER_MARKERS, sns.color_palette(n_colors=len(LEVER_MARKERS))))
    for ax, case in zip(panels, cases):
        model, preset, context = case
        rows = levers[(levers.model == model) & (levers.preset == preset)]
        rows = rows[rows.context == context].set_index("storage")
        for storage, marker in LEVER_MARKERS.items():
            if storage in rows.index:
                row = rows.loc[storage]
                ax.plot(
                    row.kl, row.delta_ppl_pct, marker, ms=8, color=colors[storage], label=storage
                )
        ax.margins(0.25)
        ax.set_xlim(ax.get_xlim())  # fixed to the points: a goal outside them is left out
        ax.set_ylim(ax.get_ylim())
        max_dppl, max_kl = goals[case]
        ax.axhline(max_dppl, ls="--", lw=0.9, color="0.4")
        ax.axvline(max_kl, ls="--", lw=0.9, color="0.4")
        _point_to_goal(ax, max_kl, ax.get_xlim(), f"KL goal {max_kl:.3g}", ("←", "→"), "x")
        _point_to_goal(ax, max_dppl, ax.get_ylim(), f"ΔPPL goal {max_dppl:g} %", ("↓", "↑"), "y")
        ax.set_title(f"{model}, {preset}, {context} tokens", fontsize=9)
        ax.set_xlabel("KL", fontsize=8)
        ax.set_ylabel("ΔPPL %", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in panels[len(cases) :]:
        fig.delaxes(ax)
    legend_below(fig, panels[0], ncol=len(LEVER_MARKERS))
    return fig


def _point_to_goal(ax, goal: float, limits, label: str, arrows: tuple[str, str], axis: str):
    """Name a goal that falls outside the panel at the edge it lies beyond, with an arrow
    pointing to it (``arrows``: towards low, towards high); nothing when it is inside."""
    low, high = limits
    if low <= goal <= high:
        return
    beyond = int(goal > high)
    at = (0.02, 0.98)[beyond]
    text = f"{label} {arrows[1]}" if beyond else f"{arrows[0]} {label}"
    if axis == "x":
        options = {"ha": ("left", "right")[beyond], "va": "center"}
        ax.text(at, 0.5, text, transform=ax.transAxes, fontsize=7, color="0.3", **options)
    else:
        options = {"ha": "center", "va": ("bottom", "top")[beyond]}
        ax.text(0.5, at, text, transform=ax.transAxes, fontsize=7, color="0.3", **options)
