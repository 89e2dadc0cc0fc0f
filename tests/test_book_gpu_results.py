"""GPU measurements read for chapter 3 (rqlib.book.gpu_results): the printed output of
``bench kernels`` with a ``torch.profiler`` table, the JSON of ``bench gpu``, and the choice of
the measurement made at the current kernel.

Synthetic files are written from fresh random numbers in the printed formats, so the parser is
checked on values it has not seen; printed values carry one decimal (two for MB), so a parsed
value must equal the drawn one rounded the same way."""

import json
import subprocess

import pytest
import torch

from rqlib.base.paths import repo_root
from rqlib.book import gpu_results

KERNELS = ("SDPA fp16", "fused_scores", "attention K packed, V fp16", "attention K, V packed")


def draw(rng, low: float, high: float, n: int) -> list[float]:
    return (low + (high - low) * torch.rand(n, generator=rng, dtype=torch.float64)).tolist()


def bench_output(rng, batch: int, lengths: tuple[int, ...]) -> tuple[str, list[dict]]:
    """The printed output of one ``bench kernels`` run, and the rows it prints."""
    lines = [
        "device: NVIDIA H200, peak HBM 4800.0 GB/s",
        "GPU check: quantize codes bit-identical to torch: True",
        "",
        f"batch {batch}, 32 query heads / 8 KV heads, head_dim 128, keys turboquant-prod 3 bits, "
        "values turboquant-mse 4 bits",
        " kv_len kernel                       time us   MB read    GB/s  % HBM  vs SDPA",
    ]
    rows = []
    for kv_len in lengths:
        times, mbs = draw(rng, 10, 5000, 4), draw(rng, 1, 1000, 4)
        for kernel, time_us, mb in zip(KERNELS, times, mbs):
            gbps = mb / time_us * 1e3
            lines.append(
                f"{kv_len:>7} {kernel:<26} {time_us:>9.1f} {mb:>9.2f} {gbps:>7.0f} "
                f"{100 * gbps / 4800:>5.1f}% {times[0] / time_us:>7.2f}x"
            )
            rows.append(
                {"batch": batch, "kv_len": kv_len, "kernel": kernel}
                | {"time_us": round(time_us, 1), "mb_read": round(mb, 2)}
            )
    return "\n".join(lines), rows


def profile_output(steps: int, wall: float, attention_us: float, launches: int) -> str:
    """A decode-step profile in torch.profiler's table layout (11 columns)."""

    def row(name, self_cuda, avg, calls):
        return (
            f"{name:>60}  {'0.00%':>12}  {'0.000us':>12}  {'0.00%':>12}  {'0.000us':>12}  "
            f"{'0.000us':>12}  {self_cuda:>12}  {'1.00%':>12}  {self_cuda:>12}  {avg:>12}  "
            f"{calls:>12}  "
        )

    total, average = f"{attention_us * steps / 1e3:.3f}ms", f"{attention_us:.3f}us"
    return "\n".join(
        [
            f"### kv_len 32768 batch 1: wall {wall:.0f} us per step",
            "-" * 60,
            row("attention_kernel", total, average, steps),
            row("reduce_kernel", "100.000us", f"{100 / steps:.3f}us", steps),
            row("cudaLaunchKernel", "0.000us", "0.000us", launches * steps),
            row("cudaStreamSynchronize", "0.000us", "0.000us", 3 * steps),
            f"Self CUDA time total: {2 * attention_us * steps:.3f}us",
        ]
    )  # fmt: skip


def test_the_printed_output_parses_to_the_printed_numbers(rng):
    first, rows_one = bench_output(rng, 1, (4096, 32768))
    second, rows_eight = bench_output(rng, 8, (32768,))
    wall, attention_us = draw(rng, 500, 3000, 1)[0], draw(rng, 10, 400, 1)[0]
    text = "\n".join(
        [
            "# GPU measurements, one H200, 2026-12-04, rqlib at 0123abc",
            "# stack: torch 2.11.0+cu130, triton 3.6.0 (a note), transformers 5.24.0",
            first,
            second,
            profile_output(5, wall, attention_us, 28),
        ]
    )
    found = gpu_results.parse_text(text, "made-up.txt")
    assert (found.commit, found.date, found.device) == ("0123abc", "2026-12-04", "NVIDIA H200")
    assert found.versions == {"torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.24.0"}
    assert found.peak_gbps == 4800.0 and found.geometry["kv_heads"] == 8
    assert found.timings.to_dict("records") == rows_one + rows_eight
    (step,) = found.profile.to_dict("records")
    assert step["wall_us"] == round(wall) and step["launches"] == 28 and step["syncs"] == 3
    # the profile prints three decimals of a microsecond
    assert step["attention_kernel_us"] == pytest.approx(attention_us, abs=5e-4)
    assert step["gpu_us"] == pytest.approx(2 * attention_us, abs=5e-4)
    with pytest.raises(ValueError, match="made-up.txt"):
        gpu_results.parse_text(first, "made-up.txt")  # no header line with the commit


