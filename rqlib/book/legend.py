"""The legend of the spec language and of the ablation levers, generated from the code.

One source of truth: the tokens and what they do are :data:`rqlib.spec.config.SPEC_TOKENS`,
next to the parser; the methods are :data:`rqlib.spec.config.METHODS`; the presets are
:data:`rqlib.spec.presets.PRESETS`; the levers of an ablation, with the change each makes, are
:data:`rqlib.study.experiments.LEVERS`. :func:`legend_text` is the epilog of
``python -m rqlib eval --help``; :func:`spec_table` and :func:`lever_table` are the tables
chapter 4 shows.
"""

from __future__ import annotations

import textwrap

import pandas as pd

from rqlib.spec.config import METHODS, SPEC_TOKENS
from rqlib.spec.presets import PRESETS
from rqlib.study.experiments import LEVERS

__all__ = ["legend_text", "lever_table", "spec_table"]


def spec_table() -> pd.DataFrame:
    """One row per spec token: ``token`` (its forms) and ``meaning``."""
    return pd.DataFrame(
        [{"token": forms, "meaning": meaning} for forms, meaning in SPEC_TOKENS.values()]
    )


def lever_table() -> pd.DataFrame:
    """One row per ablation lever: ``lever`` (the name the ablation figure shows),
    ``change`` (removed, swapped or added) and ``meaning``."""
    return pd.DataFrame(
        [
            {"lever": lever.name, "change": lever.change, "meaning": lever.description}
            for lever in LEVERS.values()
        ]
    )


def _rows(pairs: list[tuple[str, str]], width: int) -> list[str]:
    column = max(len(left) for left, _ in pairs) + 2
    lines = []
    for left, right in pairs:
        wrapped = textwrap.wrap(right, max(width - column - 2, 30)) or [""]
        lines.append(f"  {left.ljust(column)}{wrapped[0]}")
        lines.extend(" " * (column + 2) + more for more in wrapped[1:])
    return lines


def legend_text(width: int = 100) -> str:
    """The spec language, the presets and the ablation levers as plain text for ``--help``."""
    lines = [
        "Method specs: METHOD[:TOKEN]... or preset:NAME[:TOKEN]...",
        f"  METHOD: {', '.join(METHODS)} (values use the -mse quantizer of the family)",
        "Tokens:",
        *_rows([(forms, meaning) for forms, meaning in SPEC_TOKENS.values()], width),
        "Presets:",
        *_rows([(f"preset:{name}", spec) for name, spec in PRESETS.items()], width),
        "Ablation levers (python -m rqlib experiment --levers; the names of chapter 4's ablation):",
        *_rows([(f"{n} ({v.change})", v.description) for n, v in LEVERS.items()], width),
    ]
    return "\n".join(lines)
