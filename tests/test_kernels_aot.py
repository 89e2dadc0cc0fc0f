"""Ahead-of-time compilation of the kernels' specializations for real GPUs, without a GPU.

``python -m rqlib.kernels.aot`` runs in a subprocess without TRITON_INTERPRET (the kernels must
be real JITFunctions) and a fresh Triton cache (so each listed specialization is really compiled,
not read back from an earlier run). It prints one JSON record per (specialization, arch); the
test fails if any did not produce a cubin or spills registers where it should not, and prints
registers, spills, shared memory and the theoretical occupancy of each.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from rqlib.book.sass import decode_layout
from rqlib.kernels import aot
from rqlib.kernels import limits as geo
from rqlib.kernels.aot import SM_LIMITS, occupancy, specializations

REQUIRED_ARCHS = {"sm_80", "sm_90"}
#: Kernels allowed to spill registers to local memory: none, in a configuration a launch
#: runs. The attention kernel compiles each layer format, selects its mask and softcap
#: without branches, cuts accumulators at 256 columns (128 when a block of 256 would mask
#: columns), is software-pipelined only where timed and may take 255 registers a thread (see
#: rqlib.kernels.triton_attention); each format and lanes is compiled in the configurations of
#: limits.ATTENTION_CONFIGS in order until one does not spill, and a launch runs only
#: configurations that do not spill (the fastest measured: launch.attention_config), so a format
#: fails this test when it spills in all of them. The other kernels have one configuration: a
#: spill in any of their specializations fails it.
SPILLING: set[str] = set()
#: head dims at which the presets' format must run a decode step (4 lanes) in two warps with
#: the scores on tensor cores (the first configuration), and a prompt (1 lane) on tensor cores
TENSOR_CORE_HEAD_DIMS = (64, 128)


def settled_configurations(records: list[dict]) -> dict[tuple[str, str], int | None]:
    """``(group, arch) -> the index in limits.ATTENTION_CONFIGS of the first configuration
    that compiled without spilling`` (``None``: every one spilled) for every group of
    ``aot.attention_groups``, a group named by the label of its first configuration."""
    stacks = {(r["kernel"], r["arch"]): r.get("stack", 0) for r in records}
    archs = {r["arch"] for r in records}
    settled = {}
    for group, arch in itertools.product(aot.attention_groups(), archs):
        compiled = [stacks.get((spec.label, arch)) for spec in group]
        fits = [i for i, stack in enumerate(compiled) if stack == 0]
        settled[(group[0].label, arch)] = fits[0] if fits else None
    return settled


def test_every_specialization_compiles_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated to silence its warning
    # One process per arch: compilation is single-threaded and CI has two cores.
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "rqlib.kernels.aot", arch.removeprefix("sm_")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arch in sorted(REQUIRED_ARCHS)
    ]
    outputs = [process.communicate(timeout=1500) for process in processes]
    stdout = "".join(out for out, _ in outputs)
    stderr = "".join(err for _, err in outputs)
    returncode = max(process.returncode for process in processes)
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    print(f"{'arch':<7} {'regs':>5} {'spill':>6} {'smem':>7} {'occupancy':>10}  kernel")
    for r in records:
        print(
            f"{r['arch']:<7} {r.get('regs', '?'):>5} {r.get('stack', '?'):>6} "
            f"{r.get('shared', '?'):>7} {r.get('occupancy', float('nan')):>10.3f}  {r['kernel']}"
        )
    failed = [r for r in records if not r["ok"]]
    assert not failed, failed
    assert returncode == 0, stderr[-4000:]
    archs = {r["arch"] for r in records}
    assert archs == REQUIRED_ARCHS
    assert all("regs" in r for r in records), "cuobjdump reported no register count"
    timed_only = ("pipelined", "wide_tile")
    others = [r for r in records if "group" not in r and not any(r.get(k) for k in timed_only)]
    kernels = {s.label for s in specializations() if s.kernel != "attention_kernel"}
    assert {(r["kernel"], r["arch"]) for r in others} == set(itertools.product(kernels, archs))
    spilling = {r["kernel"].split("[")[0] for r in others if r.get("stack", 0) > 0}
    assert spilling == SPILLING, f"kernels that spill: {spilling}, expected {SPILLING}"
    assert all(0 < r["occupancy"] <= 1 for r in records)
    # each group of configurations was compiled in order, up to the first that does not spill
    settled = settled_configurations(records)
    for group, arch in itertools.product(aot.attention_groups(), archs):
        last = settled[(group[0].label, arch)]
        expected = [spec.label for spec in group[: len(group) if last is None else last + 1]]
        compiled = [
            r["kernel"] for r in records if r["arch"] == arch and r.get("group") == group[0].label
        ]
        assert compiled == expected, (group[0].label, arch)
    print(f"{'arch':<7} {'configuration':>13}  attention layout")
    for (layout, arch), index in sorted(settled.items(), key=lambda item: item[0][::-1]):
        print(f"{arch:<7} {index!s:>13}  {layout}")
    never = [key for key, index in settled.items() if index is None]
    assert not never, f"attention layouts that spill in every configuration: {never}"
    # the software-pipelined configurations, which only a timed launch reaches, all compile;
    # a spill there is no failure (the tuner drops it), but the presets' layout keeps at least
    # one pipelined configuration that fits, in a decode step's lanes and in a prompt's, so
    # that the tuner has one to time
    pipelined = [r for r in records if r.get("pipelined")]
    specs = aot.pipelined_specializations()
    assert {(r["kernel"], r["arch"]) for r in pipelined} == {
        (spec.label, arch) for spec in specs for arch in archs
    }
    fitting = {(r["kernel"], r["arch"]) for r in pipelined if r.get("stack", 0) == 0}
    for d, lanes, arch in itertools.product(aot.PIPELINED_HEAD_DIMS, (4, 1), archs):
        layout = aot.coded_layout(d)
        labels = {
            aot.attention_specialization(layout, "fp16", config, lanes).label
            for config in geo.PIPELINED_CONFIGS
        }
        assert {(label, arch) for label in labels} & fitting, (d, lanes, arch, "pipelined")
    # the wider key tiles, which only a timed launch reaches, all compile; at head dimension
    # 64 each fits the presets' layout, in a decode step's lanes and in a prompt's (at 128
    # they spill, which the tuner drops: reported above, not asserted)
    wide = [r for r in records if r.get("wide_tile")]
    specs = aot.wide_tile_specializations()
    assert {(r["kernel"], r["arch"]) for r in wide} == {
        (spec.label, arch) for spec in specs for arch in archs
    }
    stacks = {(r["kernel"], r["arch"]): r.get("stack", 0) for r in wide}
    for config, lanes, arch in itertools.product(geo.WIDE_TILE_CONFIGS, (4, 1), archs):
        label = aot.attention_specialization(aot.coded_layout(64), "fp16", config, lanes).label
        assert stacks[(label, arch)] == 0, (config, lanes, arch, "wide tile")
    for d, dtype, arch in itertools.product(
        TENSOR_CORE_HEAD_DIMS, aot.TRITON_DTYPES.values(), REQUIRED_ARCHS
    ):
        layout = decode_layout(d, 3, 2, 11)
        decode = settled[(aot.attention_specialization(layout, dtype, lanes=4).label, arch)]
        assert decode == 0, (d, dtype, arch, "decode", decode)
        prompt = settled[(aot.attention_specialization(layout, dtype, lanes=1).label, arch)]
        assert geo.ATTENTION_CONFIGS[prompt].score_tensor_cores, (d, dtype, arch, "prompt")


@pytest.mark.parametrize(
    ("regs", "shared", "warps", "arch", "blocks", "limit"),
    [
        # 255 registers: 8160 per warp, rounded to 8192; 65536 / 8192 = 8 warps = 1 block of 8
        (255, 9216, 8, 90, 1, "registers"),
        # 64 registers, 4 warps: 2048 per warp, 32 warps by registers = 8 blocks; 64 / 4 = 16
        (64, 0, 4, 80, 8, "registers"),
        # 100 KB of shared memory: one block fits the 164 KB of an sm_80 SM, two the 228 KB of sm_90
        (32, 100 * 1024, 4, 80, 1, "shared memory"),
        (32, 100 * 1024, 4, 90, 2, "shared memory"),
        # 16 registers, 1 warp: registers allow 128 blocks, the SM at most 32
        (16, 0, 1, 90, 32, "warps"),
    ],
)
def test_occupancy_follows_the_cuda_rules(regs, shared, warps, arch, blocks, limit):
    result = occupancy(regs, shared, warps, arch)
    assert (result["blocks"], result["limit"]) == (blocks, limit)
    assert result["occupancy"] == blocks * warps / SM_LIMITS[arch]["warps"]
