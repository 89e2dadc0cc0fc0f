"""Figures of the book (rqlib.book.figures): legends sit below the axes and hide no data."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from rqlib.book.figures import legend_below, subplots  # noqa: E402
from rqlib.book.figures.depth import layer_errors_figure  # noqa: E402


def overlaps_an_axes(fig) -> bool:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    return any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)


def test_legend_below_leaves_the_axes_free():
    fig, axes = subplots(2)
    for ax in axes:
        for k in range(6):
            ax.plot(np.arange(10), np.arange(10) * k, label=f"line {k}")
    legend_below(fig, ncol=3)
    assert not overlaps_an_axes(fig)
    plt.close(fig)
    fig, _ = subplots(1)
    with pytest.raises(ValueError, match="no labelled artist"):
        legend_below(fig)
    plt.close(fig)


def test_a_chapter_figure_keeps_its_legend_off_the_data(rng):
    """Random values in [0.01, 1) from rng; the assertion is geometric (no legend over the
    axes) and holds for any values, so it cannot fail by chance."""
    layers = np.arange(6)
    rows = []
    for method in ("turboquant-mse", "turboquant-prod (gaussian)", "rotorquant-mse"):
        for layer in layers:
            values = (0.01 + 0.99 * torch.rand(3, generator=rng, dtype=torch.float64)).numpy()
            rows.append(
                {
                    "method": method,
                    "layer": layer,
                    "attention_kl": values[0],
                    "noise_var": values[1],
                    "bias_var": values[2],
                }
            )
    frame = pd.DataFrame(rows)
    fig = layer_errors_figure(frame, list(frame.method.unique()))
    assert not overlaps_an_axes(fig)
    plt.close(fig)
