"""Read the PTX Triton emits for a GPU, without a GPU: compile, annotate, fold, excerpt.

Chapter 3 shows the inner loop of a kernel compiled for sm_90. The steps:

1. :func:`compile_ptx` compiles one specialization of :func:`rqlib.kernels.aot.specializations`
   in a subprocess (a chapter that runs kernels in the Triton interpreter cannot compile them
   itself: an interpreted function is not a ``JITFunction``) and returns the PTX lines with
   the cubin's register, spill and shared-memory usage.
2. :func:`inner_loop` cuts out the first loop LLVM marks ``Inner Loop Header``, up to its
   back edge.
3. :func:`annotate` replaces each ``.loc`` directive by the source line it points to and drops
   blank lines and inline-asm markers; :func:`fold` folds a block of one to three instructions
   repeated with the same opcodes (one copy per element a thread owns) into its first copy,
   marked ``x N``.
4. :func:`loop_excerpt` keeps the loop's head and tail, selected by markers that fail loudly
   when the compiler's output no longer contains them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CompiledPTX",
    "annotate",
    "compile_env",
    "compile_ptx",
    "fold",
    "inner_loop",
    "loop_counts",
    "loop_excerpt",
    "opcode",
]

_LOC = re.compile(r"\.loc\s.*// (?P<file>[\w.]+\.py):(?P<line>\d+):\d+")

#: Instructions counted by :func:`loop_counts`: what the chapter's prose reads off the loop.
COUNTED = {
    "fma": "fma.rn.f32",
    "byte_loads": "ld.global.b8",
    "async_copies": "cp.async.ca.shared.global",
}


@dataclass(frozen=True)
class CompiledPTX:
    """One specialization compiled for one architecture."""

    label: str
    arch: int
    lines: list[str]
    registers: int
    spill_bytes: int
    shared_bytes: int
    seconds: float


def compile_env() -> dict[str, str]:
    """The environment of a compile subprocess: this one's without ``TRITON_INTERPRET`` (the
    kernels must be real ``JITFunction`` objects)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default, stated to silence its warning
    return env


def compile_ptx(label: str, arch: int = 90, *, timeout: float = 300.0) -> CompiledPTX:
    """Compile the specialization whose label is ``label`` for ``sm_<arch>``, in a subprocess
    without ``TRITON_INTERPRET`` (no GPU or driver is needed).

    Raises ``RuntimeError`` with the end of the compiler's stderr when the compile fails.
    """
    if not isinstance(label, str) or not label:
        raise ValueError(f"label must be a specialization label, got {label!r}")
    env = compile_env()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "kernel.ptx"
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "rqlib.book.ptx", label, str(arch), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"sm_{arch} compile of {label} failed:\n{result.stderr[-3000:]}")
        lines = out.read_text().splitlines()
    usage = json.loads(result.stdout.strip().splitlines()[-1])
    return CompiledPTX(label, arch, lines, usage["regs"], usage["stack"], usage["shared"], seconds)


def inner_loop(ptx: list[str]) -> list[str]:
    """The lines of the first loop marked ``Inner Loop Header``, through its back edge."""
    header = next((i for i, line in enumerate(ptx) if "Inner Loop Header" in line), None)
    if header is None:
        raise LookupError("the PTX has no loop marked 'Inner Loop Header'")
    label = ptx[header].split(":")[0]
    back_edge = re.compile(rf"bra(\.uni)?\s+{re.escape(label)};")
    end = next((i for i in range(header, len(ptx)) if back_edge.search(ptx[i])), None)
    if end is None:
        raise LookupError(f"the loop {label} has no back edge (bra {label})")
    return ptx[header : end + 1]


