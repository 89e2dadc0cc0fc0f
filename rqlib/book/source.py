"""Show the library's own source in a chapter, selected by markers rather than line numbers.

A chapter that explains a function shows the lines that implement it. Line numbers go stale as
soon as the file changes; a marker (a piece of text that occurs on exactly one line of the
function) moves with the code, and when it disappears the chapter fails loudly instead of
showing the wrong lines::

    show_source(triton_scores.fused_scores_kernel, start="pid_bh = tl.program_id(0)")

Both helpers accept plain functions, classes, modules and ``@triton.jit`` kernels.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MarkerError", "SourceExcerpt", "show_source"]


class MarkerError(LookupError):
    """A marker that selects no line, or more than one, of the source it is looked up in."""


@dataclass(frozen=True)
class SourceExcerpt:
    """Lines ``first``..``last`` (1-based, inclusive) of ``path`` (relative to the checkout)."""

    path: str
    first: int
    last: int
    text: str

    def markdown(self) -> str:
        """A Markdown block: the file and lines as a header, then the code."""
        lines = (
            f"line {self.first}" if self.first == self.last else f"lines {self.first}–{self.last}"
        )
        return f"`{self.path}`, {lines}\n\n```python\n{self.text}\n```"

    def _repr_markdown_(self) -> str:
        return self.markdown()


def _unwrap(obj: object) -> object:
    """The Python object whose source ``inspect`` can read (a Triton kernel wraps it)."""
    return getattr(obj, "fn", obj)


def _display_path(obj: object) -> str:
    """The source file of ``obj``, relative to the folder holding the ``rqlib`` package."""
    path = Path(inspect.getsourcefile(obj) or "").resolve()
    root = Path(__file__).resolve().parents[2]  # rqlib/book/source.py -> the package's folder
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _find(lines: list[str], marker: str, begin: int, what: str, name: str) -> int:
    """The index of the one line at or after ``begin`` that contains ``marker``."""
    if not isinstance(marker, str) or not marker.strip():
        raise ValueError(f"the {what} marker must be a non-empty string, got {marker!r}")
    hits = [i for i in range(begin, len(lines)) if marker in lines[i]]
    if not hits:
        raise MarkerError(f"the {what} marker {marker!r} is not in the source of {name}")
    if what == "start" and len(hits) > 1:
        numbers = ", ".join(str(i + 1) for i in hits)
        raise MarkerError(
            f"the start marker {marker!r} is on {len(hits)} lines of {name} "
            f"(lines {numbers} of its source): make it unique"
        )
    return hits[0]


def show_source(obj: object, start: str | None = None, stop: str | None = None) -> SourceExcerpt:
    """The source of ``obj`` from the line containing ``start`` to the line containing ``stop``.

    A cell ending with the call renders the file name, the line numbers and the code (use
    ``IPython.display.display`` to show several from one cell).

    Args:
        obj: a function, class, module or ``@triton.jit`` kernel.
        start: text on exactly one line of the source (default: the first line).
        stop: text on a line at or after the start line; the first such line ends the
            excerpt (default: the last line).

    Raises:
        MarkerError: a marker is on no line (or ``start`` on more than one), naming the marker
            and the object, so that a chapter whose code moved fails instead of showing the
            wrong lines.
    """
    target = _unwrap(obj)
    name = getattr(target, "__qualname__", getattr(target, "__name__", repr(target)))
    lines, first = inspect.getsourcelines(target)
    first = max(first, 1)  # a module's source starts at line 0
    begin = 0 if start is None else _find(lines, start, 0, "start", name)
    end = len(lines) - 1 if stop is None else _find(lines, stop, begin, "stop", name)
    text = "".join(lines[begin : end + 1]).rstrip()
    return SourceExcerpt(_display_path(target), first + begin, first + end, text)
