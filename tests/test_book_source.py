"""Showing library source in a chapter (rqlib.book.source): markers select lines, and a marker
that selects nothing, or a start marker that selects more than one line, is an error."""

import inspect

import pytest

from rqlib.book.source import MarkerError, show_source
from rqlib.core import theory
from rqlib.kernels import triton_common


def test_whole_function_with_its_file_and_line_numbers():
    excerpt = show_source(theory.mse_shrinkage)
    lines, first = inspect.getsourcelines(theory.mse_shrinkage)
    assert excerpt.path == "rqlib/core/theory.py"
    assert (excerpt.first, excerpt.last) == (first, first + len(lines) - 1)
    assert excerpt.text == "".join(lines).rstrip()
    markdown = excerpt._repr_markdown_()
    assert markdown.startswith(f"`rqlib/core/theory.py`, lines {first}–{excerpt.last}")
    assert "```python\ndef mse_shrinkage(" in markdown


def test_markers_select_the_lines_between_them():
    lines, first = inspect.getsourcelines(theory.coordinate_density)
    start = next(i for i, line in enumerate(lines) if "log_norm =" in line)
    stop = next(i for i, line in enumerate(lines) if "density = np.exp" in line)
    excerpt = show_source(theory.coordinate_density, start="log_norm =", stop="density = np.exp")
    assert excerpt.text == "".join(lines[start : stop + 1]).rstrip()
    assert (excerpt.first, excerpt.last) == (first + start, first + stop)


def test_a_missing_or_ambiguous_marker_fails_loudly():
    with pytest.raises(MarkerError, match="'no such line'.*coordinate_density"):
        show_source(theory.coordinate_density, start="no such line")
    with pytest.raises(MarkerError, match="stop marker 'no such line'"):
        show_source(theory.coordinate_density, stop="no such line")
    # "np." occurs on several lines: a start marker must name one line
    with pytest.raises(MarkerError, match="make it unique"):
        show_source(theory.coordinate_density, start="np.")
    with pytest.raises(ValueError, match="non-empty"):
        show_source(theory.coordinate_density, start="")


def test_a_triton_kernel_shows_its_python_source():
    excerpt = show_source(triton_common.load_signs)
    assert excerpt.path == "rqlib/kernels/triton_common.py"
    assert "def load_signs(" in excerpt.text
