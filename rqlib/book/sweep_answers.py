"""The numbers of chapter 5's worked solutions, computed from the sweep it plots.

- :func:`ranking_agreement`: do two metrics rank the values of one parameter (the methods)
  the same way, setting by setting (exercise 5.1)?
- :func:`panel_effect`: what the parameter that separates the panels (the exact window) does
  to each method at each number of bits (exercise 5.2).

Both work on medians over repeated draws (:func:`rqlib.book.draws.repeated_draws`) and return
glue values: counts and phrases whose numbers come from the runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from rqlib.book.draws import repeated_draws
from rqlib.book.results import metric_label

__all__ = ["other_metric", "panel_effect", "ranking_agreement"]

#: The two error metrics chapter 4 saves for every run: ΔPPL % and the KL, each other's check.
PAIRED_METRICS = ("delta_ppl_pct", "kl")


def other_metric(metric: str) -> str:
    """The metric exercise 5.1 compares ``metric`` with: the KL for ΔPPL, ΔPPL for the rest."""
    return PAIRED_METRICS[1] if metric == PAIRED_METRICS[0] else PAIRED_METRICS[0]


def _order(group: pd.DataFrame, columns: str) -> tuple:
    return tuple(group.sort_values(["median", columns])[columns])


def ranking_agreement(
    runs: pd.DataFrame,
    metrics: Sequence[str],
    keys: Sequence[str],
    draws: str | None,
) -> dict:
    """Of the settings of ``keys[0]`` (rows) and ``keys[2]`` (panels), in how many do the two
    ``metrics`` order the values of ``keys[1]`` (columns) the same way, best first, by the
    median of their draws? Glue values: ``rank_settings``, ``rank_agree`` and
    ``rank_phrase`` (where the orders differ, both orders; or that they never do)."""
    first, second = metrics
    rows, columns, panels = keys
    summaries = [repeated_draws(runs, metric, list(keys), draws) for metric in (first, second)]
    orders = []
    for summary in summaries:
        grouped = summary.groupby([rows, panels], sort=True)
        orders.append({setting: _order(group, columns) for setting, group in grouped})
    differ = [setting for setting in orders[0] if orders[0][setting] != orders[1][setting]]
    names = (metric_label(first), metric_label(second))
    if not differ:
        phrase = f"the two orders of {columns} never differ here"
    else:
        examples = []
        for setting in differ[:3]:
            where = f"{rows} = {setting[0]}, {panels} = {setting[1]}"
            examples.append(
                f"at {where}, {names[0]} orders them {' < '.join(map(str, orders[0][setting]))} "
                f"and {names[1]} {' < '.join(map(str, orders[1][setting]))}"
            )
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        phrase = f"they differ in {len(differ)}: " + "; ".join(examples) + more
    settings = len(orders[0])
    return {"rank_settings": settings, "rank_agree": settings - len(differ), "rank_phrase": phrase}


def panel_effect(summary: pd.DataFrame, metric: str, keys: Sequence[str]) -> dict:
    """What going from the smallest to the largest value of ``keys[2]`` (panels) does to the
    median of ``metric`` for each value of ``keys[1]`` (columns) at the smallest ``keys[0]``
    (rows), from a :func:`rqlib.book.draws.repeated_draws` summary. Glue values:
    ``panel_low``, ``panel_high``, ``panel_rows_value`` and ``panel_phrase``."""
    rows, columns, panels = keys
    low, high = summary[panels].min(), summary[panels].max()
    at = summary[summary[rows] == summary[rows].min()]
    label = metric_label(metric)
    if low == high:
        phrase = f"every run has {panels} = {low}, so these runs cannot say what it does"
    else:
        parts = []
        for value, group in at.groupby(columns, sort=True):
            before = group.loc[group[panels] == low, "median"]
            after = group.loc[group[panels] == high, "median"]
            if before.empty or after.empty:
                continue
            parts.append(f"{value} from {before.iloc[0]:.3g} to {after.iloc[0]:.3g}")
        phrase = f"{label} goes " + "; ".join(parts) if parts else "no method has both panels"
    return {
        "panel_low": str(low),
        "panel_high": str(high),
        "panel_rows_value": str(summary[rows].min()),
        "panel_phrase": phrase,
    }
