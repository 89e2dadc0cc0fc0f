"""``python -m rqlib bench gpu``: the project's own check of the GPU path, in one run.

Five steps, in order, each under its own time limit, each printing as it goes and adding its
results to one JSON report as soon as it ends (so a step that runs out of time leaves the earlier
ones on disk, and the timing steps keep the rows they finished before it stopped):

1. ``correctness``: every kernel against the torch path on the device, at irregular shapes
   (a batch of 3 with a prompt of 77 tokens and a decode step after it), for every layer format
   of every preset on the tiny Llama: quantize (codes bit-identical), fused scores, and the
   attention of a prompt and of a decode step (relative error).
2. ``generate``: ``generate()`` through the kernels against the torch path, on the tiny Llama,
   Gemma 3 and Qwen2 models, with every preset: the same tokens, and the largest logit gap.
3. ``kernels``: one decode step against fp16 SDPA at each context and batch, for each storage of
   ``KERNEL_SPECS`` (Lloyd-Max codes, and the same bits as a tail-biting trellis): the whole
   attention call (``rqlib.kernels.attention``, host work included) timed with
   ``triton.testing.do_bench`` (the L2 cache cleared between repetitions), the GPU time of the
   attention and reduce kernels alone (``torch.profiler``), with the bytes each must read, and
   the write of the step's new token into the cache (``layer.update``: its encoder, norms and
   band), timed the same way.
4. ``end_to_end``: ``generate()`` tokens per second and prefill time of a random-weight model of
   Llama-3-8B's geometry (32 layers, fp16, built from a config), the fp16 ``DynamicCache``
   against the presets, at each batch, with a long prompt.
5. ``startup``: seconds from ``compress()`` to the first generated token of a preset model in a
   fresh process, cold (an empty Triton cache) and warm (the same cache again).

Nothing here runs without CUDA: :func:`run` refuses. The tests run the steps' own code on small
shapes on the CPU (``device="cpu"``, the kernels interpreted), so a GPU session spends its time
measuring, not debugging.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rqlib import kernels
from rqlib.base.files import atomic_write_text
from rqlib.kernels.state import CausalMask
from rqlib.spec.presets import PRESETS
from rqlib.study import tiny

STEPS = ("correctness", "generate", "kernels", "end_to_end", "startup")
#: seconds each step may take before it is stopped (9 minutes 40 seconds in all)
STEP_LIMITS = {
    "correctness": 60,
    "generate": 110,
    "kernels": 200,
    "end_to_end": 150,
    "startup": 60,
}
KV_LENS = (4096, 16384, 32768, 65536, 131072)
BATCHES = (1, 8)
#: Llama-3-8B's geometry, the model of the end-to-end and kernel steps
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)
#: what the kernel step stores: the presets' codes at 3 bits for keys and values (their
#: budgets allocate 2 to 4 bits a layer), without the calibrated key means, and their recent
#: band with its tokens in the main codes too (``twice``, as the timings in GPU.md were taken)
KERNEL_SPEC = "turboquant-mse:b3:sink1:win64:wb=8:nc:nm=6"
#: the storages the kernel step times: those codes, and the same bits coded by a tail-biting
#: trellis (read through its shift register, written by the Viterbi kernel)
KERNEL_SPECS = (KERNEL_SPEC, f"{KERNEL_SPEC}:tcq:tb")
#: tokens reserved past the context for the write timings, each of whose calls appends one
WRITE_RESERVE = 4096
#: what the correctness and generate steps check besides the presets: rq-3's bits coded by the
#: tail-biting trellis, whose encoder is a kernel of its own
TRELLIS_PRESET = "rq-3:tcq:tb"
CHECKED = (*PRESETS, TRELLIS_PRESET)
#: the relative error of the attention on the device against the torch path above which the
#: correctness step fails: the kernel's fp16 codebook and the fp16 parts of its tensor-core
#: products keep outputs within about 1e-5 of the torch path (tests/test_kernels_attention.py);
#: fp16 queries of the kernel step round to 2^-11
MAX_RELATIVE_ERROR = 1e-3


class StepTimeout(Exception):
    """A step ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`StepTimeout` in this (main) thread after ``seconds``."""

    def expire(signum, frame):
        raise StepTimeout(f"stopped after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Report:
    """The JSON report: a header (device, versions, commit) and each step's results, written
    atomically to ``path`` after every step."""

    path: Path
    header: dict
    steps: dict = field(default_factory=dict)

    def record(self, step: str, result: dict) -> None:
        self.steps[step] = result
        data = {**self.header, "steps": self.steps}
        atomic_write_text(self.path, json.dumps(data, indent=1, default=str) + "\n")


def say(*parts) -> None:
    print(*parts, flush=True)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |got - expected| / max |expected|``, in float64."""
    got, expected = got.double(), expected.double()
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


