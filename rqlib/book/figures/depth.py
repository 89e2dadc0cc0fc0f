"""Figures of chapter 2 (bias and variance through depth)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from rqlib.book.figures import legend_below, subplots

__all__ = ["heatmaps_figure", "layer_errors_figure", "second_order_figure", "stream_figure"]

#: (column, title, colour map, logarithmic colour scale) of the heatmap panels.
HEATMAPS = (
    ("slope", "score slope (1 = unbiased)", "vlag_r", False),
    ("noise_var", "score noise variance (logits²)", "rocket_r", True),
    ("attention_kl", "attention KL vs exact (nats)", "rocket_r", True),
    ("output_error", "relative attention-output error", "rocket_r", False),
)


def heatmaps_figure(per_layer: pd.DataFrame, order: Sequence[str]) -> Figure:
    """One heatmap per measurement, methods by layers."""
    fig, axes = plt.subplots(len(HEATMAPS), 1, figsize=(10, 2.6 * len(HEATMAPS)), sharex=True)
    for ax, (column, title, cmap, log) in zip(axes, HEATMAPS):
        table = per_layer.pivot(index="method", columns="layer", values=column).loc[list(order)]
        options = {"center": 1.0} if column == "slope" else {}
        if log:
            options["norm"] = LogNorm(table.values.min(), table.values.max())
        sns.heatmap(table, ax=ax, cmap=cmap, cbar_kws={"label": ""}, **options)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("")
    axes[-1].set_xlabel("layer")
    fig.tight_layout()
    return fig


def layer_errors_figure(per_layer: pd.DataFrame, order: Sequence[str]) -> Figure:
    """Left: attention KL per layer. Right: the noise part (solid) and the bias part (dotted)
    of the score error variance, per layer."""
    fig, (left, right) = subplots(2, width=5.5, height=3.6)
    colors = dict(zip(order, sns.color_palette(n_colors=len(order))))
    for label in order:
        rows = per_layer[per_layer.method == label]
        left.plot(rows.layer, rows.attention_kl, "o-", ms=3, color=colors[label], label=label)
        right.plot(rows.layer, rows.noise_var, "-", color=colors[label])
        right.plot(rows.layer, rows.bias_var, ":", color=colors[label])
    left.set_ylabel("attention KL vs exact (nats)")
    right.set_ylabel("score error variance (logits²)")
    right.set_title("solid: noise part, dotted: bias part", fontsize=10)
    for ax in (left, right):
        ax.set_yscale("log")
        ax.set_xlabel("layer")
    legend_below(fig, left, ncol=3)
    return fig


def second_order_figure(per_layer: pd.DataFrame, order: Sequence[str]) -> Figure:
    """Left: each layer's measured attention KL against its second-order prediction
    ``½ Var_p(ε)``. Right: the share of the KL that the shrinkage alone causes, per layer."""
    fig, (left, right) = subplots(2, width=5.0, height=3.8)
    colors = dict(zip(order, sns.color_palette(n_colors=len(order))))
    for label in order:
        rows = per_layer[per_layer.method == label]
        left.loglog(rows.kl_second_order, rows.attention_kl, "o", ms=3, color=colors[label])
        share = rows.kl_shrinkage / rows.attention_kl
        right.semilogy(rows.layer, share, "o-", ms=3, color=colors[label], label=label)
    limits = np.array([per_layer.kl_second_order.min(), per_layer.kl_second_order.max()])
    left.plot(limits, limits, "k--", lw=1, label="measured = predicted")
    left.set_xlabel(r"second order, $\frac{1}{2}\mathrm{Var}_p(\varepsilon)$ (nats)")
    left.set_ylabel("measured attention KL (nats)")
    right.set_xlabel("layer")
    right.set_ylabel("KL of the shrinkage alone / KL")
    handles = right.get_legend_handles_labels()[0] + left.get_legend_handles_labels()[0]
    legend_below(fig, handles=handles, ncol=3)
    return fig


def stream_figure(stream: pd.DataFrame, order: Sequence[str]) -> Figure:
    """Relative error of the residual stream after each layer, one line per method."""
    fig, (ax,) = subplots(1, width=9, height=3.8)
    for label in order:
        rows = stream[stream.method == label]
        style = "--" if label.endswith("nc") else "o-"
        ax.plot(rows.layer, rows.hidden_error, style, ms=3, label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of the residual stream")
    legend_below(fig, ncol=3)
    return fig
