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


def test_the_headline_figure_lists_what_it_draws_and_its_labels_do_not_collide():
    """Fig. 4.6 from the committed held-out results: every legend entry is drawn (no peer the
    tables lack), and no two point labels of a panel overlap."""
    from rqlib.book import loaders
    from rqlib.book.figures.perplexity import _headline_legend_name, headline_figure

    held_out = loaders.held_out_tables(loaders.headline_frame(), "smollm2")
    fig = headline_figure(held_out, loaders.MODELS["smollm2"])
    drawn = {
        _headline_legend_name(row.method, row.kind)
        for table in held_out.values()
        for row in table.itertuples()
    }
    (legend,) = fig.legends
    assert {t.get_text() for t in legend.get_texts()} == drawn | {"Pareto front"}
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [text.get_window_extent(renderer) for text in ax.texts]
        for i, box in enumerate(boxes):
            for other in boxes[i + 1 :]:
                assert not box.overlaps(other), f"{ax.get_title()}: two labels overlap"
    plt.close(fig)


def test_the_score_check_figure_gives_its_noise_a_unit():
    from rqlib.book.figures.perplexity import score_check_figure

    per_layer = pd.DataFrame(
        {
            "method": ["a", "a", "b", "b"],
            "layer": [0, 1, 0, 1],
            "slope": [0.9, 0.95, 1.0, 1.0],
            "noise_var": [1e-3, 2e-3, 3e-3, 4e-3],
            "attention_kl": [1e-4, 2e-4, 3e-4, 4e-4],
        }
    )
    fig = score_check_figure(per_layer)
    assert "logit²" in fig.axes[1].get_ylabel() and "nats" in fig.axes[2].get_ylabel()
    plt.close(fig)


def test_chapter_3_figures_have_distinct_legend_entries_off_the_data(rng):
    """Fig. 3.1 (bytes per key and byte ratios) and the measured decode step: every legend
    entry differs from the others in its label and in its look (colour, marker, line style),
    and the legend covers no axes."""
    from rqlib.book.figures import kernels as figures

    bits = [2, 3, 4]
    per_bits = pd.DataFrame(
        {
            "fp16": [256.0] * 3,
            "one byte per code": [130.0] * 3,
            "packed codes": [34.0, 50.0, 66.0],
            "packed codes + QJL": [36.0, 52.0, 68.0],
            "packed values": [66.0] * 3,
        },
        index=pd.Index(bits, name="key bits"),
    )
    times = (100 + 1000 * torch_uniform(rng, 8)).tolist()
    measured = pd.DataFrame(
        {
            "kv_len": [32768, 131072] * 4,
            "kernel": [k for k in ("SDPA fp16", "a", "b", "attention K, V packed") for _ in "12"],
            "time_us": times,
            "mb_read": [35.0, 140.0] * 4,
        }
    )
    lengths = np.array([1024, 32768, 131072])
    for fig in (
        figures.bytes_figure(per_bits, 4),
        figures.benchmark_figure(
            {"fp16": 512, "packed": 116}, lengths, 8, 4800.0, measured, ("issue", 0.1)
        ),
    ):
        (legend,) = fig.legends
        handles, labels = legend.legend_handles, [t.get_text() for t in legend.get_texts()]
        looks = [(str(h.get_color()), h.get_marker(), h.get_linestyle()) for h in handles]
        assert len(set(labels)) == len(labels) and len(set(looks)) == len(looks), labels
        assert not overlaps_an_axes(fig)
        plt.close(fig)


def torch_uniform(rng, n: int):
    import torch

    return torch.rand(n, generator=rng, dtype=torch.float64).numpy()


