"""Count the instructions a compiled decode step issues per key, without a GPU.

A decode step can run at the speed of HBM only if the GPU can issue every instruction the
step needs for one key in the time HBM takes to deliver that key's bytes (a necessary
condition, not a sufficient one: occupancy, latency and the host's work decide the rest).
Both sides can be counted without a GPU. The bytes come from the storage format. The
instructions come from the machine code (SASS) that ptxas produces for the attention kernel:

1. :func:`compile_decode_path` compiles the specialization of ``attention_kernel`` that a
   decode step launches for one layer format (:func:`decode_layout`: keys and values as codes,
   no QJL; the formats are compile-time, so the branches of other formats are not in it; the
   mask, window and positions stay run-time arguments, as in a launch), in the one
   configuration a launch runs that format in (``limits.attention_config``). It runs in a
   subprocess without ``TRITON_INTERPRET``, like :func:`rqlib.book.ptx.compile_ptx`, and
   disassembles it with the source line of every instruction (``nvdisasm -g``).
2. :func:`parse_sass` reads the instructions (address, opcode, branch target, source line).
3. :func:`tile_counts` finds the main stream's loop (the first outermost loop: a backward
   branch) and counts the opcodes of one iteration, which handles ``BLOCK_S`` keys. A loop
   nested in it (the scores' walk over the coordinates in chunks) counts ``trips`` times.
4. :class:`IssueCount` turns the counts into instructions per key, per thread and per warp,
   grouped into classes (:data:`CLASSES`) or by source line (:meth:`IssueCount.by_source`);
   :func:`issue_budget` gives the warp instructions per key that a GPU can issue while its
   HBM delivers the key's bytes.

These are static counts: a predicated-off instruction counts as issued (it is); latencies, the
occupancy of the SMs and the rates of the execution units are ignored; only the main loop is
counted (the sink and the recent band add a constant per step), and nothing the host does
around the kernel. They are a model of the step, not a prediction of its time: only a GPU
measures that (``python -m rqlib bench gpu``).
"""

from __future__ import annotations

import collections
import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CLASSES",
    "Instruction",
    "IssueCount",
    "compile_decode_path",
    "decode_layout",
    "issue_budget",
    "issue_rate",
    "issue_summary",
    "parse_sass",
    "tile_counts",
]

#: Opcode classes (the opcode before its first ``.``); anything else counts as "other".
CLASSES = {
    "fp32 multiply-add (FFMA)": {"FFMA"},
    "tensor-core products (HMMA)": {"HMMA"},
    "other floating point": {
        "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "MUFU", "HADD2", "HFMA2", "HMUL2", "F2F",
        "F2FP", "I2F", "F2I", "FCHK",
    },
    "global loads": {"LDG"},
    "shared memory and barriers": {"LDS", "STS", "LDSM", "STSM", "BAR"},
    "integer and address arithmetic": {
        "IMAD", "IADD3", "LEA", "SHF", "LOP3", "PRMT", "IABS", "SEL", "MOV", "IMNMX", "UIADD3",
        "ULDC", "UMOV", "IMUL", "ULEA", "USHF", "ULOP3", "UIMAD", "VIADD", "VIMNMX", "I2I",
    },
    "predicates, shuffles and control": {
        "ISETP", "PLOP3", "BRA", "P2R", "R2P", "SHFL", "VOTE", "BSSY", "BSYNC", "WARPSYNC",
        "UISETP", "UPLOP3", "NOP",
    },
}  # fmt: skip