def test_the_committed_measurement_parses():
    """The H200 measurement the chapter shows: every context it timed at batch 1 has SDPA and
    the packed call, and its profile counts whole launches and synchronizations a step."""
    (found,) = [m for m in gpu_results.load_all(repo_root() / "results" / "bench")]
    assert found.device.startswith("NVIDIA") and len(found.short_commit) == 7
    table = gpu_results.side_by_side(found, found.peak_gbps, 0.1)
    assert len(table) >= 2 and (table["whole call"] > table["kernels alone"]).all()
    for column in ("launches", "syncs", "copies"):
        assert (found.profile[column] == found.profile[column].round()).all()
    assert "cudaStreamSynchronize" in gpu_results.host_sentence(found, int(table.kv_len[0]))


@pytest.mark.parametrize("layout", ["bench gpu", "flat timings"])
def test_a_json_report_parses_in_both_layouts(tmp_path, rng, layout):
    sdpa, call, alone = draw(rng, 10, 3000, 3)
    header = {"device": "NVIDIA H100", "commit": "89abcdef" * 5, "versions": {"torch": "2.13.0"}}
    if layout == "bench gpu":
        row = {"batch": 1, "kv_len": 4096, "sdpa_us": sdpa, "call_us": call, "kernels_us": alone}
        row |= {"fp16_mb": 16.0, "packed_mb": 4.0}
        steps = {"kernels": {"status": "ok", "kv_heads": 8, "q_heads": 32, "rows": [row]}}
    else:
        timings = [
            {"kv_len": 4096, "batch": 1, "kernel": name, "time_us": t, "mb_read": mb}
            for name, t, mb in (
                (gpu_results.SDPA, sdpa, 16.0),
                (gpu_results.CALL, call, 4.0),
                (gpu_results.KERNELS_ALONE, alone, 4.0),
            )
        ]
        steps = {"timings": timings}
    (tmp_path / "gpu-h100-89abcdef.json").write_text(json.dumps({**header, "steps": steps}))
    (found,) = gpu_results.load_all(tmp_path)
    assert found.short_commit == "89abcde" and found.versions == {"torch": "2.13.0"}
    assert gpu_results.kernels_alone(found, 4096, 1) == alone
    table = gpu_results.side_by_side(found, 2000.0, 0.0)
    assert table["whole call"].tolist() == [call] and table["SDPA fp16"].tolist() == [sdpa]
    assert table["byte model, packed"].tolist() == [pytest.approx(4.0 / 2000 * 1e3)]
    assert f"{alone:.0f} µs of GPU time" in gpu_results.host_sentence(found, 4096)
    unfinished = {**header, "commit": "0" * 40, "steps": {"kernels": {"status": "timeout"}}}
    (tmp_path / "gpu-h100-000000000000.json").write_text(json.dumps(unfinished))
    assert sorted(len(m.timings) for m in gpu_results.load_all(tmp_path)) == [0, 3]
    (tmp_path / "gpu-broken.json").write_text("{")
    with pytest.raises(ValueError, match="gpu-broken.json"):
        gpu_results.load_all(tmp_path)


