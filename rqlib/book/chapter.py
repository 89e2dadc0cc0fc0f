"""One run of a chapter: typed parameters, glued numbers and figures, its cost, its results file.

Every chapter starts with ``run = Chapter("04_perplexity", globals())`` right after its
``parameters`` cell and ends with ``run.finish(prov)``. In between:

- ``run.parameters`` holds the values of the parameters cell after papermill's overrides,
  each checked against the type annotation of its line (``tokens: int = 512  # ...``), the
  same annotation ``papermill --help-notebook`` shows; ``run.as_list("key_bits")`` accepts one
  value or a list for a ``list[...]`` parameter;
- ``run.glue(...)`` hands numbers and sentences to the prose (myst-nb ``glue``) and keeps them
  as the run's metrics; ``run.figure(name, fig)`` glues a figure for a numbered, captioned
  ``{glue:figure}`` directive, and ``run.show(name)``, in a cell tagged ``remove-cell`` right
  after, displays it in the notebook too (Jupyter, papermill outputs, ``python -m rqlib
  render``) while the book shows it once, numbered, where the directive stands;
- the first markdown cell opens, right under the title, with the admonition
  ``{admonition} Learning objectives and prerequisites`` (``:class: tip``; a paragraph
  "**After this chapter you can** ..." and one "**Prerequisites:** ...", linking the notation
  table and the glossary), the pattern ``tests/test_book_teaching.py`` checks;
- ``run.finish(prov)`` measures the run's wall-clock time and glues the note at the top of the
  chapter (time, device, whether the parameters were the defaults, what the chapter's GPU
  parameter file needs), then saves the results file when ``run_id`` is set.
"""

from __future__ import annotations

import ast
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rqlib.base.paths import repo_root
from rqlib.book.results import glue_metrics, save_result

__all__ = [
    "SHOW_TAG",
    "Chapter",
    "chapter_path",
    "format_duration",
    "gpu_needs",
    "parameter_specs",
    "placed_figures",
    "slug",
]

#: Parameters of hub models named by the GPU parameter files, from their model cards: what
#: their weights occupy in fp32 (``rqlib.hf.models.load_model`` loads fp32 by default).
HUB_MODEL_PARAMETERS = {"Qwen/Qwen2.5-3B-Instruct": 3.09e9}

#: The tag of the cells that call :meth:`Chapter.show` (the book removes them; Jupyter and
#: ``python -m rqlib render`` show their figures).
SHOW_TAG = "remove-cell"

_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def slug(*parts: object) -> str:
    """A glue name made of ``parts``: lower case, each run of other characters one ``_``
    (``slug("turboquant-prod (gaussian)", "kl")`` is ``"turboquant_prod_gaussian_kl"``)."""
    text = "_".join(str(part) for part in parts).lower()
    return re.sub(r"[^a-z0-9]+", "_", text).strip("_")


def chapter_path(name: str) -> Path:
    """``notebooks/<name>.ipynb`` of the checkout, wherever the chapter runs from."""
    path = repo_root() / "notebooks" / f"{name}.ipynb"
    if not path.is_file():
        raise FileNotFoundError(f"chapter {name!r} not found: {path} does not exist")
    return path


def placed_figures(name: str) -> list[str]:
    """The glue names of the ``{glue:figure}`` directives of chapter ``name``, in order."""
    import nbformat

    notebook = nbformat.read(chapter_path(name), as_version=4)
    prose = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    return re.findall(r"^`{3,}\{glue:figure\}\s+(\w+)", prose, re.M)


def parameter_specs(name: str) -> dict[str, dict[str, Any]]:
    """The chapter's parameters: name -> ``{"type": "int", "default": 512, "help": ...}``.

    Read from the ``parameters`` cell as papermill reads it; a parameter without a type
    annotation is an error (``papermill --help-notebook`` would say "Unknown type").
    """
    from rqlib.book.sweep import notebook_parameters

    specs = {}
    for parameter, found in notebook_parameters(chapter_path(name)).items():
        kind = found["inferred_type_name"]
        if kind == "None":
            raise ValueError(f"{name}: parameter {parameter!r} has no type annotation")
        specs[parameter] = {
            "type": kind,
            "default": ast.literal_eval(found["default"]),
            "help": found["help"],
        }
    return specs


def _check_value(name: str, kind: str, value: Any) -> None:
    """Raise ``TypeError`` naming the parameter when ``value`` does not fit ``kind``."""

    def fits(scalar: str, item: Any) -> bool:
        expected = _SCALARS[scalar]
        if expected is bool:
            return isinstance(item, bool)
        if isinstance(item, bool):
            return False
        if expected is float:
            return isinstance(item, (int, float))
        return isinstance(item, expected)

    if kind in _SCALARS:
        ok = fits(kind, value)
    elif kind.startswith("list[") and kind.endswith("]") and kind[5:-1] in _SCALARS:
        item_kind = kind[5:-1]
        items = value if isinstance(value, list) else [value]
        ok = bool(items) and all(fits(item_kind, item) for item in items)
    else:
        raise ValueError(f"parameter {name!r} has an annotation rqlib cannot check: {kind}")
    if not ok:
        raise TypeError(
            f"parameter {name} must be {kind} (one value or a non-empty list for a list), "
            f"got {value!r}; with papermill pass lists as YAML: -y '{name}: [...]'"
        )


def format_duration(seconds: float) -> str:
    """``"48 s"``, ``"3 min 12 s"``: a wall-clock time as a reader says it."""
    if seconds < 0:
        raise ValueError(f"seconds must be >= 0, got {seconds!r}")
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole} s"
    return f"{whole // 60} min {whole % 60:02d} s"


