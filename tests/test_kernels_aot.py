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

from rqlib.kernels import aot
from rqlib.kernels import limits as geo
from rqlib.kernels.aot import SM_LIMITS, occupancy, specializations

REQUIRED_ARCHS = {"sm_80", "sm_90"}
#: Kernels allowed to spill registers to local memory: none but the attention kernel, whose
#: formats are compile-time (an open set: aot.attention_layouts lists a covering one) and run
#: in the one configuration of their format (limits.attention_config). The presets' layout, at
#: every head dim and exact dtype, spills nothing; the other formats of the covering set spill
#: at most MAX_ATTENTION_SPILL bytes (the most measured: 304 at sm_80, 64 at sm_90, a format
#: with QJL keys in eight warps on the CUDA cores; on the tensor cores the same format spilled
#: over a kilobyte, which fails). Of the others, the trellis encoder read from 0 keeps one
#: register on the stack at sm_80 (an 8-byte frame: one store, one load a step of its search);
#: a kernel not named here spills nothing.
SPILLING: dict[str, int] = {"trellis_encode_kernel": 8}
MAX_ATTENTION_SPILL = 512


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
    labels = {spec.label for spec in specializations()}
    assert {(r["kernel"], r["arch"]) for r in records} == set(itertools.product(labels, archs))
    others = [r for r in records if not r["kernel"].startswith("attention_kernel[")]
    spills = [(r["kernel"], r["arch"], r.get("stack", 0)) for r in others]
    over = [s for s in spills if s[2] > SPILLING.get(s[0].split("[")[0], 0)]
    assert not over, f"kernels that spill more than SPILLING allows: {over}"
    assert all(0 < r["occupancy"] <= 1 for r in records)
    stacks = {(r["kernel"], r["arch"]): r.get("stack", 0) for r in records}
    for d, dtype, arch in itertools.product(
        geo.SUPPORTED_HEAD_DIMS, aot.TRITON_DTYPES.values(), REQUIRED_ARCHS
    ):
        spec = aot.attention_specialization(aot.coded_layout(d), dtype)
        assert stacks[(spec.label, arch)] == 0, (d, dtype, arch, "the presets' layout spills")
    worst = max(stack for (label, _), stack in stacks.items() if label.startswith("attention"))
    print(f"the most an attention format spills: {worst} bytes")
    assert worst <= MAX_ATTENTION_SPILL


def test_the_presets_decode_step_at_head_dim_128_in_one_configuration():
    """A decode step of the presets' layout at head_dim 128 runs in four warps with the scores
    on tensor cores, and its specialization is the one the AOT list compiles (one a format:
    decode steps and prompts share it)."""
    spec = aot.attention_specialization(aot.coded_layout(128), "fp16")
    assert spec.num_warps == geo.ATTENTION_CONFIG.num_warps == 4
    assert spec.constexprs["SCORE_TENSOR_CORES"] == 1
    labels = [s.label for s in aot.attention_specializations()]
    assert len(labels) == len(set(labels))


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


def test_positions_and_lengths_do_not_specialize_the_attention_kernel():
    """Triton compiles a variant of a kernel for each integer argument that is, or is not, a
    multiple of 16, unless told otherwise: the attention kernel's positions, lengths and split
    sizes change at every decode step, so they must not specialize it (else a generation
    compiles new kernels as its context grows). Read from the real JITFunction, in a process
    without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from rqlib.kernels.triton_attention import attention_kernel as k\n"
        "print(' '.join(p.name for p in k.params if p.do_not_specialize))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    unspecialized = set(done.stdout.split())
    assert {"start", "first", "end", "partition", "split_lo", "n_rows"} <= unspecialized
