"""GPU timings of the kernels, read from the measurement files committed under ``results/bench``.

Chapter 3 shows what a GPU measured; nothing in it is typed. Two kinds of file hold timings:

- ``gpu-*.json``, written by ``python -m rqlib bench gpu``: a header (``device``, ``commit``,
  ``versions``) and its steps; the ``kernels`` step holds one row per (batch, context) with fp16
  SDPA, the whole attention call and its kernels alone, in µs, with the megabytes each reads.
  A file whose ``steps`` hold a flat list ``timings`` of ``{kv_len, batch, kernel, time_us,
  mb_read}`` rows is read too.
- ``gpu-*.txt``, the printed output of an earlier ``python -m rqlib bench kernels`` run and of a
  ``torch.profiler`` table of one decode step (:func:`parse_text`).

:func:`load_all` reads every such file of a folder; :func:`choose` prefers the newest one made
at the current kernel (the files of ``rqlib/kernels`` unchanged since the measured commit,
:func:`kernel_unchanged`) and otherwise falls back to the newest of all, saying so.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

__all__ = [
    "KERNEL_PATH",
    "Choice",
    "Measurement",
    "choose",
    "kernel_unchanged",
    "load_all",
    "parse_json",
    "parse_text",
    "per_step",
]

#: The files whose content decides whether a timing still describes the kernel.
KERNEL_PATH = "rqlib/kernels"
#: The columns of :attr:`Measurement.timings`.
TIMING_COLUMNS = ("batch", "kv_len", "kernel", "time_us", "mb_read")
#: Names of the kernels in a ``bench gpu`` report's ``kernels`` step: (column, MB column).
JSON_KERNELS = {
    "SDPA fp16": ("sdpa_us", "fp16_mb"),
    "attention K, V packed": ("call_us", "packed_mb"),
    "attention + reduce kernels alone": ("kernels_us", "packed_mb"),
}


@dataclass(frozen=True)
class Measurement:
    """One measurement file: where it came from (``source``, relative to the folder read),
    the ``device``, the ``commit`` measured, the package ``versions``, the ``date``
    (``YYYY-MM-DD...``), the HBM peak the run assumed (``peak_gbps``, ``None`` if not printed),
    the ``geometry`` timed (``q_heads``, ``kv_heads``, ``head_dim``, ``keys``, ``values``), the
    ``timings`` (columns :data:`TIMING_COLUMNS`) and the decode-step ``profile``
    (:func:`per_step` rows, empty when the file has none)."""

    source: str
    device: str
    commit: str
    versions: dict
    date: str
    timings: pd.DataFrame
    profile: pd.DataFrame
    peak_gbps: float | None = None
    geometry: dict = field(default_factory=dict)

    @property
    def short_commit(self) -> str:
        return self.commit[:7]


# ---- the printed output ------------------------------------------------------------------------
_HEADER_COMMIT = re.compile(
    r"^# GPU measurements, .*?(\d{4}-\d{2}-\d{2}), rqlib at ([0-9a-f]{7,40})"
)
_STACK = re.compile(r"\b(torch|triton|transformers) (\d[\w.+]*)")
_DEVICE = re.compile(r"^device: (?P<device>.+?), peak HBM (?P<peak>[\d.]+) GB/s")
_GEOMETRY = re.compile(
    r"^batch (?P<batch>\d+), (?P<q_heads>\d+) query heads / (?P<kv_heads>\d+) KV heads, "
    r"head_dim (?P<head_dim>\d+), keys (?P<keys>[\w-]+ \d+) bits, "
    r"values (?P<values>[\w-]+ \d+) bits"
)
_ROW = re.compile(
    r"^\s*(?P<kv_len>\d+) (?P<kernel>\S.*?)\s+(?P<time_us>[\d.]+)\s+(?P<mb_read>[\d.]+)"
    r"\s+\d+\s+[\d.]+%\s+[\d.]+x\s*$"
)
_PROFILE = re.compile(r"^### kv_len (?P<kv_len>\d+) batch (?P<batch>\d+): wall (?P<wall>[\d.]+) us")
_CUDA_TOTAL = re.compile(r"^Self CUDA time total: (?P<total>[\d.]+(?:us|ms|s))")
_TIME = re.compile(r"^(?P<value>[\d.]+)(?P<unit>us|ms|s)$")


def _micros(text: str) -> float:
    """``"226.778us"``, ``"1.134ms"`` or ``"2s"`` in µs."""
    match = _TIME.match(text.strip())
    if match is None:
        raise ValueError(f"not a time: {text!r}")
    return float(match["value"]) * {"us": 1.0, "ms": 1e3, "s": 1e6}[match["unit"]]


def _profile_row(line: str) -> dict | None:
    """One row of a ``torch.profiler`` table (columns two or more spaces apart): the name, the
    self CUDA time, the CUDA total, its average and the calls; ``None`` for other lines."""
    cells = re.split(r"\s{2,}", line.strip())
    if len(cells) != 11 or not cells[-1].isdigit():
        return None
    return {
        "name": cells[0],
        "self_cuda_us": _micros(cells[6]),
        "cuda_avg_us": _micros(cells[9]),
        "calls": int(cells[10]),
    }


def parse_text(text: str, source: str = "<text>") -> Measurement:
    """A measurement from the printed output of ``bench kernels`` and a decode-step profile.

    Raises ``ValueError`` naming ``source`` when the header (commit, device) or every timing
    row is missing."""
    commit = date = device = None
    peak, versions, geometry = None, {}, {}
    rows, batch, profiles, profile = [], 1, [], None
    for line in text.splitlines():
        if match := _HEADER_COMMIT.match(line):
            date, commit = match[1], match[2]
        elif line.startswith("# stack:"):
            versions = dict(_STACK.findall(line))
        elif match := _DEVICE.match(line):
            device, peak = match["device"], float(match["peak"])
        elif match := _GEOMETRY.match(line):
            batch = int(match["batch"])
            geometry = {k: v for k, v in match.groupdict().items() if k != "batch"}
            geometry.update({k: int(geometry[k]) for k in ("q_heads", "kv_heads", "head_dim")})
        elif match := _ROW.match(line):
            row = {"batch": batch, "kv_len": int(match["kv_len"]), "kernel": match["kernel"]}
            rows.append({**row, "time_us": float(match["time_us"]), "mb": float(match["mb_read"])})
        elif match := _PROFILE.match(line):
            profile = {k: int(match[k]) for k in ("kv_len", "batch")}
            profile.update(wall_us=float(match["wall"]), ops={}, cuda_total_us=None)
            profiles.append(profile)
        elif profile is not None and (match := _CUDA_TOTAL.match(line)):
            profile["cuda_total_us"] = _micros(match["total"])
        elif profile is not None and (op := _profile_row(line)) is not None:
            profile["ops"].setdefault(op["name"], op)
    if commit is None or device is None:
        raise ValueError(
            f"{source}: no '# GPU measurements ... rqlib at <commit>' or 'device:' line"
        )
    if not rows:
        raise ValueError(f"{source}: no timing rows of 'bench kernels'")
    timings = pd.DataFrame(rows).rename(columns={"mb": "mb_read"})
    timings = timings.drop_duplicates(["batch", "kv_len", "kernel"], keep="last")
    return Measurement(
        source,
        device,
        commit,
        versions,
        date,
        timings[list(TIMING_COLUMNS)].reset_index(drop=True),
        pd.DataFrame([per_step(p) for p in profiles]),
        peak,
        geometry,
    )


def per_step(profile: dict) -> dict:
    """One decode-step profile per step: ``kv_len``, ``batch``, ``wall_us`` (the whole step on
    the host's clock), ``attention_kernel_us`` and ``reduce_kernel_us`` (GPU time of each
    kernel), ``gpu_us`` (GPU time of everything the step launched; NaN without the profile's
    "Self CUDA time total" line), and the host's work:
    ``launches`` (``cudaLaunchKernel``), ``syncs`` (``cudaStreamSynchronize``), ``copies``
    (host-to-device copies), ``fills`` (``aten::fill_``). The profile covers several steps;
    the calls of ``attention_kernel``, one a step, count them."""
    ops = profile["ops"]
    if "attention_kernel" not in ops:
        raise ValueError(f"the profile at kv_len {profile['kv_len']} has no attention_kernel row")
    steps = ops["attention_kernel"]["calls"]

    def calls(name: str) -> float:
        return ops[name]["calls"] / steps if name in ops else 0.0

    return {
        "kv_len": profile["kv_len"],
        "batch": profile["batch"],
        "wall_us": profile["wall_us"],
        "attention_kernel_us": ops["attention_kernel"]["cuda_avg_us"],
        "reduce_kernel_us": ops["reduce_kernel"]["cuda_avg_us"] if "reduce_kernel" in ops else 0.0,
        "gpu_us": (profile["cuda_total_us"] or float("nan")) / steps,
        "launches": calls("cudaLaunchKernel"),
        "syncs": calls("cudaStreamSynchronize"),
        "copies": calls("Memcpy HtoD (Pageable -> Device)"),
        "fills": calls("aten::fill_"),
    }


# ---- the JSON report -----------------------------------------------------------------------------
def parse_json(data: dict, source: str = "<json>") -> Measurement:
    """A measurement from a ``bench gpu`` report (or a report whose ``steps`` hold a flat
    ``timings`` list). Raises ``ValueError`` naming ``source`` when it holds no timing."""
    for key in ("device", "commit"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"{source}: no {key!r} string in the report")
    steps = data.get("steps") or {}
    rows = []
    if isinstance(steps.get("timings"), list):
        rows = [{k: row[k] for k in TIMING_COLUMNS} for row in steps["timings"]]
    geometry = {}
    kernels = steps.get("kernels") or {}
    for row in kernels.get("rows", []):
        for name, (column, mb) in JSON_KERNELS.items():
            if column in row:
                rows.append(
                    {"batch": row["batch"], "kv_len": row["kv_len"], "kernel": name}
                    | {"time_us": float(row[column]), "mb_read": float(row[mb])}
                )
        geometry = {
            k: kernels[k] for k in ("q_heads", "kv_heads", "head_dim", "spec") if k in kernels
        }
    if not rows:
        raise ValueError(f"{source}: no timings (neither steps.kernels.rows nor steps.timings)")
    timings = pd.DataFrame(rows)[list(TIMING_COLUMNS)]
    return Measurement(
        source,
        data["device"],
        data["commit"],
        dict(data.get("versions") or {}),
        str(data.get("created_utc") or ""),
        timings,
        pd.DataFrame(),
        None,
        geometry,
    )


def load_all(folder: Path | str) -> list[Measurement]:
    """Every ``gpu-*.json`` and ``gpu-*.txt`` of ``folder`` (none when it does not exist); a
    file that cannot be read raises ``ValueError`` naming it."""
    folder = Path(folder)
    found = []
    for path in sorted(folder.glob("gpu-*.json")) + sorted(folder.glob("gpu-*.txt")):
        try:
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".json":
                found.append(parse_json(json.loads(text), path.name))
            else:
                found.append(parse_text(text, path.name))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path}: not a measurement file ({error})") from error
    return found


# ---- which one to show -------------------------------------------------------------------------
def kernel_unchanged(commit: str, repo: Path | str) -> bool | None:
    """Whether the files under :data:`KERNEL_PATH` of the working tree at ``repo`` are those
    of ``commit`` (``git diff --quiet``); ``None`` when git cannot tell (no git, not a
    checkout, a commit it does not know, or a commit marked ``-dirty``)."""
    if commit.endswith("-dirty") or not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        return None
    try:
        result = subprocess.run(
            ["git", "diff", "--quiet", commit, "--", KERNEL_PATH],
            cwd=repo,
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(result.returncode)


@dataclass(frozen=True)
class Choice:
    """The measurement to show, whether it was made at the current kernel (``current``), and
    a sentence saying which it is (``sentence``)."""

    measurement: Measurement
    current: bool
    sentence: str


def _stack(measurement: Measurement) -> str:
    names = [f"{name} {measurement.versions[name]}" for name in ("torch", "triton")]
    return ", ".join(name.split("+")[0] for name in names if name.split()[-1] != "None")


def choose(measurements: list[Measurement], repo: Path | str) -> Choice:
    """The newest measurement made at the current kernel, else the newest of all. Raises
    ``LookupError`` when there is none."""
    if not measurements:
        raise LookupError("no GPU measurement under results/bench (gpu-*.json or gpu-*.txt)")
    newest_first = sorted(measurements, key=lambda m: m.date, reverse=True)
    states = {id(m): kernel_unchanged(m.commit, repo) for m in newest_first}
    current = [m for m in newest_first if states[id(m)]]
    chosen = (current or newest_first)[0]
    versions = f" ({_stack(chosen)})" if {"torch", "triton"} <= set(chosen.versions) else ""
    where = f"measured on an {chosen.device} at commit {chosen.short_commit}{versions}"
    if current:
        return Choice(chosen, True, f"These timings were {where}, with the current kernel.")
    state = states[id(chosen)]
    why = (
        f"the kernel has changed since (`git diff {chosen.short_commit} -- {KERNEL_PATH}`)"
        if state is False
        else "git cannot tell whether the kernel has changed since"
    )
    sentence = (
        "No GPU measurement exists for the current kernel. The last one, shown here, was "
        f"{where}, before the changes that made the present kernel: {why}."
    )
    return Choice(chosen, False, sentence)