# ---- 1. correctness --------------------------------------------------------------------------
def correctness(
    device: str = "cuda", draw: int = 0, presets=CHECKED, batch: int = 3, prompt: int = 77
) -> dict:
    """Every kernel against the torch path, per preset, on each distinct layer format of the
    preset resolved for the tiny Llama: a left-padded batch of ``batch`` with a prompt of
    ``prompt`` tokens (irregular sizes), then one decode step. Returns ``{"presets": {preset:
    {check: value}}, "ok": ...}``."""
    from rqlib.hf import compress
    from rqlib.kernels import numerics

    results, ok = {}, True
    for name in presets:
        model = tiny.tiny_model("llama", draw).to(device)
        config = tiny.preset_config(name, model)
        generator = torch.Generator().manual_seed(draw)
        ids = torch.randint(1, tiny.VOCAB, (batch, prompt + 1), generator=generator).to(device)
        mask = torch.ones_like(ids)
        mask[-1, :5] = 0
        worst = {"quantize_codes_equal": True, "scores": 0.0, "prompt": 0.0, "decode": 0.0}
        seen = set()
        with torch.no_grad(), compress(model, config, tokenizer=tiny.ByteTokenizer()) as cache:
            cache.set_backend("torch")
            model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache)
            for layer in cache.layers:
                codecs = (layer.key_codec, layer.value_codec, layer.key_band_codec)
                layout = tuple(None if c is None else repr(c.parts) for c in codecs)
                if layout in seen or layer.key_codec is None:
                    continue
                seen.add(layout)
                state = layer.state()
                _, kv_heads, dim = layer.shape
                q = torch.randn(batch, 2 * kv_heads, prompt, dim, generator=generator).to(device)
                prompt_mask = CausalMask(batch, 0, prompt, 0, prompt)
                got = kernels.attention(state, q, prompt_mask, scale=0.125, backend="triton")
                expected = kernels.attention(
                    numerics.on_kernel_codebook(state), q, prompt_mask, scale=0.125,
                    backend="torch",
                )  # fmt: skip
                worst["prompt"] = max(worst["prompt"], relative_error(got, expected))
                x = torch.randn(batch, kv_heads, prompt, dim, generator=generator).to(device)
                quantizer = layer.key_codec.parts[0].quantizer
                ours = kernels.quantize(quantizer, x, backend="triton")
                theirs = kernels.quantize(quantizer, x, backend="torch")
                worst["quantize_codes_equal"] &= bool(torch.equal(ours.codes, theirs.codes))
                scores = kernels.fused_scores(q, ours, scale=0.125, backend="triton")
                reference = kernels.fused_scores(q, ours, scale=0.125, backend="torch")
                worst["scores"] = max(worst["scores"], relative_error(scores, reference))
            model(ids[:, prompt:], attention_mask=mask, cache=cache)
            for layer in cache.layers:
                if layer.key_codec is None:
                    continue
                state = layer.state()
                _, kv_heads, dim = layer.shape
                q = torch.randn(batch, 2 * kv_heads, 1, dim, generator=generator).to(device)
                step_mask = CausalMask(batch, prompt, 1, 0, prompt + 1)
                got = kernels.attention(state, q, step_mask, scale=0.125, backend="triton")
                expected = kernels.attention(
                    numerics.on_kernel_codebook(state), q, step_mask, scale=0.125,
                    backend="torch",
                )  # fmt: skip
                worst["decode"] = max(worst["decode"], relative_error(got, expected))
        passed = (
            worst["quantize_codes_equal"]
            and max(worst["scores"], worst["prompt"], worst["decode"]) <= MAX_RELATIVE_ERROR
        )
        ok &= passed
        results[name] = {**worst, "layer_formats": len(seen), "ok": passed}
        say(
            f"  {name:<11} formats {len(seen)}  codes equal {worst['quantize_codes_equal']}  "
            f"scores {worst['scores']:.1e}  prompt {worst['prompt']:.1e}  "
            f"decode {worst['decode']:.1e}  {'ok' if passed else 'FAILED'}"
        )
    return {"presets": results, "ok": ok, "max_relative_error": MAX_RELATIVE_ERROR}


