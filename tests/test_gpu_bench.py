"""``python -m rqlib bench gpu``: its steps' own code, run on small shapes on the CPU.

A GPU session has minutes; the command it runs must not fail on a typo. Each step of
:mod:`rqlib.study.gpu_bench` runs here on the CPU with the kernels interpreted (correctness and
generate through the kernels), with a small model geometry and stand-in timers (the kernel
timings, the generate timings), and the report is written as the command writes it. What these
tests check is that the code runs and reports what it claims; never a timing.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from rqlib.cli import main
from rqlib.hf.codec import CompressedParts
from rqlib.study import gpu_bench

pytestmark = pytest.mark.interpreter

#: a small geometry of the same shape as Llama-3-8B's (GQA 4, head_dim 128)
SMALL = dict(
    hidden_size=256,
    intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=4096,
)


def test_correctness_and_generate_run_through_the_interpreted_kernels(capsys):
    """The correctness step compares every kernel with the torch path on each layer format of
    a preset, and passes (the kernels agree); the generate step finds the same tokens."""
    result = gpu_bench.correctness(device="cpu", presets=("rq-3",), batch=2, prompt=21)
    assert result["ok"], result
    assert result["presets"]["rq-3"]["layer_formats"] >= 1
    found = gpu_bench.generate_equivalence(
        device="cpu", new_tokens=2, kinds=("llama",), presets=("rq-3",)
    )
    assert found["ok"] and found["runs"][0]["tokens_equal"]
    out = capsys.readouterr().out
    assert "rq-3" in out and "tokens equal True" in out


def test_the_correctness_step_fails_when_a_kernel_is_off(monkeypatch):
    """A decode step off by 1 % on the Triton path fails the step: the check can fail."""
    from rqlib import kernels

    original = kernels.attention

    def off(state, q, mask, **kwargs):
        out = original(state, q, mask, **kwargs)
        return out * 1.01 if kwargs.get("backend") == "triton" else out

    monkeypatch.setattr(kernels, "attention", off)
    result = gpu_bench.correctness(device="cpu", presets=("rq-3",), batch=2, prompt=21)
    assert not result["ok"] and result["presets"]["rq-3"]["decode"] > gpu_bench.MAX_RELATIVE_ERROR


def test_kernel_and_generate_timings_run_with_stand_in_timers():
    """The kernel step builds a layer of each storage (Lloyd-Max codes, then the trellis), times
    SDPA, the call, the kernels and a token's write with the given timers and counts the packed
    bytes; the generate step times the fp16 cache and a preset."""
    calls = []

    def timer(fn):
        calls.append(fn())
        return 1.0

    result = gpu_bench.kernel_timings(
        device="cpu", kv_lens=(300,), batches=(2,), timer=timer, kernel_timer=timer, **SMALL
    )
    assert [row["spec"] for row in result["rows"]] == list(gpu_bench.KERNEL_SPECS)
    assert result["specs"] == list(gpu_bench.KERNEL_SPECS) and len(calls) == 4 * 2
    for row, (sdpa, call, _, written) in zip(
        result["rows"], [calls[i : i + 4] for i in range(0, 8, 4)]
    ):
        assert (row["batch"], row["kv_len"]) == (2, 300)
        assert call.shape == sdpa.shape == (2, 8, 1, 128)  # the call and SDPA agree in shape
        rel = (call.float() - sdpa.float()).abs().max() / sdpa.float().abs().max()
        assert rel < 0.5  # the same attention, up to 3-bit codes (a wrong head or scale is ~1)
        assert written[0].shape == (2, 2, 1, 128)  # one new key a sequence and KV head
        # fp16 K and V: 2 x 2 x 2 x 300 x 128 x 2 bytes; packed: 3-bit codes (or 3-bit trellis
        # symbols) + 11-bit norms each
        assert row["fp16_mb"] == pytest.approx(2 * 2 * 2 * 300 * 128 * 2 / 1e6)
        assert row["packed_mb"] == pytest.approx(2 * 2 * 2 * 300 * (128 * 3 + 11) / 8 / 1e6)
    timed = gpu_bench.end_to_end(
        device="cpu", context=24, batches=(1,), new_tokens=2, layers=2, **SMALL
    )
    assert [row["method"] for row in timed["rows"]] == ["fp16-dynamic", "preset:rq-3"]
    assert all(row["tokens_per_s"] > 0 and math.isfinite(row["prefill_s"]) for row in timed["rows"])


def test_the_kernel_step_s_trellis_layer_is_coded_by_the_trellis_and_takes_its_writes():
    """The second storage of the kernel step is the trellis: its layer's keys and values are
    trellis codes of what was stored (decoded within the error of 3-bit codes), and a timed
    write appends one token. With the trellis's token left out of the spec, the first check
    fails: the storage the step times is the one it names."""
    spec = gpu_bench.KERNEL_SPECS[1]
    layer, k, v = gpu_bench.kernel_layer("cpu", 1, 70, spec, **SMALL)
    for codec, x in ((layer.key_codec, k), (layer.value_codec, v)):
        quantizer = codec.parts[0].quantizer
        assert quantizer.trellis is not None and quantizer.trellis.tail_biting
        stored = codec.decode(CompressedParts((layer.streams["keys" if x is k else "values"]
                                               .rings[0].read(0, 70),)))  # fmt: skip
        error = (stored - x.float()).pow(2).sum() / x.float().pow(2).sum()
        # 3-bit codes of Gaussian vectors: a relative squared error near 0.03 (Lloyd-Max
        # 0.0345, the trellis less); a wrong table or register gives ~1 or more
        assert error < 0.1
    before = layer.length
    layer.update(*torch.randn(2, 1, 2, 1, 128).half())
    assert layer.length == before + 1
    lloyd, _, _ = gpu_bench.kernel_layer("cpu", 1, 70, gpu_bench.KERNEL_SPEC, **SMALL)
    assert lloyd.key_codec.parts[0].quantizer.trellis is None


def test_a_step_past_its_limit_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    """A step that overruns is stopped and recorded as such; the report holds every step that
    ran, written as it goes."""
    report = gpu_bench.Report(tmp_path / "gpu.json", {"device": "test"})
    with pytest.raises(gpu_bench.StepTimeout):
        with gpu_bench.time_limit(0.05):
            while True:
                pass
    report.record("correctness", {"status": "ok", "seconds": 1.0})
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["device"] == "test" and data["steps"]["correctness"]["status"] == "ok"


def test_a_timing_step_stopped_by_its_limit_keeps_the_rows_it_timed(tmp_path, monkeypatch):
    """The kernels step times rows one after another; stopped by its limit after the first, the
    report holds that row with the step's status, the book reads it and says the step did not
    finish, and the next step still runs. Without the rows kept, the report would have none."""
    from rqlib.book import gpu_results

    row = {"spec": gpu_bench.KERNEL_SPEC, "batch": 1, "kv_len": 4096, "sdpa_us": 50.0}
    row |= {"call_us": 900.0, "kernels_us": 200.0, "write_us": 80.0}
    row |= {"fp16_mb": 134.2, "packed_mb": 35.5}

    def first_row_then_the_limit(rows, **options):
        rows.append(row)
        raise gpu_bench.StepTimeout("stopped after 200 s")

    monkeypatch.setattr(gpu_bench, "kernel_timings", first_row_then_the_limit)
    monkeypatch.setattr(gpu_bench, "startup", lambda: {"cold": {}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    path = tmp_path / "gpu-nvidia-h200-ffffffffffff.json"
    header = {"device": "NVIDIA H200", "commit": "f" * 40}
    assert not gpu_bench.run(gpu_bench.Report(path, header), steps=("kernels", "startup"))
    steps = json.loads(path.read_text())["steps"]
    assert steps["kernels"]["status"] == "timeout" and steps["kernels"]["rows"] == [row]
    assert steps["startup"]["status"] == "ok"
    (found,) = gpu_results.load_all(tmp_path)
    assert found.status.startswith("timeout") and len(found.timings) == 4
    choice = gpu_results.choose([found], tmp_path)
    assert "did not finish" in choice.sentence and "before it stopped" in choice.sentence


def test_bench_gpu_refuses_without_cuda(capsys):
    assert not torch.cuda.is_available()
    assert main(["bench", "gpu"]) == 2
    assert "bench gpu needs a CUDA device" in capsys.readouterr().err
    assert main(["bench", "gpu", "--only", "nonsense"]) == 2
    assert "unknown step 'nonsense'" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        gpu_bench.run(gpu_bench.Report(None, {}))
