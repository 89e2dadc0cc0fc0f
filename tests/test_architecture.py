"""The package's layers: imports point one way only, and there is no import cycle.

Layers, lowest first (a module may import its own layer and the layers below it):

    base -> core -> spec -> kernels -> hf -> study -> book -> cli

Every ``import`` statement counts, including imports inside functions: a lazy import hides a
dependency from a reader, not from this test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import rqlib

PACKAGE = Path(rqlib.__file__).resolve().parent
LAYERS = ("base", "core", "spec", "kernels", "hf", "study", "book", "cli")
#: ``rqlib`` itself is the front door: its lazy ``rqlib.compress`` reaches ``study``.
TOP_LEVEL = {"rqlib": "cli", "rqlib.cli": "cli", "rqlib.__main__": "cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    layer = module.split(".")[1]
    assert layer in LAYERS, f"{module} is in no layer; the layers are {LAYERS}"
    return layer


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The rqlib modules ``path`` imports (``from rqlib.a import b`` names module ``rqlib.a.b``
    when that is a module, else ``rqlib.a``)."""
    found = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("rqlib"):
                found.add(name)
                break
    found.discard(module_name(path))
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imported_modules(path, known) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def test_every_module_belongs_to_a_layer():
    for name in modules():
        layer_of(name)


def test_imports_point_down_the_layers():
    violations = [
        f"{source} ({layer_of(source)}) imports {target} ({layer_of(target)})"
        for source, targets in import_graph().items()
        for target in sorted(targets)
        if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(source))
    ]
    assert not violations, "\n".join(violations)


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    # the checks above must be able to fail: a spec module importing hf, and a cycle
    graph = import_graph()
    graph["rqlib.spec.config"] = graph["rqlib.spec.config"] | {"rqlib.hf.cache"}
    upward = [
        (s, t)
        for s, ts in graph.items()
        for t in ts
        if LAYERS.index(layer_of(t)) > LAYERS.index(layer_of(s))
    ]
    assert ("rqlib.spec.config", "rqlib.hf.cache") in upward
    graph["rqlib.core.packing"] = graph["rqlib.core.packing"] | {"rqlib.core.quantizers"}
    assert any({"rqlib.core.packing", "rqlib.core.quantizers"} <= set(c) for c in cycles(graph))


@pytest.mark.parametrize(
    "modules",
    [
        "rqlib.spec.config",
        "rqlib.spec.presets, rqlib.spec.bits, rqlib.spec.codecs, rqlib.spec.geometry",
    ],
)
def test_the_config_and_spec_modules_do_not_import_transformers(modules):
    code = f"import sys, {modules}; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