@pytest.mark.parametrize("n_presets", [1, 3, 4, 5])
def test_the_allocation_figure_draws_every_preset_side_by_side(n_presets):
    """Each preset gets its own bars in each bit panel, none dropped, none overlapping another
    (a grid of offsets sized for three presets silently dropped a fourth)."""
    from types import SimpleNamespace

    from rqlib.book.figures.perplexity import allocation_figure
    from rqlib.spec.config import CompressionConfig

    n_layers = 6
    kl = {
        (kind, layer, bits): 0.01 * (layer + 1)
        for kind in ("key", "value")
        for layer in range(n_layers)
        for bits in (2, 3)
    }
    table = SimpleNamespace(n_layers=n_layers, kl=kl)
    allocated = {
        f"rq-{i}": CompressionConfig.parse(f"turboquant-mse:k{2 + i % 3}:v{1 + i % 3}")
        for i in range(n_presets)
    }
    fig = allocation_figure(table, allocated)
    for ax in fig.axes[1:]:
        assert [c.get_label() for c in ax.containers] == list(allocated)
        lefts = sorted(bar.get_x() for c in ax.containers for bar in c)
        widths = {round(bar.get_width(), 9) for c in ax.containers for bar in c}
        (width,) = widths
        assert all(b - a >= width - 1e-9 for a, b in zip(lefts, lefts[1:]))  # no overlap
    plt.close(fig)


def test_the_position_figure_draws_each_calibrations_median_off_the_legend(rng):
    """Random ratios from rng; the median line of each calibration is checked against pandas'
    median and the legend against the axes, both exact, so nothing fails by chance."""
    from rqlib.book.figures.bound import position_figure

    rows = [
        {"layer": layer, "position": start, "calibration": label, "ratio": float(ratio)}
        for label in ("kxf, chunks of 1024", "kxf, chunks of 4096")
        for layer in range(5)
        for start, ratio in zip((0, 1024, 2048), 0.1 + torch.rand(3, generator=rng))
    ]
    frame = pd.DataFrame(rows)
    fig = position_figure(frame, 1024)
    lines = [line for line in fig.axes[0].lines if line.get_label().startswith("kxf")]
    assert [line.get_label() for line in lines] == list(frame.calibration.unique())
    for line in lines:
        median = frame[frame.calibration == line.get_label()].groupby("position").ratio.median()
        assert np.allclose(line.get_ydata(), median.values)
    assert not overlaps_an_axes(fig)
    plt.close(fig)


def test_the_seam_figure_draws_each_reading_in_position_order_and_the_lloyd_max_line(rng):
    """Random errors from rng in a shuffled order; each reading's line must hold its errors by
    position and the dashed line the Lloyd-Max distortion, exactly, off the legend."""
    from rqlib.book.figures.bound import seam_figure

    rows = [
        {"reading": reading, "position": position, "mse": float(error)}
        for reading in ("register from 0", "tail-biting")
        for position, error in enumerate(0.01 + torch.rand(8, generator=rng))
    ]
    frame = pd.DataFrame(rows).sample(
        frac=1.0, random_state=int(torch.randint(1 << 30, (1,), generator=rng))
    )
    lloyd_max = float(0.02 + torch.rand(1, generator=rng))
    fig = seam_figure(frame, lloyd_max)
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    for reading in ("register from 0", "tail-biting"):
        expected = frame[frame.reading == reading].sort_values("position")
        assert np.array_equal(lines[reading].get_xdata(), expected.position.values)
        assert np.allclose(lines[reading].get_ydata(), expected.mse.values)
    assert list(lines["Lloyd-Max code"].get_ydata()) == [lloyd_max, lloyd_max]
    assert not overlaps_an_axes(fig)
    plt.close(fig)


def test_the_window_figure_fills_each_lines_least_kl_and_rings_the_presets_window(rng):
    """Random KLs from rng (ties have probability zero); each line is checked against the
    frame sorted by window, its filled point against the frame's least KL and its ring
    against the preset's window, all exact, so nothing fails by chance."""
    from rqlib.book.figures.bound import window_figure

    windows = (16, 32, 64, 128)
    frame = pd.DataFrame(
        [
            {"budget": budget, "context": context, "window": window, "kl": float(kl)}
            for budget in (3.0, 2.0)
            for context in (1024, 4096)
            for window, kl in zip(windows, 0.01 + torch.rand(len(windows), generator=rng))
        ]
    ).sample(frac=1.0, random_state=int(torch.randint(0, 2**31, (1,), generator=rng)))
    fig = window_figure(frame, {3.0: 64, 2.0: 32})
    lines = fig.axes[0].lines
    labelled = [line for line in lines if not line.get_label().startswith("_")]
    assert len(labelled) == 4
    for line in labelled:
        budget, context = float(line.get_label().split()[0]), int(line.get_label().split()[-1])
        rows = frame[(frame.budget == budget) & (frame.context == context)].sort_values("window")
        assert list(line.get_xdata()) == list(rows.window)
        assert np.allclose(line.get_ydata(), rows.kl)
        color = line.get_color()
        marks = [m for m in lines if m not in labelled and m.get_color() == color]
        filled = [m for m in marks if m.get_markersize() == 5]
        ringed = [m for m in marks if m.get_markersize() == 12]
        best = rows.loc[rows.kl.idxmin()]
        preset = {3.0: 64, 2.0: 32}[budget]
        assert any(np.allclose(m.get_xydata(), [[best.window, best.kl]]) for m in filled)
        assert any(list(m.get_xdata()) == [preset] for m in ringed)
    assert not overlaps_an_axes(fig)
    plt.close(fig)


