"""Figures of chapter 1 (derivation): coordinate law, codebook, distortion, estimator slopes,
QJL variance, outlier channels."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from matplotlib.figure import Figure

from rqlib.book.checks import Interval, SlopeDraws
from rqlib.book.figures import legend_below, subplots
from rqlib.core import theory
from rqlib.core.codebooks import Codebook

__all__ = [
    "channel_rms_figure",
    "codebook_figure",
    "coordinate_law_figure",
    "distortion_figure",
    "qjl_figure",
    "slopes_figure",
]


def coordinate_law_figure(samples: Mapping[int, np.ndarray]) -> Figure:
    """Histograms of rotated coordinates, one panel per dimension, against the Beta law and
    its Gaussian limit."""
    fig, axes = subplots(len(samples), height=3.0)
    for ax, (d, values) in zip(axes, samples.items()):
        half_width = min(1.0, 5 / math.sqrt(d))
        t = np.linspace(-half_width, half_width, 801)
        ax.hist(values, bins=80, density=True, alpha=0.5, label="rotated $e_j$")
        ax.plot(t, theory.coordinate_density(t, d), label="Beta law $f_d$")
        ax.plot(t, theory.gaussian_coordinate_density(t, d), "--", label=r"$\mathcal{N}(0, 1/d)$")
        ax.set_xlim(-half_width, half_width)
        ax.set_title(f"d = {d}")
        ax.set_xlabel("coordinate value")
    axes[0].set_ylabel("density")
    legend_below(fig)
    return fig


def codebook_figure(codebook: Codebook, d: int) -> Figure:
    """The coordinate density with the codebook's boundaries and centroids."""
    fig, (ax,) = subplots(1, width=7, height=2.8)
    t = np.linspace(-4 / math.sqrt(d), 4 / math.sqrt(d), 801)
    ax.plot(t, theory.coordinate_density(t, d), color="k", label=f"$f_{{{d}}}$")
    for j, boundary in enumerate(codebook.boundaries):
        ax.axvline(boundary, color="grey", lw=0.8, ls=":", label="boundaries" if j == 0 else None)
    ax.plot(codebook.centroids, np.zeros_like(codebook.centroids), "o", label="centroids")
    ax.set_xlabel("coordinate value")
    ax.set_ylabel("density")
    legend_below(fig)
    return fig


def distortion_figure(
    bits: np.ndarray,
    exact: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    measured: Mapping[int, float],
) -> Figure:
    """Distortion of a unit vector against the bit width: exact, measured, both bounds."""
    fig, (ax,) = subplots(1, width=6.5, height=3.6)
    ax.semilogy(bits, upper, "^--", label=r"upper bound $(\sqrt{3}\pi/2)\,4^{-b}$")
    ax.semilogy(bits, exact, "o-", label="Lloyd–Max, exact")
    ax.semilogy(list(measured), list(measured.values()), "x", ms=10, label="measured")
    ax.semilogy(bits, lower, "v--", label="lower bound $4^{-b}$")
    ax.set_xlabel("bits per coordinate $b$")
    ax.set_ylabel(r"$D_{\mathrm{mse}}$")
    legend_below(fig, ncol=2)
    return fig


def slopes_figure(
    draws: Mapping[tuple[str, int], SlopeDraws],
    intervals: Mapping[tuple[str, int], Interval],
    shrinkage: Mapping[int, float],
    shown_bits: int,
) -> Figure:
    """Left: the estimate averaged over the draws against the truth, per fixed pair, at
    ``shown_bits``. Right: each estimator's mean slope and interval against the bit width,
    with the predictions 1 (QJL) and 1 - D (MSE)."""
    fig, (left, right) = subplots(2, width=5.2, height=3.6)
    styles = {"turboquant-mse": ("C0", "MSE"), "turboquant-prod": ("C1", "QJL")}
    for (method, bits), result in draws.items():
        if bits != shown_bits:
            continue
        color, name = styles[method]
        left.plot(result.truth, result.mean_estimate, ".", ms=3, color=color, label=name)
    line = np.array([-1.0, 1.0]) * float(np.abs(next(iter(draws.values())).truth).max())
    left.plot(line, line, "k--", lw=1, label="slope 1")
    left.plot(line, shrinkage[shown_bits] * line, "C0:", lw=1, label="slope $1 - D$")
    left.set_xlabel(r"truth $\langle q, k\rangle$ (fixed pairs)")
    left.set_ylabel("estimate, averaged over the draws")
    plural = "" if shown_bits == 1 else "s"
    left.set_title(f"{shown_bits} bit{plural} per coordinate", fontsize=10)
    for offset, method in zip((-0.08, 0.08), styles):
        color, name = styles[method]
        found = sorted((b, i) for (m, b), i in intervals.items() if m == method)
        x = np.array([b for b, _ in found]) + offset
        y = np.array([i.estimate for _, i in found])
        err = np.array([i.half_width for _, i in found])
        right.errorbar(x, y, yerr=err, fmt="o", color=color, capsize=3)
    bits = sorted(shrinkage)
    right.plot(bits, [shrinkage[b] for b in bits], "C0_", ms=18, mew=1.5, label="$1 - D(b)$")
    right.axhline(1.0, color="k", ls="--", lw=1)
    right.set_xticks(bits)
    right.set_xlabel("bits per coordinate $b$")
    right.set_ylabel("slope of estimate on truth")
    handles, _ = left.get_legend_handles_labels()
    handles += right.get_legend_handles_labels()[0]
    legend_below(fig, handles=handles, ncol=5)
    return fig


def qjl_figure(
    errors: Mapping[str, np.ndarray], variance: Mapping[tuple[str, int], float], bits: int
) -> Figure:
    """Left: score errors at ``bits`` per coordinate (label -> errors). Right: the QJL
    estimator's mean squared error over its bound, per sketch and sketch size."""
    fig, (left, right) = subplots(2, width=5.2, height=3.6)
    spread = max(float(np.quantile(np.abs(e), 0.999)) for e in errors.values())
    bins = np.linspace(-spread, spread, 81)
    for label, values in errors.items():
        left.hist(values, bins=bins, histtype="step", label=label)
    left.set_xlabel("estimate − truth")
    left.set_ylabel("pairs")
    left.set_title(f"{bits} bits per coordinate", fontsize=10)
    for sketch, style in (("gaussian", "o-"), ("orthogonal", "s-")):
        rows = sorted((m, r) for (s, m), r in variance.items() if s == sketch)
        right.plot([m for m, _ in rows], [r for _, r in rows], style, label=f"{sketch} sketch")
    right.axhline(1.0, color="k", ls="--", lw=1, label=r"bound $\pi/(2m)\,\|q\|^2\|r\|^2$")
    right.set_xscale("log", base=2)
    right.set_xlabel("sketch rows $m$")
    right.set_ylabel("mean squared error / bound")
    right.set_ylim(0, 1.2)
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    legend_below(fig, handles=handles, ncol=3)
    return fig


def channel_rms_figure(rms: Mapping[str, torch.Tensor]) -> Figure:
    """Root-mean-square of each key channel, one panel per rotation (name -> [channels])."""
    fig, axes = subplots(len(rms), width=4.3, height=3.0, sharey=True)
    for ax, (name, values) in zip(axes, rms.items()):
        ax.bar(np.arange(values.numel()), values.numpy(), width=1.0)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("channel")
    axes[0].set_ylabel("RMS over tokens and heads")
    fig.tight_layout()
    return fig
