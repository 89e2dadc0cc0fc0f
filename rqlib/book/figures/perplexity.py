"""Figures of chapter 4 (perplexity): the keys-only table, the score check, the presets on one
axis of storage, the per-layer allocation, the ablation of each preset, and the side-by-side
with transformers' quantized caches."""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from rqlib.book.figures import legend_below, subplots
from rqlib.spec.presets import TARGETS

__all__ = [
    "ablation_figure",
    "allocation_figure",
    "headline_figure",
    "pareto_front",
    "perplexity_figure",
    "presets_figure",
    "score_check_figure",
]

METHOD_COLORS = {
    "turboquant-mse": "C0",
    "turboquant-prod": "C1",
    "rotorquant-mse": "C2",
    "rotorquant-prod": "C3",
}


def perplexity_figure(table: pd.DataFrame) -> Figure:
    """ΔPPL %, KL and top-1 agreement against the stored bits per key coordinate, one line
    per variant (dashed / dotted: MSE + QJL with a Gaussian / orthogonal sketch)."""
    fig, axes = subplots(3, width=4.4, height=3.4)
    for variant, rows in table.groupby("variant", sort=False):
        rows = rows.sort_values("bits_key")
        style = (":" if "orthogonal" in variant else "--") if "-prod" in variant else "-"
        marker = "s" if variant.startswith("rotor") else "o"
        for ax, column in zip(axes, ("delta_ppl_pct", "kl", "top1")):
            ax.plot(rows["bits_key"], rows[column], style, marker=marker, label=variant)
    axes[0].set_yscale("symlog", linthresh=1)
    axes[0].set_ylabel("ΔPPL vs full precision (%)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("mean KL(fp ‖ method), nats")
    axes[2].set_ylabel("top-1 agreement with fp")
    for ax in axes:
        ax.set_xlabel("stored bits per key coordinate")
        ax.grid(alpha=0.3)
    legend_below(fig, ncol=3)
    return fig


def score_check_figure(per_layer: pd.DataFrame) -> Figure:
    """Per layer: the slope of estimated on exact scores, the noise variance, the attention
    KL; one line per method."""
    fig, axes = subplots(3, width=4.4, height=3.2)
    for label, rows in per_layer.groupby("method", sort=False):
        for ax, column in zip(axes, ("slope", "noise_var", "attention_kl")):
            ax.plot(rows["layer"], rows[column], "o-", ms=3, label=label)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_ylabel("score slope (1 = unbiased)")
    axes[1].set_ylabel("score noise variance, logit²")
    axes[2].set_ylabel("attention KL, nats")
    for ax in axes[1:]:
        ax.set_yscale("log")
    for ax in axes:
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    legend_below(fig, ncol=3)
    return fig


def presets_figure(
    keys_only: Mapping[str, pd.DataFrame],
    presets: Mapping[str, pd.DataFrame],
    titles: Mapping[str, str],
) -> Figure:
    """ΔPPL % against the average stored bits per K and V coordinate: the keys-only methods
    (colour: method, marker: key bits), the presets (stars) and the presets' targets (boxes),
    one panel per model."""
    markers = {2: "v", 3: "o", 4: "^"}
    fig, axes = subplots(len(titles), width=6.0, height=4.2, sharey=True)
    for ax, (model, title) in zip(axes, titles.items()):
        frame = keys_only[model]
        for row in frame[frame["method"] != "fp"].itertuples():
            color, marker = METHOD_COLORS.get(row.method, "C7"), markers.get(row.key_bits, "o")
            ax.scatter(row.bits_mean, row.delta_ppl_pct, color=color, marker=marker, s=40)
        for row in presets[model][presets[model]["role"] == "preset"].itertuples():
            ax.scatter(row.bits_mean, row.delta_ppl_pct, marker="*", s=160, color="k", zorder=3)
            ax.annotate(
                row.preset,
                (row.bits_mean, row.delta_ppl_pct),
                textcoords="offset points",
                xytext=(6, 4),
                fontsize=8,
            )
        for name, target in TARGETS.items():
            box = ([0, target.max_bits, target.max_bits], [target.max_delta_ppl_pct] * 2 + [-100])
            ax.plot(*box, color="k", lw=0.8)
            ax.fill_between(
                [0, target.max_bits], -100, target.max_delta_ppl_pct, alpha=0.06, color="k"
            )
            ax.text(0.1, target.max_delta_ppl_pct * 1.15, f"{name} target", fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("average stored bits per K and V coordinate")
        ax.set_xlim(0, 11)
        ax.grid(alpha=0.3)
    plotted = pd.concat([f["delta_ppl_pct"] for f in (*keys_only.values(), *presets.values())])
    axes[0].set_yscale("symlog", linthresh=1)
    axes[0].set_ylim(min(0.0, float(plotted.min())) - 0.2, 2 * float(plotted.max()))
    axes[0].set_ylabel("ΔPPL vs full precision (%)")
    handles = [
        plt.Line2D([], [], color=c, marker="o", ls="", label=f"{name} (keys only)")
        for name, c in METHOD_COLORS.items()
    ]
    handles += [
        plt.Line2D([], [], color="C7", marker=m, ls="", label=f"{b}-bit keys")
        for b, m in markers.items()
    ]
    handles.append(
        plt.Line2D([], [], color="k", marker="*", ms=12, ls="", label="preset (K and V)")
    )
    legend_below(fig, handles=handles, ncol=4)
    return fig


def allocation_figure(table, allocated: Mapping[str, object]) -> Figure:
    """Left: the measured sensitivity of each layer's keys (3 bits) and values (2 bits).
    Middle and right: the key and value bits each preset allocates per layer."""
    layers = list(range(table.n_layers))
    fig, axes = subplots(3, width=4.6, height=3.4)
    for kind, bits, color in (("key", 3, "C0"), ("value", 2, "C1")):
        kl = [max(table.kl[(kind, layer, bits)], 1e-6) for layer in layers]
        axes[0].semilogy(layers, kl, "o-", color=color, ms=3, label=f"{kind}s at {bits} bits")
    axes[0].set_ylabel("KL with only this item compressed, nats")
    for ax, kind, getter in ((axes[1], "key", "key_bits_of"), (axes[2], "value", "value_bits_of")):
        width = 0.8 / len(allocated)
        for index, (name, config) in enumerate(allocated.items()):
            offset = (index - (len(allocated) - 1) / 2) * width
            bits = [getattr(config, getter)(layer) for layer in layers]
            ax.bar([layer + offset for layer in layers], bits, width=width, label=name)
        ax.set_ylabel(f"allocated {kind} bits")
    for ax in axes:
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    handles = axes[0].get_legend_handles_labels()[0] + axes[1].get_legend_handles_labels()[0]
    legend_below(fig, handles=handles, ncol=5)
    return fig


CHANGE_COLORS = {"removed": "C3", "swapped": "C0", "added": "C2"}


def ablation_figure(ablation: pd.DataFrame) -> Figure:
    """One panel per preset: the ΔPPL % of each one-lever variant (bars, coloured by the kind
    of change) against the preset itself (vertical line)."""
    variants = ablation[ablation["role"] == "ablation"]
    names = list(dict.fromkeys(variants["preset"]))
    height = 0.35 * variants.groupby("preset").size().max() + 1.2
    fig, axes = subplots(len(names), width=6.5, height=height)
    for ax, name in zip(axes, names):
        rows = variants[variants["preset"] == name].sort_values("delta_ppl_pct")
        colors = [CHANGE_COLORS[c] for c in rows["change"]]
        ax.barh(
            [f"{r.change}: {r.lever}" for r in rows.itertuples()],
            rows["delta_ppl_pct"],
            color=colors,
        )
        base = ablation[(ablation["role"] == "preset") & (ablation["preset"] == name)]
        ax.axvline(float(base["delta_ppl_pct"].iloc[0]), color="k", lw=1.2)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("ΔPPL vs full precision (%)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    handles = [plt.Line2D([], [], color="k", label="the preset itself")]
    handles += [
        plt.Rectangle((0, 0), 1, 1, color=c, label=f"lever {k}") for k, c in CHANGE_COLORS.items()
    ]
    legend_below(fig, handles=handles, ncol=4)
    return fig


def pareto_front(bits, kl) -> list[int]:
    """Indices of the points no other point beats on both axes (fewer or equal bits and a
    lower or equal KL, one of them strictly), in order of increasing bits."""
    points = sorted(range(len(bits)), key=lambda i: (bits[i], kl[i]))
    front, best = [], float("inf")
    for i in points:
        if kl[i] < best:
            front.append(i)
            best = kl[i]
    return front


PEER_MARKERS = {"hf-quanto": "s", "hf-hqq": "D", "hf-fp8": "P"}


def _headline_style(method: str, kind: str) -> dict:
    if kind == "rqlib":
        preset = method.startswith("preset:")
        return {"marker": "*" if preset else "o", "s": 170 if preset else 50, "color": "k"}
    family = method.split(":")[0]
    return {"marker": PEER_MARKERS.get(family, "X"), "s": 50, "color": "C3"}


def _headline_legend_name(method: str, kind: str) -> str:
    """The legend entry a point of the headline figure belongs to."""
    if kind == "rqlib":
        return "rqlib preset" if method.startswith("preset:") else "plain TurboQuant-MSE"
    family = method.split(":")[0]
    return family if family in PEER_MARKERS else "full precision" if method == "fp" else method


#: Where a point's label may go, in points from the point, in the order they are tried.
LABEL_OFFSETS = ((5, 4), (5, -11), (-5, 4), (-5, -11), (5, 14), (5, -21), (-5, 14), (-5, -21))


def _place_labels(ax, labels: list[str], points: list[tuple[float, float]], renderer) -> None:
    """Annotate ``points`` (data coordinates) of ``ax`` with ``labels``, each at the first of
    :data:`LABEL_OFFSETS` where it overlaps no label placed before it (the last offset when
    none is free). Call it once the figure's layout is final: the check is done on screen."""
    placed = []
    for label, point in zip(labels, points):
        for attempt, (dx, dy) in enumerate(LABEL_OFFSETS, start=1):
            text = ax.annotate(
                label,
                point,
                textcoords="offset points",
                xytext=(dx, dy),
                ha="left" if dx > 0 else "right",
                fontsize=7,
            )
            box = text.get_window_extent(renderer).padded(3)  # a gap between two labels
            if attempt == len(LABEL_OFFSETS) or not any(box.overlaps(o) for o in placed):
                break
            text.remove()
        placed.append(box)


def headline_figure(tables: Mapping[int, pd.DataFrame], title: str) -> Figure:
    """Mean KL against the stored bits per K+V coordinate, one row of panels per window
    length (``tables``: window -> :func:`rqlib.book.loaders.headline_table`); left what decode
    mode measures, right what one forward per window reports. Black: our caches (stars: the
    presets), red: the peers; the line is the Pareto front of each panel. KL is on a symlog
    axis so that a cache that reports zero is still drawn. The legend lists what is drawn, and
    no point's label is drawn over another's where a free place is near (:func:`_place_labels`)."""
    rows = len(tables)
    fig, grid = plt.subplots(rows, 2, figsize=(12.0, 4.0 * rows), squeeze=False, sharey=True)
    drawn: dict[str, dict] = {}
    labels: dict[object, tuple[list[str], list[tuple[float, float]]]] = {}
    for (window, table), axes in zip(tables.items(), grid):
        for ax, (column, mode) in zip(
            axes, (("kl", "decode mode"), ("prefill_kl", "one forward per window"))
        ):
            ax.set_yscale("symlog", linthresh=1e-3)
            for row in table.itertuples():
                style = _headline_style(row.method, row.kind)
                ax.scatter(row.bits_mean, getattr(row, column), **style)
                drawn.setdefault(_headline_legend_name(row.method, row.kind), style)
            ordered = table.sort_values(["bits_mean", column])
            labels[ax] = (
                [method.removeprefix("preset:") for method in ordered["method"]],
                list(zip(ordered["bits_mean"], ordered[column])),
            )
            front = pareto_front(table["bits_mean"].tolist(), table[column].tolist())
            picked = table.iloc[front]
            ax.step(picked["bits_mean"], picked[column], where="post", color="C0", lw=1, alpha=0.7)
            ax.set_title(f"{title}, windows of {window}: {mode}", fontsize=10)
            ax.set_xlabel("stored bits per K and V coordinate")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("mean KL(fp ‖ cache), nats")
    handles = [
        plt.Line2D(
            [], [], color=style["color"], marker=style["marker"], ms=12 if style["marker"] == "*"
            else 7, ls="", label=name,
        )
        for name, style in drawn.items()
    ]  # fmt: skip
    handles.append(plt.Line2D([], [], color="C0", label="Pareto front"))
    legend_below(fig, handles=handles, ncol=6)
    fig.canvas.draw()  # the layout is final: the labels are placed on screen
    renderer = fig.canvas.get_renderer()
    for ax, (names, points) in labels.items():
        _place_labels(ax, names, points, renderer)
    return fig
