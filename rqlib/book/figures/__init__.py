"""The chapters' figures, one module per chapter, and the conventions they share.

Each function takes numbers a chapter computed and returns a matplotlib ``Figure``; the
chapter glues it (``Chapter.figure``) and the prose places it with a numbered, captioned
``{glue:figure}`` directive. Legends sit below the axes (:func:`legend_below`), never on
top of the data.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

__all__ = ["legend_below", "subplots"]


def legend_below(fig: Figure, axes=None, *, ncol: int = 3, handles=None) -> None:
    """One legend for the whole figure, centred below its axes, with the handles of ``axes``
    (default: the first axes with labelled artists) or the given ``handles``."""
    if handles is None:
        candidates = [axes] if axes is not None else fig.axes
        for ax in candidates:
            handles, _ = ax.get_legend_handles_labels()
            if handles:
                break
    if not handles:
        raise ValueError("no labelled artist to put in a legend")
    fig.tight_layout()
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=min(ncol, len(handles)),
        fontsize=8,
        frameon=False,
    )


def subplots(n: int, *, width: float = 4.2, height: float = 3.2, **options):
    """``plt.subplots(1, n)`` with one panel ``width`` x ``height`` inches each; always a list
    of axes."""
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False, **options)
    return fig, list(axes[0])