# ---- 2. generate -----------------------------------------------------------------------------
def generate_equivalence(
    device: str = "cuda", draw: int = 0, new_tokens: int = 12, kinds=tiny.KINDS, presets=None
) -> dict:
    """``generate()`` through the kernels and through the torch path, greedy, on each tiny
    model with each preset: whether the tokens are the same, and the largest logit gap."""
    from rqlib.hf import compress

    presets = CHECKED if presets is None else presets
    rows, ok = [], True
    for kind in kinds:
        for name in presets:
            model = tiny.tiny_model(kind, draw).to(device)
            config = tiny.preset_config(name, model)
            generator = torch.Generator().manual_seed(draw)
            ids = torch.randint(1, tiny.VOCAB, (2, 20), generator=generator).to(device)
            outputs = {}
            for backend in ("triton", "torch"):
                with (
                    torch.no_grad(),
                    compress(model, config, tokenizer=tiny.ByteTokenizer()) as cache,
                ):
                    cache.set_backend(backend)
                    outputs[backend] = model.generate(
                        ids, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                    )  # fmt: skip
            same = torch.equal(outputs["triton"].sequences, outputs["torch"].sequences)
            gap = max(
                float((a - b).abs().max())
                for a, b in zip(outputs["triton"].logits, outputs["torch"].logits)
            )
            ok &= same
            rows.append({"model": kind, "preset": name, "tokens_equal": same, "max_logit_gap": gap})
            say(f"  {kind:<7} {name:<11} tokens equal {same}  largest logit gap {gap:.1e}")
    return {"runs": rows, "ok": ok}


# ---- 3. kernels ------------------------------------------------------------------------------
def kernel_layer(device: str, batch: int, kv_len: int, spec: str = KERNEL_SPEC, **geometry):
    """Layer 0 of a cache in ``spec`` for a one-layer model of Llama-3-8B's geometry (or
    ``geometry`` overrides), holding ``kv_len`` random fp16 keys and values for each of
    ``batch`` sequences (stored in prompt chunks, with room for ``WRITE_RESERVE`` more tokens),
    and those fp16 tensors. The codes are written on the torch path, or for a trellis by the
    layer's own backend: the torch search of a trellis takes minutes at these lengths."""
    from rqlib.hf.integration import build_cache
    from rqlib.spec.config import CompressionConfig

    model = llama_8b_geometry(device, layers=1, **geometry)
    config = CompressionConfig.parse(spec)
    layer = build_cache(model, config).layers[0]
    layer.active = True
    d, kv_heads = model.config.head_dim, model.config.num_key_value_heads
    generator = torch.Generator(device=device).manual_seed(kv_len)
    shape = (batch, kv_heads, kv_len, d)
    k = torch.randn(shape, device=device, generator=generator).half()
    v = torch.randn(shape, device=device, generator=generator).half()
    layer.backend = "auto" if config.trellis_state_bits else "torch"
    for start in range(0, kv_len, 8192):
        layer.update(k[:, :, start : start + 8192], v[:, :, start : start + 8192])
        layer.reserve(kv_len + WRITE_RESERVE)
    layer.backend = "auto"
    return layer, k, v


