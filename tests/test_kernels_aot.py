"""Ahead-of-time compilation of every kernel specialization for real GPUs, without a GPU.

``python -m rqlib.kernels.aot`` runs in a subprocess without TRITON_INTERPRET (the kernels must
be real JITFunctions) and a fresh Triton cache (so every specialization is really compiled,
not read back from an earlier run). It prints one JSON record per (specialization, arch); the
test fails if any did not produce a cubin, and prints registers, spills and shared memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rqlib.kernels.aot import specializations

REQUIRED_ARCHS = {"sm_80", "sm_90"}


def test_every_specialization_compiles_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated to silence its warning
    # One process per arch: compilation is single-threaded and CI has two cores.
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "rqlib.kernels.aot", str(arch)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arch in supported_archs_in_subprocess(env)
    ]
    outputs = [process.communicate(timeout=900) for process in processes]
    stdout = "".join(out for out, _ in outputs)
    stderr = "".join(err for _, err in outputs)
    returncode = max(process.returncode for process in processes)
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    print(f"{'arch':<7} {'regs':>5} {'spill':>6} {'smem':>7}  kernel")
    for r in records:
        print(
            f"{r['arch']:<7} {r.get('regs', '?'):>5} {r.get('stack', '?'):>6} "
            f"{r.get('shared', '?'):>7}  {r['kernel']}"
        )
    failed = [r for r in records if not r["ok"]]
    assert not failed, failed
    assert returncode == 0, stderr[-4000:]
    archs = {r["arch"] for r in records}
    assert REQUIRED_ARCHS <= archs
    compiled = {(r["kernel"], r["arch"]) for r in records}
    expected = {(s.label, arch) for s in specializations() for arch in archs}
    assert compiled == expected
    assert all("regs" in r for r in records), "cuobjdump reported no register count"


def supported_archs_in_subprocess(env: dict) -> list[int]:
    """The archs this triton can target (asked without the interpreter)."""
    code = "from rqlib.kernels.aot import supported_archs; print(*supported_archs())"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return [int(arch) for arch in result.stdout.split()]