def git(folder, *args) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_the_measurement_at_the_current_kernel_is_preferred(tmp_path):
    kernels = tmp_path / gpu_results.KERNEL_PATH
    kernels.mkdir(parents=True)
    (kernels / "kernel.py").write_text("one\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first kernel")
    first = git(tmp_path, "rev-parse", "HEAD")
    text, _ = bench_output(torch.Generator().manual_seed(0), 1, (4096,))

    def measured(commit: str, date: str) -> gpu_results.Measurement:
        header = f"# GPU measurements, one H200, {date}, rqlib at {commit[:7]}\n"
        return gpu_results.parse_text(header + text, f"gpu-{date}.txt")

    assert gpu_results.kernel_unchanged(first, tmp_path) is True
    choice = gpu_results.choose([measured(first, "2026-01-01")], tmp_path)
    assert choice.current and "with the current kernel" in choice.sentence
    (kernels / "kernel.py").write_text("two\n")
    git(tmp_path, "commit", "-q", "-am", "second kernel")
    second = git(tmp_path, "rev-parse", "HEAD")
    assert gpu_results.kernel_unchanged(first, tmp_path) is False
    # the newer measurement at the old kernel loses to the older one at the current kernel
    both = [measured(first, "2026-02-01"), measured(second, "2026-01-15")]
    choice = gpu_results.choose(both, tmp_path)
    assert choice.current and choice.measurement.commit == second[:7]
    choice = gpu_results.choose(both[:1], tmp_path)
    assert not choice.current and "No GPU measurement with timings exists" in choice.sentence
    assert f"git diff {first[:7]}" in choice.sentence
    # a report at the current kernel whose kernel step timed out is named, not shown
    untimed = gpu_results.parse_json(
        {"device": "NVIDIA H200", "commit": second, "steps": {"kernels": {"status": "timeout"}}},
        "gpu-untimed.json",
    )
    choice = gpu_results.choose([*both[:1], untimed], tmp_path)
    assert choice.measurement is both[0] and "gpu-untimed.json" in choice.sentence
    assert "timeout" in choice.sentence
    assert gpu_results.kernel_unchanged("0" * 40, tmp_path) is None  # a commit git lacks
    assert gpu_results.kernel_unchanged(second + "-dirty", tmp_path) is None
    with pytest.raises(LookupError, match="no GPU timings"):
        gpu_results.choose([untimed], tmp_path)


def test_a_report_written_by_bench_gpu_reads_back(tmp_path, rng):
    """The kernels step of ``bench gpu`` (its own code, a small geometry, stand-in timers that
    return fresh random times), recorded in its report as the command records it, reads back
    with the same times and megabytes: the first storage's rows under the kernels' names (the
    ones the chapter's table reads), the trellis's under names that carry its tokens."""
    from rqlib.study import gpu_bench

    drawn = iter(draw(rng, 0.01, 5.0, 8))
    small = dict(hidden_size=256, intermediate_size=256, num_attention_heads=8)
    small |= dict(num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
    result = gpu_bench.kernel_timings(
        device="cpu",
        kv_lens=(300,),
        batches=(1,),
        timer=lambda fn: next(drawn),  # ms
        kernel_timer=lambda fn: 1e3 * next(drawn),  # µs
        **small,
    )
    header = {"device": "NVIDIA H200", "commit": "f" * 40, "versions": {"torch": "2.13.0"}}
    report = gpu_bench.Report(tmp_path / "gpu-nvidia-h200-ffffffffffff.json", header)
    report.record("kernels", {"status": "ok", "seconds": 1.0, **result})
    (found,) = gpu_results.load_all(tmp_path)
    row, trellis = result["rows"]
    table = gpu_results.side_by_side(found, 4800.0, 0.0)
    assert table["SDPA fp16"].tolist() == [pytest.approx(row["sdpa_us"])]
    assert table["whole call"].tolist() == [pytest.approx(row["call_us"])]
    assert table["kernels alone"].tolist() == [pytest.approx(row["kernels_us"])]
    assert table["byte model, packed"].tolist() == [pytest.approx(row["packed_mb"] / 4.8)]
    assert found.geometry["kv_heads"] == 2 and "2 KV heads" in gpu_results.geometry_phrase(found)
    assert found.geometry["spec"] == gpu_bench.KERNEL_SPEC
    times = found.timings.set_index("kernel").time_us
    assert times[gpu_results.WRITE] == pytest.approx(row["write_us"])
    for kernel, column in ((gpu_results.CALL, "call_us"), (gpu_results.WRITE, "write_us")):
        assert times[f"{kernel} (tcq:tb)"] == pytest.approx(trellis[column])
    assert len(found.timings) == 8