def kernel_gpu_us(fn: Callable[[], object], names=("attention_kernel", "reduce_kernel")) -> float:
    """Microseconds of device time per call of ``fn`` spent in kernels whose name contains one
    of ``names`` (torch.profiler over 20 calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    total = sum(
        event.device_time_total
        for event in prof.key_averages()
        if any(name in event.key for name in names)
    )
    return total / 20


def kernel_timings(
    device: str = "cuda",
    kv_lens=KV_LENS,
    batches=BATCHES,
    specs=KERNEL_SPECS,
    timer: Callable[[Callable[[], object]], float] | None = None,
    kernel_timer: Callable[[Callable[[], object]], float] | None = None,
    rows: list | None = None,
    **geometry,
) -> dict:
    """Per storage of ``specs``, batch and kv_len: fp16 SDPA, and the packed cache's whole
    call, kernels and one token's write, in µs, with the bytes they must read. ``timer(fn) ->
    ms`` defaults to ``triton.testing.do_bench`` (L2 cleared between repetitions),
    ``kernel_timer(fn) -> µs`` to :func:`kernel_gpu_us`. Each row is appended to ``rows`` (a
    new list by default) as it is timed."""
    if timer is None:
        import triton.testing

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=50)

    kernel_timer = kernel_gpu_us if kernel_timer is None else kernel_timer
    rows = [] if rows is None else rows
    for spec in specs:
        say(f"  {spec}")
        say(f"  {'batch':>5} {'kv_len':>7} {'SDPA us':>9} {'call us':>9} {'kernels us':>10} "
            f"{'vs SDPA':>8} {'GB/s':>7} {'write us':>9}")  # fmt: skip
        for batch in batches:
            for kv_len in kv_lens:
                row = kernel_row(device, batch, kv_len, timer, kernel_timer, spec, **geometry)
                rows.append(row)
                gbps = 1e3 * row["packed_mb"] / max(row["kernels_us"], 1e-9)  # MB per µs: TB/s
                say(
                    f"  {batch:>5} {kv_len:>7} {row['sdpa_us']:>9.1f} {row['call_us']:>9.1f} "
                    f"{row['kernels_us']:>10.1f} {row['sdpa_us'] / row['call_us']:>7.2f}x "
                    f"{gbps:>7.0f} {row['write_us']:>9.1f}"
                )
                if device == "cuda":
                    torch.cuda.empty_cache()
    geometry = {**LLAMA_8B, **geometry}
    return {
        "spec": specs[0],
        "specs": list(specs),
        "q_heads": geometry["num_attention_heads"],
        "kv_heads": geometry["num_key_value_heads"],
        "head_dim": geometry["head_dim"],
        "rows": rows,
    }


def kernel_row(device, batch, kv_len, timer, kernel_timer, spec=KERNEL_SPEC, **geometry) -> dict:
    """One row of :func:`kernel_timings`: the attention of a decode step over ``kv_len`` tokens
    stored as ``spec``, then the write of new tokens (each timed call appends one, within the
    room :func:`kernel_layer` reserved)."""
    from rqlib.study.bench import decode_step

    layer, k, v = kernel_layer(device, batch, kv_len, spec, **geometry)
    kv_heads, d = k.shape[1], k.shape[3]
    q_heads = {**LLAMA_8B, **geometry}["num_attention_heads"]
    q = torch.randn(batch, q_heads, 1, d, device=device).half()
    scale = 1 / math.sqrt(d)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=scale, enable_gqa=True
        )

    def call():
        return decode_step(layer, q, scale)

    new_key, new_value = torch.randn(2, batch, kv_heads, 1, d, device=device).half()

    def write():
        return layer.update(new_key, new_value)

    main = (layer.streams["keys"], layer.streams["values"])
    per_token = sum(ring.bytes_per_token() for stream in main for ring in stream.rings)
    return {  # in this order: the writes come last, after the attention is timed at kv_len
        "spec": spec,
        "batch": batch,
        "kv_len": kv_len,
        "sdpa_us": 1e3 * timer(sdpa),
        "call_us": 1e3 * timer(call),
        "kernels_us": kernel_timer(call),
        "write_us": 1e3 * timer(write),
        "fp16_mb": 2 * k.numel() * 2 / 1e6,
        "packed_mb": per_token * batch * kv_heads * kv_len / 1e6,
    }


# ---- 4. end to end ---------------------------------------------------------------------------
def llama_8b_geometry(device: str, layers: int | None = None, **overrides) -> torch.nn.Module:
    """A random-weight fp16 model of Llama-3-8B's geometry (``layers`` of them, default 32),
    built from a config on ``device`` (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    geometry = {**LLAMA_8B, **overrides}
    if layers is not None:
        geometry["num_hidden_layers"] = layers
    config = LlamaConfig(**geometry, torch_dtype=torch.float16)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.float16)
    return model.eval()


