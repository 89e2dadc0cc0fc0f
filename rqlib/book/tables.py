"""Tables as the book shows them: readable headers, fixed formats, short spec columns.

A compression spec can run to hundreds of characters (a preset lists the bits of every layer),
so a table never shows one in a column: :func:`with_spec_notes` replaces each spec by a short
reference (``[1]``, ``[2]``, ...) and returns the specs as numbered notes to print under the
table.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
from IPython.display import Markdown

__all__ = ["styled", "with_spec_notes"]


def styled(
    frame: pd.DataFrame,
    headers: Mapping[str, str],
    formats: Mapping[str, str] | None = None,
    *,
    caption: str | None = None,
    index: bool = False,
):
    """The columns ``headers`` names (in that order), renamed to their readable headers and
    formatted with ``formats`` (readable header -> format spec such as ``"{:.3f}"``).

    Raises ``KeyError`` naming the columns ``frame`` lacks.
    """
    missing = [name for name in headers if name not in frame.columns]
    if missing:
        raise KeyError(f"the table has no columns {missing}; it has {list(frame.columns)}")
    shown = frame[list(headers)].rename(columns=dict(headers))
    style = shown.style.format(dict(formats or {}), na_rep="—")
    if not index:
        style = style.hide(axis="index")
    if caption:
        style = style.set_caption(caption)
    return style


def with_spec_notes(
    frame: pd.DataFrame,
    column: str = "spec",
    *,
    header: str = "spec",
    title: str = "Specs of the table (`python -m rqlib eval --method SPEC`):",
) -> tuple[pd.DataFrame, Markdown]:
    """Replace the long texts (specs, commands) in ``column`` by references ``[1]``, ``[2]``,
    ... (one per distinct text, in order of appearance) in a column named ``header``, and
    return them as a numbered Markdown list under ``title``, to show under the table."""
    if column not in frame.columns:
        raise KeyError(f"the table has no column {column!r}")
    numbers: dict[str, int] = {}
    for spec in frame[column]:
        if isinstance(spec, str) and spec not in numbers:
            numbers[spec] = len(numbers) + 1
    shown = frame.drop(columns=[column]).assign(
        **{header: [f"[{numbers[s]}]" if isinstance(s, str) else "" for s in frame[column]]}
    )
    notes = "\n".join(f"{n}. `{spec}`" for spec, n in numbers.items())
    return shown, Markdown(f"{title}\n\n{notes}")
