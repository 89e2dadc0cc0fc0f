"""The benchmark command: its CPU byte model, and its GPU code path run on CPU.

The GPU path (check_on_gpu, time_one_length) runs here with the Triton interpreter
on tiny shapes and a stand-in for ``triton.testing.do_bench`` that returns a fixed time: this
checks the code runs and the byte counts add up, never a timing. The decode-cpu benchmark is
measured, not tested (its numbers are in the fast-path report and chapter 3).
"""

from __future__ import annotations

import pytest
import torch
import triton.testing

from rqlib.cli import main
from rqlib.core.quantizers import make_quantizer
from rqlib.kernels import limits as geo
from rqlib.study import bench


def parse(argv: list[str]):
    """The arguments the bench command would hand to rqlib.study.bench."""
    import argparse

    from rqlib.cli import COMMANDS

    parser = argparse.ArgumentParser()
    COMMANDS["bench"][0](parser)
    return parser.parse_args(argv)


def test_cpu_prints_the_byte_model(capsys):
    assert main(["bench", "kernels", "--cpu"]) == 0
    text = capsys.readouterr().out
    assert "Timings need a CUDA GPU" in text
    # fp16 = 2 d bytes; 3-bit prod keys at d = 128: 32 code bytes + 16 sign bytes + 2 norms.
    assert "fp16                          256.0" in text
    assert "packed 2-bit + QJL             52.0" in text


def test_gpu_code_path_runs_on_cpu(monkeypatch, capsys):
    args = parse(["kernels", "--head-dim", "64", "--kv-heads", "1", "--group", "2"])
    monkeypatch.setattr(bench, "decode_step", interpreted(bench.decode_step))
    bench.check_on_gpu(args, torch.device("cpu"), length=70)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: (fn(), 2.0)[1])
    key_qz = make_quantizer(args.key_method, 64, args.key_bits)
    value_qz = make_quantizer(args.value_method, 64, args.value_bits)
    timings = bench.time_one_length(args, 48, key_qz, value_qz, 0.125, torch.device("cpu"))
    names = [name for name, *_ in timings]
    assert names == [
        "SDPA fp16",
        "fused_scores",
        "attention K packed, V fp16",
        "attention K, V packed",
    ]
    by_name = {name: nbytes for name, _, nbytes, _ in timings}
    assert by_name["SDPA fp16"] == 2 * 48 * 64 * 2
    stored = 48 * (key_qz.bits_per_vector + value_qz.bits_per_vector) // 8
    # 1 program (batch 1 x 1 KV head) x DEFAULT_SPLITS splits (the interpreter's) x (written +
    # read) x 2 rows x ((m, l) of 3 streams + 64 accumulators of the main stream)
    partials = geo.DEFAULT_SPLITS * 2 * 2 * (3 * 2 + 64) * 4
    assert by_name["attention K, V packed"] == stored + partials
    assert "bit-identical to torch: True" in capsys.readouterr().out


def interpreted(decode_step):
    """The benchmark's decode step with the Triton backend forced (CPU tensors: interpreted)."""

    def step(layer, q, scale, backend=None):
        return decode_step(layer, q, scale, backend or "triton")

    return step


@pytest.mark.parametrize("name,gbps", [("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0)])
def test_hbm_peak_lookup(monkeypatch, name, gbps):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert bench.hbm_peak_gbps(parse(["kernels"])) == gbps


@pytest.mark.model
def test_decode_cpu_runs_side_by_side():
    # a smoke test of the measuring code (two steps after 32 tokens), never of its timings
    result = bench.decode_cpu(
        context=32, steps=2, presets=("rq-3",), threads=1, progress=False, batch=3
    )
    assert set(result["methods"]) == {"fp", "preset:rq-3", "preset:rq-3+copy"}
    assert all(len(row["times"]) == 2 for row in result["methods"].values())
    assert result["methods"]["fp"]["ratio"] == 1.0
    assert result["batch"] == 3
    for row in result["methods"].values():
        assert row["ms_per_token"] == pytest.approx(row["ms"] / 3)