def generate_timing(model, cache_factory, ids: torch.Tensor, new_tokens: int) -> dict:
    """Prefill seconds and decode tokens per second of ``model.generate`` from ``ids`` with the
    cache ``cache_factory()`` gives (a context manager yielding the cache)."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with torch.no_grad(), cache_factory() as cache:
        sync()
        start = time.perf_counter()
        model(ids, cache=cache, use_cache=True)
        sync()
        prefill = time.perf_counter() - start
        token = ids[:, -1:]
        steps = []
        for _ in range(new_tokens):
            start = time.perf_counter()
            logits = model(token, cache=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            sync()
            steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    return {
        "prefill_s": prefill,
        "step_ms": 1e3 * step,
        "tokens_per_s": ids.shape[0] / step,
        "step_ms_spread": [1e3 * min(steps), 1e3 * max(steps)],
    }


def end_to_end(
    device: str = "cuda",
    context: int = 32768,
    batches=BATCHES,
    new_tokens: int = 16,
    layers: int | None = None,
    presets=("rq-3",),
    rows: list | None = None,
    **geometry,
) -> dict:
    """``generate`` timings of the fp16 ``DynamicCache`` and the presets on Llama-3-8B's
    geometry (:func:`llama_8b_geometry`) with a ``context``-token prompt at each batch, each
    row appended to ``rows`` (a new list by default) as it is timed."""
    from transformers import DynamicCache

    from rqlib.hf import compress

    model = llama_8b_geometry(device, layers, **geometry)
    configs = {name: tiny.preset_config(name, model) for name in presets}
    rows = [] if rows is None else rows
    for batch in batches:
        generator = torch.Generator().manual_seed(batch)
        vocab = model.config.vocab_size
        ids = torch.randint(1, vocab, (batch, context), generator=generator).to(device)
        methods = {
            "fp16-dynamic": lambda: contextlib.nullcontext(DynamicCache(config=model.config))
        }
        for name, config in configs.items():
            methods[f"preset:{name}"] = lambda config=config: compress(
                model, config, tokenizer=tiny.ByteTokenizer()
            )
        for label, factory in methods.items():
            row = {"batch": batch, "context": context, "method": label}
            row.update(generate_timing(model, factory, ids, new_tokens))
            rows.append(row)
            say(
                f"  batch {batch} {label:<14} prefill {row['prefill_s']:.2f} s  "
                f"{row['tokens_per_s']:.1f} tokens/s"
            )
            if device == "cuda":
                torch.cuda.empty_cache()
    return {"layers": model.config.num_hidden_layers, "rows": rows}


# ---- 5. startup ------------------------------------------------------------------------------
STARTUP_SCRIPT = """
import sys, time, torch
start = time.perf_counter()
from rqlib.hf import compress
from rqlib.study import gpu_bench, tiny
model = gpu_bench.llama_8b_geometry(sys.argv[1], layers=int(sys.argv[2]))
config = tiny.preset_config(sys.argv[3], model)
ids = torch.randint(1, 1000, (1, 4096)).to(sys.argv[1])
loaded = time.perf_counter()
with torch.no_grad(), compress(model, config, tokenizer=tiny.ByteTokenizer()) as cache:
    model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
