"""What a course needs from every chapter: learning objectives and prerequisites at the top,
and under every exercise a worked solution whose numbers are computed or glued, not typed."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_BLOCK = re.compile(r"```\{admonition\} (?P<title>[^\n]*)\n(?P<body>.*?)\n```", re.S)


def prose(path: Path) -> str:
    notebook = nbformat.read(path, as_version=4)
    return "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")


def exercises(path: Path) -> list[tuple[str, str]]:
    """``(exercise title, its solution's body)`` for each exercise, in order; a missing
    solution is an empty body."""
    text = prose(path)
    blocks = list(_BLOCK.finditer(text[text.index("## Exercises") :]))
    found = []
    for i, block in enumerate(blocks):
        if block["title"].startswith("Exercise"):
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            solved = after is not None and after["title"] == "Solution"
            body = after["body"] if solved else ""
            found.append((block["title"], body.replace(":class: dropdown", "", 1).strip()))
    return found


def typed_numbers(text: str) -> list[str]:
    """Decimal numbers and percentages typed into prose: outside glue roles, inline code and
    math (a glued or computed number arrives through a role; ``0.125`` typed does not)."""
    for pattern in (r"\{glue:\w*\}`[^`]*`", r"`[^`]*`", r"\$\$.*?\$\$", r"\$[^$]*\$"):
        text = re.sub(pattern, " ", text, flags=re.S)
    return re.findall(r"\d+\.\d+|\d+\s?%", text)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_exercise_has_a_worked_solution_with_computed_numbers(path):
    found = exercises(path)
    assert found, f"{path.name} has no exercises"
    for title, solution in found:
        assert len(solution.split()) >= 15, f"{path.name}: {title!r} has no worked solution"
        typed = typed_numbers(solution)
        assert not typed, f"{path.name}: the solution of {title!r} types {typed}: glue them"


def test_the_checks_see_a_missing_solution_and_a_typed_number():
    assert typed_numbers("costs 0.125 bits, {glue:text}`x:.3f` and $1 - 0.5$") == ["0.125"]
    assert typed_numbers("a gain of 12 % in `k=3.5`") == ["12 %"]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_opens_with_objectives_and_prerequisites(path):
    notebook = nbformat.read(path, as_version=4)
    first = notebook.cells[0].source
    match = re.search(
        r"```\{admonition\} Learning objectives and prerequisites\n:class: tip\n\n"
        r"\*\*After this chapter you can\*\* (.+?)\n\n\*\*Prerequisites:\*\* (.+?)\n```",
        first,
        re.S,
    )
    assert match, f"{path.name}: the first cell lacks the objectives admonition"
    assert all(len(part.split()) >= 8 for part in match.groups())
    assert first.index("Learning objectives") < first.index("**Running this chapter.**")


#: Phrases that tell the project's own history rather than the subject.
HISTORY_PHRASES = ("the accuracy work", "before this text was read", "a miss stays a miss")


def test_the_book_does_not_tell_its_own_history():
    sources = [*CHAPTERS, *(ROOT / "book").glob("*.md"), ROOT / "README.md"]
    for path in sources:
        text = " ".join(path.read_text().lower().split())
        found = [phrase for phrase in HISTORY_PHRASES if phrase in text]
        assert not found, f"{path.name} says {found}"
