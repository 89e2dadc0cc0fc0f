"""GPU timings of the kernels, read from the measurement files committed under ``results/bench``.

Chapter 3 shows what a GPU measured; nothing in it is typed. Two kinds of file hold timings:

- ``gpu-*.json``, written by ``python -m rqlib bench gpu``: a header (``device``, ``commit``,
  ``versions``) and its steps; the ``kernels`` step holds one row per (storage, batch, context)
  with fp16 SDPA, the whole attention call, its kernels alone and the write of one token, in
  µs, with the megabytes each reads. The rows of the report's first storage (``spec``) keep the
  kernels' names; those of another storage (a trellis) carry the spec tokens it adds
  (:func:`kernel_name`).
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
    "CALL",
    "KERNELS_ALONE",
    "KERNEL_PATH",
    "SDPA",
    "WRITE",
    "Choice",
    "Measurement",
    "choose",
    "findings",
    "geometry_phrase",
    "host_sentence",
    "kernel_name",
    "kernel_unchanged",
    "kernels_alone",
    "load_all",
    "parse_json",
    "parse_text",
    "per_step",
    "side_by_side",
]

#: The files whose content decides whether a timing still describes the kernel.
KERNEL_PATH = "rqlib/kernels"
#: The columns of :attr:`Measurement.timings`.
TIMING_COLUMNS = ("batch", "kv_len", "kernel", "time_us", "mb_read")
#: The kernels the chapter compares, by their names in the measurement files: fp16 SDPA, the
#: whole attention call over packed keys and values, and its two kernels alone.
SDPA, CALL = "SDPA fp16", "attention K, V packed"
KERNELS_ALONE = "attention + reduce kernels alone"
#: The write of one decode token into the cache (its encoder, norms and band), reading nothing
#: of the stored context.
WRITE = "write one token"
#: Their columns in a ``bench gpu`` report's ``kernels`` step: (time, megabytes read).
JSON_KERNELS = {
    SDPA: ("sdpa_us", "fp16_mb"),
    CALL: ("call_us", "packed_mb"),
    KERNELS_ALONE: ("kernels_us", "packed_mb"),
    WRITE: ("write_us", None),
}


@dataclass(frozen=True)
class Measurement:
    """One measurement file: where it came from (``source``, relative to the folder read),
    the ``device``, the ``commit`` measured, the package ``versions``, the ``date``
    (``YYYY-MM-DD...``), the HBM peak the run assumed (``peak_gbps``, ``None`` if not printed),
    the ``geometry`` timed (``q_heads``, ``kv_heads``, ``head_dim``, ``keys``, ``values``), the
    ``timings`` (columns :data:`TIMING_COLUMNS`; empty for a report whose kernel step did not
    finish, ``status`` saying how it ended) and the decode-step ``profile`` (:func:`per_step`
    rows, empty when the file has none)."""

    source: str
    device: str
    commit: str
    versions: dict
    date: str
    timings: pd.DataFrame
    profile: pd.DataFrame
    peak_gbps: float | None = None
    geometry: dict = field(default_factory=dict)
    status: str = "ok"

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
def kernel_name(kernel: str, spec: str | None, first: str | None) -> str:
    """The name of ``kernel``'s row for the storage ``spec`` in a report whose first storage is
    ``first``: the kernel's own name for that storage (or a row without one), and otherwise the
    name with the spec tokens the storage adds (``"attention K, V packed (tcq:tb)"``)."""
    if spec is None or spec == first:
        return kernel
    added = spec.removeprefix(f"{first}:") if first else spec
    return f"{kernel} ({added})"


def parse_json(data: dict, source: str = "<json>") -> Measurement:
    """A measurement from a ``bench gpu`` report (or a report whose ``steps`` hold a flat
    ``timings`` list). A report whose ``kernels`` step did not finish has the step's ``status``
    (and error), and the rows it timed before it stopped (none if it stopped before the
    first). Raises ``ValueError`` naming ``source`` without a device
    and a commit."""
    for key in ("device", "commit"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"{source}: no {key!r} string in the report")
    steps = data.get("steps") or {}
    rows = []
    if isinstance(steps.get("timings"), list):
        rows = [{k: row[k] for k in TIMING_COLUMNS} for row in steps["timings"]]
    geometry = {}
    kernels = steps.get("kernels") or {}
    first = kernels.get("spec")
    for row in kernels.get("rows", []):
        for name, (column, mb) in JSON_KERNELS.items():
            if column in row:
                rows.append(
                    {"batch": row["batch"], "kv_len": row["kv_len"]}
                    | {"kernel": kernel_name(name, row.get("spec"), first)}
                    | {"time_us": float(row[column])}
                    | {"mb_read": float("nan") if mb is None else float(row[mb])}
                )
        geometry = {
            k: kernels[k] for k in ("q_heads", "kv_heads", "head_dim", "spec") if k in kernels
        }
    status = str(kernels.get("status") or ("ok" if rows else "no kernels step"))
    if status != "ok" and kernels.get("error"):
        status += f": {kernels['error']}"
    timings = pd.DataFrame(rows, columns=list(TIMING_COLUMNS))
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
        status,
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
    """The newest measurement with timings made at the current kernel, else the newest with
    timings of all (a report at the current kernel without timings is named in the sentence).
    Raises ``LookupError`` when none has timings."""
    timed = [m for m in measurements if len(m.timings)]
    if not timed:
        raise LookupError("no GPU timings under results/bench (gpu-*.json or gpu-*.txt)")
    newest_first = sorted(timed, key=lambda m: m.date, reverse=True)
    states = {id(m): kernel_unchanged(m.commit, repo) for m in newest_first}
    current = [m for m in newest_first if states[id(m)]]
    chosen = (current or newest_first)[0]
    untimed = [m for m in measurements if not len(m.timings) and kernel_unchanged(m.commit, repo)]
    unfinished = "".join(
        f" The report {m.source}, made at the current kernel, holds no kernel timings "
        f"(its kernels step: {m.status})."
        for m in untimed
    )
    if chosen.status != "ok":
        unfinished += (
            f" Its kernels step did not finish ({chosen.status}): the timings are the rows it "
            "timed before it stopped."
        )
    versions = f" ({_stack(chosen)})" if {"torch", "triton"} <= set(chosen.versions) else ""
    where = f"measured on an {chosen.device} at commit {chosen.short_commit}{versions}"
    if current:
        return Choice(
            chosen, True, f"These timings were {where}, with the current kernel.{unfinished}"
        )
    if states[id(chosen)] is False:
        when = (
            f"before the changes that made the present kernel (`git diff {chosen.short_commit}"
            f" -- {KERNEL_PATH}`)"
        )
    else:
        when = "and git cannot tell whether the kernel has changed since"
    sentence = (
        "No GPU measurement with timings exists for the current kernel. The last one, shown "
        f"here, was {where}, {when}.{unfinished}"
    )
    return Choice(chosen, False, sentence)


# ---- the models next to the measurement ------------------------------------------------------


def geometry_phrase(measurement: Measurement) -> str:
    """What was timed, in words (from the file's own description)."""
    g = measurement.geometry
    heads = f"{g['q_heads']} query heads over {g['kv_heads']} KV heads" if "q_heads" in g else ""
    parts = [heads, f"head dimension {g['head_dim']}" if "head_dim" in g else ""]
    if "keys" in g:
        parts.append(f"keys {g['keys']} bits, values {g['values']} bits")
    if "spec" in g:
        parts.append(f"keys and values stored as `{g['spec']}`")
    described = ", ".join(part for part in parts if part)
    return described or "a geometry the file does not record"


def kernels_alone(measurement: Measurement, kv_len: int, batch: int) -> float:
    """GPU time (µs) of the attention and reduce kernels of one decode step, from a timing
    row or a profile; NaN when the file has neither."""
    t = measurement.timings
    row = t[(t.kernel == KERNELS_ALONE) & (t.kv_len == kv_len) & (t.batch == batch)]
    if len(row):
        return float(row.time_us.iloc[0])
    p = measurement.profile
    if len(p):
        step = p[(p.kv_len == kv_len) & (p.batch == batch)]
        if len(step):
            return float(step.attention_kernel_us.iloc[0] + step.reduce_kernel_us.iloc[0])
    return float("nan")


def side_by_side(
    measurement: Measurement, peak_gbps: float, issue_ns_per_key: float, batch: int = 1
) -> pd.DataFrame:
    """One row per context length timed at ``batch``: the byte model (the megabytes each call
    must read, at ``peak_gbps``) and the instruction model (``issue_ns_per_key`` per key and KV
    head) of the packed cache, then what was measured: its kernels alone, the whole call, and
    fp16 SDPA with its own byte model. Times in µs."""
    t = measurement.timings[measurement.timings.batch == batch]
    kv_heads = measurement.geometry.get("kv_heads")
    rows = []
    for kv_len in sorted(t.kv_len.unique()):
        at = t[t.kv_len == kv_len].set_index("kernel")
        if CALL not in at.index or SDPA not in at.index:
            continue
        issue = issue_ns_per_key * kv_len * kv_heads * batch / 1e3 if kv_heads else float("nan")
        rows.append(
            {
                "kv_len": int(kv_len),
                "byte model, packed": 1e3 * at.loc[CALL, "mb_read"] / peak_gbps,
                "instruction model": issue,
                "kernels alone": kernels_alone(measurement, int(kv_len), batch),
                "whole call": at.loc[CALL, "time_us"],
                "byte model, fp16": 1e3 * at.loc[SDPA, "mb_read"] / peak_gbps,
                "SDPA fp16": at.loc[SDPA, "time_us"],
            }
        )
    if not rows:
        raise LookupError(
            f"{measurement.source}: no {CALL!r} and {SDPA!r} timings at batch {batch}"
        )
    return pd.DataFrame(rows)


def host_sentence(measurement: Measurement, kv_len: int, batch: int = 1) -> str:
    """What the measurement says of the work around the kernels of one decode step."""
    p = measurement.profile
    step = p[(p.kv_len == kv_len) & (p.batch == batch)] if len(p) else p
    if len(step):
        s = step.iloc[0]
        return (
            f"Profiled with `torch.profiler`, one step took {s.wall_us:.0f} µs on the host's "
            f"clock, of which the GPU computed for {s.gpu_us:.0f} µs ({s.attention_kernel_us:.0f}"
            f" µs in the attention kernel, {s.reduce_kernel_us:.0f} µs in the reduce); around "
            f"them the host launched {s.launches:.0f} kernels, waited for the device "
            f"{s.syncs:.0f} times (`cudaStreamSynchronize`), copied {s.copies:.0f} pageable "
            f"buffers to it and filled {s.fills:.0f} small tensors (`aten::fill_`), every step"
        )
    t = measurement.timings
    call = t[(t.kernel == CALL) & (t.kv_len == kv_len) & (t.batch == batch)]
    alone = kernels_alone(measurement, kv_len, batch)
    if len(call) and alone == alone:
        total = float(call.time_us.iloc[0])
        return (
            f"The whole call took {total:.0f} µs and its two kernels {alone:.0f} µs of GPU "
            f"time: the other {total - alone:.0f} µs are the host's work around them (launches, "
            "copies, synchronizations)"
        )
    return (
        "This measurement has no profile of a step, so it does not say how much of the call "
        "the host's work takes"
    )


def findings(measurement: Measurement, table: pd.DataFrame, kv_len: int = 32768) -> dict:
    """The chapter's glue values from :func:`side_by_side` ``table`` (batch 1) at ``kv_len``
    (the longest context timed when ``kv_len`` was not): the models and the measured times in
    µs, their ratios, the bandwidth the kernels alone achieve, and the file's description."""
    if kv_len not in set(table.kv_len):
        kv_len = int(table.kv_len.max())
    at = table.set_index("kv_len").loc[kv_len]
    t = measurement.timings
    call = t[(t.kernel == CALL) & (t.kv_len == kv_len) & (t.batch == 1)]
    kernels = float(at["kernels alone"])
    numbers = {
        "gpu_source": measurement.source,
        "gpu_geometry": geometry_phrase(measurement),
        "gpu_len": int(kv_len),
        "gpu_byte_model_us": at["byte model, packed"],
        "gpu_issue_model_us": at["instruction model"],
        "gpu_kernels_us": kernels,
        "gpu_call_us": at["whole call"],
        "gpu_fp16_model_us": at["byte model, fp16"],
        "gpu_sdpa_us": at["SDPA fp16"],
        "gpu_call_vs_sdpa": at["whole call"] / at["SDPA fp16"],
        "gpu_kernels_vs_sdpa": kernels / at["SDPA fp16"],
        "gpu_kernels_vs_model": kernels / at["byte model, packed"],
        "gpu_call_vs_kernels": at["whole call"] / kernels,
        "gpu_kernels_gbps": 1e3 * float(call.mb_read.iloc[0]) / kernels,
        "gpu_host": host_sentence(measurement, kv_len),
    }
    return {k: v if isinstance(v, (str, int)) else float(v) for k, v in numbers.items()}