print("SECONDS", time.perf_counter() - loaded, loaded - start)
"""


def startup(device: str = "cuda", layers: int = 4, preset: str = "rq-3", cache_dir=None) -> dict:
    """Seconds from ``compress()`` to two generated tokens (after a 4096-token prompt) of a
    ``preset`` model of Llama-3-8B's geometry with ``layers`` layers, in a fresh process: cold
    (an empty Triton cache, ``cache_dir``) and warm (the same cache again)."""
    import tempfile

    results = {}
    with contextlib.ExitStack() as stack:
        if cache_dir is None:
            cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="triton-"))
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir)}
        for run in ("cold", "warm"):
            done = subprocess.run(
                [sys.executable, "-c", STARTUP_SCRIPT, device, str(layers), preset],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            lines = [line for line in done.stdout.splitlines() if line.startswith("SECONDS")]
            if done.returncode or not lines:
                raise RuntimeError(f"the {run} start failed: {done.stderr.strip()[-2000:]}")
            seconds, imports = map(float, lines[-1].split()[1:])
            results[run] = {"first_tokens_s": seconds, "build_s": imports}
            say(f"  {run}: {seconds:.1f} s to the first tokens (model built in {imports:.1f} s)")
    return {"layers": layers, "preset": preset, **results}


# ---- the run ---------------------------------------------------------------------------------
def run(report: Report, steps=STEPS, limits=None, **options) -> bool:
    """Run ``steps`` on CUDA in order, each under its limit (``STEP_LIMITS``, overridden by
    ``limits``), recording each in ``report`` (a timing step that stops early with the rows it
    finished); ``options`` go to the steps that take them
    (``kv_lens``, ``batches``, ``context``, ``presets``). Returns whether every check passed
    and every step finished."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench gpu needs a CUDA device; none is visible to torch")
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise ValueError(f"unknown steps {unknown}; the steps are {', '.join(STEPS)}")
    limits = {**STEP_LIMITS, **(limits or {})}
    finished = {"kernels": [], "end_to_end": []}  # the rows a timing step has timed so far
    functions = {
        "correctness": lambda: correctness(),
        "generate": lambda: generate_equivalence(),
        "kernels": lambda: kernel_timings(
            kv_lens=options.get("kv_lens", KV_LENS),
            batches=options.get("batches", BATCHES),
            rows=finished["kernels"],
        ),
        "end_to_end": lambda: end_to_end(
            context=options.get("context", 32768),
            batches=options.get("batches", BATCHES),
            presets=options.get("presets", ("rq-3",)),
            rows=finished["end_to_end"],
        ),
        "startup": lambda: startup(),
    }
    everything_ok = True
    for step in [s for s in STEPS if s in steps]:
        say(f"== {step} (limit {limits[step]} s)")
        start = time.perf_counter()
        try:
            with time_limit(limits[step]):
                result = functions[step]()
            status = "ok" if result.get("ok", True) else "failed"
        except StepTimeout as error:
            result, status = {"error": str(error)}, "timeout"
        except Exception as error:  # noqa: BLE001 - recorded, and the next step still runs
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            result, status = {"error": f"{type(error).__name__}: {first}"}, "error"
        if status in ("timeout", "error") and finished.get(step):
            result["rows"] = finished[step]  # what it timed before it stopped
        seconds = time.perf_counter() - start
        everything_ok &= status == "ok"
        report.record(step, {"status": status, "seconds": seconds, **result})
        say(f"== {step}: {status} in {seconds:.0f} s")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return everything_ok
