"""Figures of chapter 5 (sweeps): one heatmap per panel value, and the same numbers as lines."""

from __future__ import annotations

import pandas as pd
import seaborn as sns
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

from rqlib.book.figures import legend_below, subplots

__all__ = ["heatmaps_figure", "lines_figure"]


def heatmaps_figure(
    runs: pd.DataFrame, metric: str, rows: str, columns: str, panels: str
) -> Figure:
    """``metric`` by ``rows`` and ``columns``, one annotated heatmap per value of ``panels``,
    on one colour scale (logarithmic when every value is positive)."""
    values = sorted(runs[panels].unique())
    fig, axes = subplots(len(values), width=4.5, height=3.6)
    low, high = runs[metric].min(), runs[metric].max()
    norm = LogNorm(low, high) if low > 0 else Normalize(low, high)
    for ax, value in zip(axes, values):
        table = runs[runs[panels] == value].pivot_table(index=rows, columns=columns, values=metric)
        sns.heatmap(table, annot=True, fmt=".3g", cmap="viridis_r", norm=norm, ax=ax, cbar=False)
        ax.set_title(f"{panels} = {value}", fontsize=10)
        ax.tick_params(axis="y", rotation=0)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    return fig


def lines_figure(
    runs: pd.DataFrame,
    metric: str,
    rows: str,
    columns: str,
    panels: str,
    *,
    low: str | None = None,
    high: str | None = None,
    label: str | None = None,
) -> Figure:
    """``metric`` against ``rows``, one line per value of ``columns``, one panel per value of
    ``panels``, on a logarithmic axis (a constant ratio shows as a constant gap); with ``low``
    and ``high``, a bar from one to the other at each point (the range of repeated draws). The
    y axis is labelled ``label`` (default: ``metric``)."""
    values = sorted(runs[panels].unique())
    fig, axes = subplots(len(values), width=4.5, height=3.4, sharey=True)
    for ax, value in zip(axes, values):
        panel = runs[runs[panels] == value].sort_values(rows)
        for name, group in panel.groupby(columns, sort=True):
            (line,) = ax.plot(group[rows], group[metric], "o-", label=str(name))
            if low is not None and high is not None:
                ax.vlines(group[rows], group[low], group[high], color=line.get_color(), lw=2.5)
        ax.set_yscale("log" if runs[low or metric].min() > 0 else "symlog")
        if runs[rows].dtype.kind in "iu":  # integer parameters (bits): one tick per value
            ax.set_xticks(sorted(runs[rows].unique()))
        ax.set_title(f"{panels} = {value}", fontsize=10)
        ax.set_xlabel(rows)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(label or metric)
    legend_below(fig, ncol=4)
    return fig