def test_the_levers_figure_puts_each_storage_of_each_case_where_its_numbers_say(rng):
    """Random KL and ΔPPL from rng for five cases of four storages (one storage left out of
    one case); each panel's marker of a storage must sit exactly at that row's numbers, a
    storage without a row must have no marker, every marker must lie inside its panel, a goal
    between a case's points must be drawn as lines at it with no note, and a goal far outside
    must leave the limits alone and be named at the edge it lies beyond. The comparisons are
    exact and a median of continuous draws lies between them, so nothing fails by chance."""
    from rqlib.book.figures.bound import LEVER_MARKERS, levers_figure

    cases = [("m1", "rq-3", 1024), ("m1", "rq-3", 4096), ("m1", "rq-2", 1024)]
    cases += [("m1", "rq-2", 4096), ("m2", "rq-3", 1024)]
    frame = pd.DataFrame(
        [
            {"model": m, "preset": p, "context": c, "storage": storage}
            | {"kl": float(kl), "delta_ppl_pct": float(dppl)}
            for m, p, c in cases
            for storage, kl, dppl in zip(
                LEVER_MARKERS,
                0.01 + torch.rand(4, generator=rng),
                40 * torch.rand(4, generator=rng),
            )
        ]
    )
    frame = frame.drop(index=frame[(frame.model == "m2") & (frame.storage == "both")].index)
    by_case = frame.groupby(["model", "preset", "context"])
    # each case's goals at its own median KL and ΔPPL: between its points, so inside its panel
    inside = {
        case: (float(by_case.delta_ppl_pct.median()[case]), float(by_case.kl.median()[case]))
        for case in cases
    }
    goals = inside | {cases[-1]: (1e6, 1e6)}  # far outside: left out, not zoomed to
    fig = levers_figure(frame, goals)
    assert len(fig.axes) == len(cases)
    for ax, case in zip(fig.axes, cases):
        rows = frame[(frame.model == case[0]) & (frame.preset == case[1])]
        rows = rows[rows.context == case[2]].set_index("storage")
        marks = {line.get_label(): line for line in ax.lines if line.get_marker() != "None"}
        assert set(marks) == set(rows.index)
        (x_low, x_high), (y_low, y_high) = ax.get_xlim(), ax.get_ylim()
        for storage, line in marks.items():
            assert line.get_marker() == LEVER_MARKERS[storage]
            assert list(line.get_xydata()[0]) == [rows.kl[storage], rows.delta_ppl_pct[storage]]
            # inside the panel, not off its edge
            assert (
                x_low < rows.kl[storage] < x_high and y_low < rows.delta_ppl_pct[storage] < y_high
            )
        assert x_high < 1e6 and y_high < 1e6  # the far goal did not stretch the panel
        lines = [line for line in ax.lines if line.get_marker() == "None"]
        texts = [text.get_text() for text in ax.texts]
        if case == cases[-1]:  # above and to the right of every point
            assert texts == ["KL goal 1e+06 →", "ΔPPL goal 1e+06 % ↑"]
        else:
            assert texts == []
            max_dppl, max_kl = goals[case]
            assert any(list(line.get_ydata()) == [max_dppl, max_dppl] for line in lines)
            assert any(list(line.get_xdata()) == [max_kl, max_kl] for line in lines)
    assert not overlaps_an_axes(fig)
    plt.close(fig)