def gpu_needs(name: str) -> str:
    """What ``params/<name>-gpu.yaml`` needs, in a sentence: a CUDA device, hub access for a
    model that is not packaged, and the memory of its fp32 weights (or the largest fp16
    cache the kernel benchmark times); a chapter without a GPU file needs none."""
    import yaml

    path = repo_root() / "params" / f"{name}-gpu.yaml"
    if not path.is_file():
        return "It has no GPU parameter file: it needs no GPU."
    defaults = {p: spec["default"] for p, spec in parameter_specs(name).items()}
    values = {**defaults, **(yaml.safe_load(path.read_text()) or {})}
    parts = ["a CUDA GPU"]
    model = values.get("model_name")
    if model is not None:
        from rqlib.hf.models import PACKAGED_MODELS

        if model not in PACKAGED_MODELS:
            parts.append(f"access to the Hugging Face hub to download {model}")
            count = HUB_MODEL_PARAMETERS.get(model)
            if count is not None:
                parts.append(f"about {4 * count / 1e9:.0f} GB of GPU memory for its fp32 weights")
    if "kv_lens" in values:  # the kernel benchmark: one layer's fp16 K and V, batch 1
        largest = max(values["kv_lens"]) * values["kv_heads"] * values["head_dim"] * 2 * 2
        parts.append(f"{largest / 1e9:.1f} GB for the fp16 keys and values of its longest context")
    listed = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
    return f"The GPU parameter file {path.relative_to(repo_root()).as_posix()} needs {listed}."


class Chapter:
    """One run of a chapter (see the module docstring)."""

    def __init__(self, name: str, namespace: Mapping[str, Any], *, cpu_threads: int = 0):
        """Read and check the parameters of chapter ``name`` from ``namespace`` (the
        notebook's ``globals()``), start the clock, and with ``cpu_threads > 0`` set torch's
        CPU threads (one thread is fastest on a small shared machine)."""
        self.name = name
        self.started = time.perf_counter()
        self.specs = parameter_specs(name)
        missing = [p for p in self.specs if p not in namespace]
        if missing:
            raise NameError(f"{name}: the parameters cell did not define {missing}")
        self.parameters = {p: namespace[p] for p in self.specs}
        for parameter, spec in self.specs.items():
            _check_value(parameter, spec["type"], self.parameters[parameter])
        if cpu_threads:
            import torch

            torch.set_num_threads(cpu_threads)
        self.metrics: dict[str, Any] = {}
        self.figures: dict[str, Any] = {}

    def as_list(self, parameter: str) -> list:
        """A ``list[...]`` parameter as a list, whether it was given as one value or a list."""
        if not self.specs[parameter]["type"].startswith("list["):
            raise TypeError(f"{parameter} is not a list parameter")
        value = self.parameters[parameter]
        return list(value) if isinstance(value, list) else [value]

    def changed(self) -> dict[str, Any]:
        """The parameters whose values differ from the defaults of the parameters cell."""
        return {
            p: v
            for p, v in self.parameters.items()
            if p != "run_id" and v != self.specs[p]["default"]
        }

    def glue(self, values: Mapping[str, Any] | None = None, /, **more: Any) -> None:
        """Glue numbers and sentences for the prose and keep them as metrics of the run."""
        values = {**(values or {}), **more}
        clash = set(values) & set(self.metrics)
        if clash:
            raise ValueError(f"{self.name}: glue names used twice: {sorted(clash)}")
        glue_metrics(values)
        self.metrics.update(values)

    def figure(self, name: str, fig) -> None:
        """Glue a matplotlib figure under ``name`` for a ``{glue:figure}`` directive (which
        numbers and captions it), keep it for :meth:`show`, and close it so that the inline
        backend does not draw it a second time."""
        import matplotlib.pyplot as plt
        from myst_nb import glue

        glue(name, fig, display=False)
        self.figures[name] = fig
        plt.close(fig)

    def show(self, *names: str) -> None:
        """Display the figures glued under ``names`` in the notebook itself, so that a
        papermill output opened in Jupyter shows them (a glue alone is invisible there).

        The cell calling it carries the ``remove-cell`` tag (:data:`SHOW_TAG`): the book
        shows each figure once, where its ``{glue:figure}`` directive numbers it. A name the
        chapter places nowhere is an error; a figure whose cell a parameter switched off is
        said so in one line.
        """
        from IPython.display import display

        placed = placed_figures(self.name)
        for name in names:
            if name not in placed:
                raise KeyError(f"{self.name}: no {{glue:figure}} {name} in the chapter")
            if name in self.figures:
                display(self.figures[name])
            else:
                print(f"{name}: not drawn in this run (its section was switched off)")

    def finish(self, provenance, tables=None) -> Path | None:
        """Glue the chapter's cost note; save the results file when ``run_id`` is set.

        Glued: ``run_time`` (e.g. ``"52 s"``), ``run_device``, ``run_setting`` (default
        parameters or which ones changed) and ``gpu_needs``.
        """
        seconds = time.perf_counter() - self.started
        changed = self.changed()
        setting = (
            "with its default parameters"
            if not changed
            else "with " + ", ".join(f"{p} = {v!r}" for p, v in changed.items())
        )
        note = {
            "run_time": format_duration(seconds),
            "run_device": provenance.device,
            "run_setting": setting,
            "gpu_needs": gpu_needs(self.name),
        }
        glue_metrics(note)
        run_id = self.parameters.get("run_id", "")
        if not run_id:
            return None
        metrics = {n: v for n, v in self.metrics.items() if isinstance(v, (int, float, str))}
        metrics["run_seconds"] = seconds
        parameters = {p: v for p, v in self.parameters.items() if p != "run_id"}
        return save_result(
            self.name,
            run_id,
            parameters=parameters,
            metrics=metrics,
            provenance=provenance,
            tables=tables,
        )
