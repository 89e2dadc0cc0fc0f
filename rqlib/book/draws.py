"""Repeated draws of one setting in a sweep: their median, their range, and which settings
they tell apart.

A sweep that runs every setting once shows one draw of a noisy number. Perplexity over a
single window of a few hundred tokens moves when the random rotations and sketches are drawn
again (chapter 4 takes the number that draws them as a parameter), and even when the same
code runs on another CPU, whose float sums round otherwise and flip a few codes at their
decision boundaries. Run each setting several times with another draw and the spread of the
draws is the noise floor of the sweep: :func:`repeated_draws` summarizes the draws of each
setting, and :func:`told_apart` counts the pairs of settings whose ranges do not overlap, the
only ones the sweep can rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pandas as pd

from rqlib.book.results import metric_label

__all__ = ["noise_numbers", "repeated_draws", "told_apart"]


def repeated_draws(
    runs: pd.DataFrame, metric: str, keys: Sequence[str], draws: str | None
) -> pd.DataFrame:
    """One row per setting (the values of ``keys``) of ``runs``: ``metric`` as the ``median``
    of its draws (the runs that differ only in the parameter ``draws``), their ``low`` and
    ``high`` values, and ``n_draws``. ``draws`` ``None`` (or a parameter the runs do not vary):
    every run is a setting of one draw.

    Raises ``ValueError`` when a setting has a draw twice, or when the settings do not all have
    the same number of draws (a sweep cut short would mix noise floors)."""
    missing = [name for name in (metric, *keys) if name not in runs.columns]
    if missing:
        raise ValueError(f"the runs have no column {missing}: {list(runs.columns)}")
    keys = list(keys)
    if draws is None or draws not in runs.columns or runs[draws].nunique() < 2:
        if runs.duplicated(keys).any():
            raise ValueError(
                f"several runs share a setting of {keys} and no {draws!r} tells them apart"
            )
        single = runs[keys].copy()
        single["median"] = single["low"] = single["high"] = runs[metric]
        single["n_draws"] = 1
        return single.reset_index(drop=True)
    if runs.duplicated([*keys, draws]).any():
        raise ValueError(f"a setting of {keys} has a value of {draws!r} twice")
    grouped = runs.groupby(keys, sort=True)[metric]
    summary = grouped.agg(median="median", low="min", high="max", n_draws="size").reset_index()
    if summary["n_draws"].nunique() != 1:
        counts = summary["n_draws"].value_counts().to_dict()
        raise ValueError(f"the settings have different numbers of {draws!r} draws: {counts}")
    return summary


def told_apart(summary: pd.DataFrame, compared: str, within: Sequence[str]) -> tuple[int, int]:
    """``(apart, pairs)``: of the ``pairs`` of settings of :func:`repeated_draws` that share the
    values of ``within`` and differ in ``compared``, how many have ranges ``[low, high]`` that
    do not overlap (one setting's every draw below the other's every draw)."""
    apart = pairs = 0
    for _, group in summary.groupby(list(within), sort=True):
        for (_, a), (_, b) in itertools.combinations(group.iterrows(), 2):
            if a[compared] == b[compared]:
                continue
            pairs += 1
            apart += bool(a["high"] < b["low"] or b["high"] < a["low"])
    return apart, pairs


def noise_numbers(summary: pd.DataFrame, metric: str, rows: str, columns: str, panels: str) -> dict:
    """What chapter 5 says of the noise floor of a :func:`repeated_draws` summary, as glue
    values: ``n_draws``; ``spread_phrase``, the range of the draws at the median setting and at
    the widest (in units of ``metric``), or that each setting was drawn once; and
    ``apart_phrase``, how many pairs of ``columns`` values at the same ``rows`` and ``panels``
    the ranges tell apart (:func:`told_apart`)."""
    n_draws = int(summary["n_draws"].iloc[0])
    if n_draws < 2:
        return {
            "n_draws": n_draws,
            "spread_phrase": "Each setting of these runs was drawn once, so this page cannot show "
            "how far a setting moves when it is drawn again: sweep each setting with other "
            "draws of its rotations too, as make sweep does",
            "apart_phrase": "with one draw a setting, no comparison can be trusted to the last "
            "digit shown",
        }
    spread = summary["high"] - summary["low"]
    widest = summary.loc[spread.idxmax()]
    apart, pairs = told_apart(summary, columns, [rows, panels])
    where = ", ".join(f"{name} = {widest[name]}" for name in (rows, columns, panels))
    return {
        "n_draws": n_draws,
        "spread_phrase": f"Their range, in {metric_label(metric)}, is {spread.median():.3g} at "
        f"the median setting and {spread.max():.3g} at the widest ({where}, around a median "
        f"of {widest['median']:.3g})",
        "apart_phrase": f"of the {pairs} pairs of {columns} values at the same {rows} and "
        f"{panels}, {apart} do",
    }