def annotate(lines: list[str], source_dir: Path | str) -> list[str]:
    """Drop blank lines and inline-asm markers; replace each ``.loc`` by the source line it
    names (``// file.py:N  text``), once per change of line. Files are read from
    ``source_dir`` (the kernels' folder)."""
    source_dir = Path(source_dir)
    cache: dict[str, list[str]] = {}
    shown, last = [], None
    for line in lines:
        text = line.rstrip().replace("\t", "    ")
        if not text.strip() or "inline asm" in text:
            continue
        loc = _LOC.search(text)
        if loc is None:
            shown.append(text)
            continue
        where = (loc["file"], int(loc["line"]))
        if where != last and where[1] > 0:
            if where[0] not in cache:
                path = source_dir / where[0]
                if not path.is_file():
                    raise FileNotFoundError(f"the PTX points to {where[0]}, not in {source_dir}")
                cache[where[0]] = path.read_text().splitlines()
            source = cache[where[0]][where[1] - 1].strip()
            shown.append(f"    // {where[0]}:{where[1]}  {source}")
        last = where
    return shown


def opcode(line: str) -> str | None:
    """The opcode of a PTX instruction (after a ``@%p`` predicate), None for anything else."""
    tokens = line.split()
    if tokens and tokens[0].startswith("@"):
        tokens = tokens[1:]
    if not tokens or tokens[0].startswith(("//", "$")):
        return None
    return tokens[0]


def fold(lines: list[str]) -> list[str]:
    """Fold runs of a block of 1-3 instructions repeated with the same opcodes into the
    block's first copy, its last line marked ``// xN`` or ``// these K lines xN``."""
    out, i = [], 0
    while i < len(lines):
        best_period, best_reps = 1, 1
        for period in (1, 2, 3):
            ops = [opcode(line) for line in lines[i : i + period]]
            if len(ops) < period or None in ops:
                continue
            reps = 1
            while [opcode(x) for x in lines[i + reps * period : i + (reps + 1) * period]] == ops:
                reps += 1
            if reps > 1 and period * reps > best_period * best_reps:
                best_period, best_reps = period, reps
        block = lines[i : i + best_period]
        if best_reps > 1:
            mark = (
                f"// x{best_reps}"
                if best_period == 1
                else f"// these {best_period} lines x{best_reps}"
            )
            block = block[:-1] + [f"{block[-1]:<60} {mark}"]
        out += block
        i += best_period * best_reps
    return out


def loop_counts(loop: list[str]) -> dict[str, int]:
    """Lines of the (unfolded) loop and how many of each instruction in :data:`COUNTED`."""
    counts = {"lines": len(loop)}
    for name, needle in COUNTED.items():
        counts[name] = sum(needle in line for line in loop)
    return counts


def _first(lines: list[str], needle: str, what: str) -> int:
    found = next((i for i, line in enumerate(lines) if needle in line), None)
    if found is None:
        raise LookupError(f"the folded loop has no line with {needle!r} ({what})")
    return found


def loop_excerpt(
    body: list[str],
    *,
    head: str = "cp.async.wait_group",
    dot: str = "fma.rn.f32",
    tail: str = "hi = tl.load",
) -> list[str]:
    """The loop's first line; its head, from the source line before the first ``head``
    instruction to the first ``dot`` instruction; ``...``; and its tail, from the first source
    annotation containing ``tail`` to the back edge. ``LookupError`` names a missing marker."""
    start = _first(body, head, "head") - 1
    stop = _first(body, dot, "dot")
    annotations = [line if line.lstrip().startswith("//") else "" for line in body]
    rest = _first(annotations, tail, "tail")
    if not 0 < start < stop < rest:
        raise LookupError(f"markers out of order: head {start}, dot {stop}, tail {rest}")
    return [body[0], *body[start : stop + 1], "    ...", *body[rest:]]


def _main(argv: list[str]) -> int:
    """``python -m rqlib.book.ptx LABEL ARCH OUT``: write the PTX, print the usage as JSON."""
    from rqlib.kernels import aot

    label, arch, out = argv[0], int(argv[1]), Path(argv[2])
    spec = next((s for s in aot.specializations() if s.label == label), None)
    if spec is None:
        print(f"no specialization is labelled {label!r}", file=sys.stderr)
        return 2
    compiled = aot.compile_kernel(aot.kernel_objects()[spec.kernel], spec, arch)
    out.write_text(compiled.asm["ptx"])
    usage = aot.resource_usage(compiled.asm["cubin"])
    print(json.dumps({**usage, "shared": compiled.metadata.shared}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