_INSTRUCTION = re.compile(
    r"/\*(?P<address>[0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?(?P<opcode>[A-Z][A-Z0-9_.]*)(?P<rest>[^;]*);"
)
_TARGET = re.compile(r"0x(?P<target>[0-9a-f]+)|`\((?P<label>\.L_x_\d+)\)")
_LABEL = re.compile(r"^\s*(?P<label>\.L_x_\d+):")
_SOURCE = re.compile(r'//## File "(?P<file>[^"]+)", line (?P<line>\d+)')


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: its address, its opcode without modifiers, for a branch the
    address it jumps to (``None`` otherwise), and the source line it was compiled from
    (``file name:line``, ``None`` when the listing has no line information)."""

    address: int
    opcode: str
    target: int | None = None
    source: str | None = None


def parse_sass(text: str) -> list[Instruction]:
    """The instructions of a ``cuobjdump -sass`` listing (branch targets as addresses) or of an
    ``nvdisasm -g -c`` listing (targets as labels, ``//## File ..., line N`` before the
    instructions of each source line), in address order."""
    rows, labels, pending, source = [], {}, [], None
    for line in text.splitlines():
        if label := _LABEL.match(line):
            pending.append(label["label"])
        elif where := _SOURCE.search(line):
            source = f"{Path(where['file']).name}:{where['line']}"
        elif match := _INSTRUCTION.search(line):
            address = int(match["address"], 16)
            labels.update({name: address for name in pending})
            pending = []
            rows.append((address, match["opcode"].split(".")[0], match["rest"], source))
    if not rows:
        raise ValueError("no SASS instruction found in the listing")

    def target(opcode: str, rest: str) -> int | None:
        found = _TARGET.search(rest) if opcode == "BRA" else None
        if found is None:
            return None
        return int(found["target"], 16) if found["target"] else labels.get(found["label"])

    instructions = [
        Instruction(address, opcode, target(opcode, rest), where)
        for address, opcode, rest, where in rows
    ]
    return sorted(instructions, key=lambda instruction: instruction.address)


def loops(instructions: list[Instruction]) -> list[tuple[int, int]]:
    """``(first, last)`` addresses of every loop: a branch to an earlier address."""
    return sorted(
        (i.target, i.address)
        for i in instructions
        if i.target is not None and i.target <= i.address
    )


def tile_counts(
    instructions: list[Instruction], trips: int, by: str = "opcode"
) -> collections.Counter:
    """Instructions issued by one iteration of the first outermost loop, a loop nested in it
    counted ``trips`` times, counted by ``by`` (``"opcode"`` or ``"source"``). Raises
    ``LookupError`` when there is no loop, or more than one loop nested in it (the count would
    not know their trip counts)."""
    found = loops(instructions)
    outermost = [
        (lo, hi)
        for lo, hi in found
        if not any(a <= lo and hi <= b and (a, b) != (lo, hi) for a, b in found)
    ]
    if not outermost:
        raise LookupError("the kernel has no loop")
    main = outermost[0]
    nested = [(lo, hi) for lo, hi in found if main[0] <= lo and hi <= main[1] and (lo, hi) != main]
    if len(nested) > 1:
        raise LookupError(f"the main loop {main} holds {len(nested)} loops, expected at most 1")

    def inside(span, instruction):
        return span[0] <= instruction.address <= span[1]

    counts = collections.Counter()
    for instruction in instructions:
        if not inside(main, instruction):
            continue
        in_nested = any(inside(span, instruction) for span in nested)
        counts[getattr(instruction, by)] += trips if in_nested else 1
    return counts


@dataclass(frozen=True)
class IssueCount:
    """The opcodes one thread issues for one tile of ``keys`` keys of the main loop (and the
    listing they were counted from), in a configuration of ``warps`` warps whose scores run on
    tensor cores or not (``score_tensor_cores``)."""

    per_tile: dict
    keys: int
    warps: int
    trips: int
    instructions: tuple = field(default=(), repr=False)
    score_tensor_cores: bool = True

    @property
    def per_key_per_thread(self) -> float:
        return sum(self.per_tile.values()) / self.keys

    @property
    def warp_instructions_per_key(self) -> float:
        """Instructions the SM schedulers issue per key: every warp runs the loop."""
        return self.per_key_per_thread * self.warps

    def by_source(self, top: int = 10) -> list[tuple[str, str, float]]:
        """The ``top`` source lines that issue the most: ``(file:line, the line's text, warp
        instructions per key)``, most first. Lines outside ``rqlib.kernels`` (Triton's own
        reductions) have an empty text."""
        counts = tile_counts(list(self.instructions), self.trips, by="source")
        rows = []
        for where, count in counts.most_common(top):
            rows.append((where or "?", _source_text(where), count * self.warps / self.keys))
        return rows

    def by_class(self) -> dict[str, float]:
        """Warp instructions per key in each of :data:`CLASSES`, plus ``"other"``."""
        result = {name: 0.0 for name in (*CLASSES, "other")}
        for opcode, count in self.per_tile.items():
            name = next((name for name, ops in CLASSES.items() if opcode in ops), "other")
            result[name] += count * self.warps / self.keys
        return result


def _source_text(where: str | None) -> str:
    """The text of ``file:line`` in ``rqlib/kernels``, stripped; empty if it is not there."""
    if not where or ":" not in where:
        return ""
    name, line = where.rsplit(":", 1)
    path = Path(__file__).resolve().parents[1] / "kernels" / name
    if not path.is_file():
        return ""
    lines = path.read_text().splitlines()
    return lines[int(line) - 1].strip() if 0 < int(line) <= len(lines) else ""


#: warp schedulers per SM, each issuing at most one warp instruction per clock (sm_80 - sm_100)
SCHEDULERS_PER_SM = 4


def issue_rate(sm_count: int, clock_ghz: float) -> float:
    """Warp instructions a GPU issues per nanosecond at best."""
    return sm_count * SCHEDULERS_PER_SM * clock_ghz


def issue_budget(bytes_per_key: float, hbm_gbs: float, sm_count: int, clock_ghz: float) -> float:
    """Warp instructions per key a GPU can issue while its HBM delivers ``bytes_per_key``
    (:func:`issue_rate` times the nanoseconds HBM takes for them)."""
    if min(bytes_per_key, hbm_gbs, sm_count, clock_ghz) <= 0:
        raise ValueError(
            f"need positive bytes, bandwidth, SM count and clock, got {bytes_per_key}, "
            f"{hbm_gbs}, {sm_count}, {clock_ghz}"
        )
    return issue_rate(sm_count, clock_ghz) * bytes_per_key / hbm_gbs


def issue_summary(
    count: IssueCount,
    packed_bytes: float,
    fp16_bytes: float,
    rows: int,
    head_dim: int,
    hbm_gbs: float,
    sm_count: int,
    clock_ghz: float,
) -> dict[str, float]:
    """What the count of a decode step says, per key and KV head: ``per_key`` warp instructions;
    the ``budget_packed`` and ``budget_fp16`` instructions a GPU issues while its HBM delivers
    ``packed_bytes`` or ``fp16_bytes`` (a key and a value in each format); their ``ratio``
    (count / packed budget); the shares of fp32 multiply-adds, of tensor-core products, of
    shared memory and barriers, of the multiply-adds spent on tile rows that hold no query (the
    ``rows`` of a decode step, the GQA group, padded to the 16 of ``tl.dot``),
    and of integer arithmetic;
    ``fma_floor``: the warp instructions the multiply-adds of a key's scores would need on CUDA
    cores without any padding (``rows`` scores of ``head_dim`` coordinates, one FFMA each, 32
    lanes a warp); and ``vs_fp16``: the step's issue
    floor (nanoseconds at one instruction per scheduler and clock) over the time to read the
    fp16 key and value at the HBM rate."""
    from rqlib.kernels import limits as geo

    per_key = count.warp_instructions_per_key
    classes = count.by_class()
    fma = classes["fp32 multiply-add (FFMA)"]
    padded = 1 - min(rows, geo.BLOCK_ROWS) / geo.BLOCK_ROWS
    budget_packed = issue_budget(packed_bytes, hbm_gbs, sm_count, clock_ghz)
    issue_ns = per_key / issue_rate(sm_count, clock_ghz)
    return {
        "per_key": per_key,
        "budget_packed": budget_packed,
        "budget_fp16": issue_budget(fp16_bytes, hbm_gbs, sm_count, clock_ghz),
        "ratio": per_key / budget_packed,
        "fma_share": fma / per_key,
        "hmma_share": classes["tensor-core products (HMMA)"] / per_key,
        "smem_share": classes["shared memory and barriers"] / per_key,
        "padding_share": fma * padded / per_key,
        "int_share": classes["integer and address arithmetic"] / per_key,
        "fma_floor": rows * head_dim / 32,
        "ns_per_key": issue_ns,
        "vs_fp16": issue_ns / (fp16_bytes / hbm_gbs),
    }


def decode_layout(head_dim: int, key_bits: int, value_bits: int, norm_bits: int) -> dict:
    """The compile-time arguments of a decode step in the presets' layout: keys and values
    stored as codes of the full head dimension (``key_bits`` and ``value_bits`` bits) with
    ``norm_bits``-bit norms, no QJL, and a recent band of 8-bit codes
    (:func:`rqlib.kernels.aot.coded_layout`); no softcap."""
    from rqlib.kernels import aot

    return aot.coded_layout(head_dim, key_bits, value_bits, norm_bits)


def _decode_spec(*layout: int, exact: str = "fp16"):
    """The attention specialization of a decode step of :func:`decode_layout` with ``exact``
    sink vectors, in the configuration a launch runs it in."""
    from rqlib.kernels import aot

    return aot.attention_specialization(decode_layout(*layout), exact)


def compile_decode_path(
    arch: int,
    head_dim: int,
    key_bits: int,
    value_bits: int,
    norm_bits: int,
    *,
    timeout: float = 300.0,
) -> IssueCount:
    """Compile the decode path (:func:`decode_layout`) of ``attention_kernel`` for
    ``sm_<arch>`` in a subprocess without ``TRITON_INTERPRET``, in the configuration a launch
    runs it in, and count one main-loop tile (its 16 rows hold a decode step's GQA group).

    Raises ``RuntimeError`` with the end of the compiler's stderr when the compile fails.
    """
    from rqlib.book.ptx import compile_env

    env = compile_env()
    arguments = [str(v) for v in (arch, head_dim, key_bits, value_bits, norm_bits)]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "kernel.sass"
        result = subprocess.run(
            [sys.executable, "-m", "rqlib.book.sass", *arguments, str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"sm_{arch} compile of the decode path failed:\n{result.stderr[-3000:]}"
            )
        text = out.read_text()
    usage = json.loads(result.stdout.strip().splitlines()[-1])
    trips = math.ceil(head_dim / usage["chunk"])
    instructions = parse_sass(text)
    counts = tile_counts(instructions, trips)
    return IssueCount(
        dict(counts), usage["keys"], usage["warps"], trips, tuple(instructions), usage["tensor"]
    )


def _main(argv: list[str]) -> int:
    """``python -m rqlib.book.sass ARCH HEAD_DIM KEY_BITS VALUE_BITS NORM_BITS OUT``: write the
    SASS of the decode path, print its tile (keys, chunk, warps, scores on tensor cores) as
    JSON."""
    from rqlib.kernels import aot

    arch, *layout = (int(value) for value in argv[:5])
    spec = _decode_spec(*layout)
    compiled = aot.compile_kernel(aot.kernel_objects()[spec.kernel], spec, arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        nvdisasm = Path(aot.cuobjdump()).with_name("nvdisasm")
        sass = subprocess.run(
            [str(nvdisasm), "-g", "-c", handle.name], capture_output=True, text=True, check=True
        ).stdout
    Path(argv[5]).write_text(sass)
    tile = {"keys": spec.constexprs["BLOCK_S"], "chunk": spec.constexprs["CHUNK"]}
    tensor = bool(spec.constexprs["SCORE_TENSOR_CORES"])
    print(json.dumps({**tile, "warps": spec.num_warps, "tensor": tensor}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
