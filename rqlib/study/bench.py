"""Benchmarks: ``python -m rqlib bench kernels`` and ``python -m rqlib bench decode-cpu``.

``decode-cpu`` times a model's decode steps on CPU, the uncompressed ``DynamicCache`` and the
presets side by side in one run (:func:`decode_cpu`); what follows is about ``kernels``.

On a CUDA device it first checks the Triton kernels against the torch implementations on a few
small shapes (the tests only ever ran them in the interpreter), then times ``fused_scores`` and
the fused attention of a decode step (:func:`rqlib.kernels.attention`) against torch's SDPA on
fp16 keys/values for kv_len 1k ... 128k
(head_dim 128, GQA 4 by default), and prints bytes read, achieved GB/s, the fraction of the
device's HBM bandwidth and the speed-up over SDPA.

Without a GPU it prints the byte-count model: bytes per token and KV head for each storage
format, and the speed-up a memory-bound kernel would get from reading fewer bytes. Timings need
a GPU.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rqlib import kernels
from rqlib.core.quantizers import make_quantizer
from rqlib.kernels import limits as geo

# Peak HBM bandwidth in GB/s, matched against torch.cuda.get_device_name (first match wins).
HBM_GBPS = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("RTX 4090", 1008.0),
)
DEFAULT_KV_LENS = (1024, 4096, 16384, 32768, 65536, 131072)


# --------------------------------------------------------------------------------------------
# the byte-count model


def byte_formats(args) -> list[tuple[str, float, str]]:
    """(format, bytes per token per KV head, what it stores) for keys and values."""
    d = args.head_dim
    keys = make_quantizer(args.key_method, d, args.key_bits)
    values = make_quantizer(args.value_method, d, args.value_bits)
    mse_keys = make_quantizer(args.key_method.replace("-prod", "-mse"), d, args.key_bits)
    norm_bytes = keys.norm_bits / 8
    return [
        ("fp16", 2.0 * d, "d fp16 numbers"),
        ("one byte per code", keys.rotated_dim + norm_bytes, "D uint8 codes + fp16 norm"),
        (
            f"packed {mse_keys.bits}-bit codes",
            mse_keys.bits_per_vector / 8,
            f"{mse_keys.method} {mse_keys.bits} bits: codes + norm",
        ),
        (
            f"packed {keys.mse_bits}-bit + QJL",
            keys.bits_per_vector / 8,
            f"{keys.method} {keys.bits} bits: codes + norm + {keys.qjl_dim} signs + norm",
        ),
        (
            f"packed {values.bits}-bit values",
            values.bits_per_vector / 8,
            f"{values.method} {values.bits} bits: codes + norm",
        ),
    ]


def print_byte_model(args) -> None:
    """Bytes per token per KV head for each storage format, and the memory-bound speed-up."""
    d = args.head_dim
    print(f"Byte-count model, head_dim {d} (per token and KV head; norms fp16)\n")
    print(f"{'format':<26} {'bytes':>8} {'vs fp16':>8}  stores")
    formats = byte_formats(args)
    fp16 = formats[0][1]
    for name, nbytes, what in formats:
        print(f"{name:<26} {nbytes:>8.1f} {fp16 / nbytes:>7.2f}x  {what}")
    keys, values = formats[3][1], formats[4][1]
    print(
        f"\nDecode attention reads K and V once: fp16 {2 * fp16:.0f} bytes per token and KV head, "
        f"{args.key_bits}-bit keys + {args.value_bits}-bit values {keys + values:.0f} bytes: "
        f"a memory-bound kernel can be at most {2 * fp16 / (keys + values):.2f}x faster than "
        "fp16 SDPA."
    )
    tokens = 32768
    heads = args.kv_heads * args.batch
    print(
        f"At {tokens} tokens x {heads} KV heads one layer reads "
        f"{2 * fp16 * tokens * heads / 2**20:.1f} MiB (fp16) vs "
        f"{(keys + values) * tokens * heads / 2**20:.1f} MiB (compressed)."
    )


# --------------------------------------------------------------------------------------------
# GPU timings


def hbm_peak_gbps(args) -> float | None:
    if args.hbm_gbps is not None:
        return args.hbm_gbps
    name = torch.cuda.get_device_name()
    for key, gbps in HBM_GBPS:
        if key in name:
            return gbps
    return None


def decode_layer(key_qz, value_qz, k: torch.Tensor, v: torch.Tensor, n_sink=4, band=64):
    """One cache layer holding ``k``, ``v`` ``[B, KV, S, d]``: keys as ``key_qz`` codes,
    values as ``value_qz`` codes (``None``: exact), exact sink tokens and an exact recent band."""
    from rqlib.hf.cache import CompressedLayer
    from rqlib.hf.codec import ChannelPart, VectorCodec

    d = k.shape[-1]

    def codec(quantizer):
        return None if quantizer is None else VectorCodec([ChannelPart(quantizer, None)], d)

    layer = CompressedLayer(0, codec(key_qz), codec(value_qz), n_sink, band)
    layer.active = True
    layer.update(k, v)
    return layer


def decode_step(layer, q: torch.Tensor, scale: float, backend: str | None = None):
    """The attention of a decode query ``q [B, Hq, 1, d]`` over everything ``layer`` holds."""
    from rqlib.kernels.state import CausalMask

    state = layer.state()
    length = state.end
    mask = CausalMask(q.shape[0], length - 1, 1, 0, length)
    state = dataclasses.replace(state, start=length - 1)
    return kernels.attention(state, q, mask, scale=scale, backend=backend)


def check_on_gpu(args, device, length: int = 1000) -> None:
    """Triton vs torch on small irregular shapes; raises if they disagree."""
    generator = torch.Generator(device=device).manual_seed(0)
    d, group = args.head_dim, args.group
    key_qz = make_quantizer(args.key_method, d, args.key_bits)
    value_qz = make_quantizer(args.value_method, d, args.value_bits)
    k = torch.randn(2, 2, length, d, device=device, generator=generator)
    v = torch.randn(2, 2, length, d, device=device, generator=generator)
    q = torch.randn(2, 2 * group, 1, d, device=device, generator=generator)
    keys = key_qz.quantize(k)
    triton_keys = kernels.quantize(key_qz, k)
    codes_equal = torch.equal(triton_keys.codes, keys.codes)
    packed = decode_layer(key_qz, value_qz, k, v)
    exact_values = decode_layer(key_qz, None, k.half(), v.half())
    checks = {
        "fused_scores": (
            kernels.fused_scores(q, keys, scale=0.1),
            kernels.fused_scores(q, keys, scale=0.1, backend="torch"),
        ),
        "attention, exact fp16 V": (
            decode_step(exact_values, q.half(), 0.1),
            decode_step(exact_values, q, 0.1, "torch"),
        ),
        "attention, packed V": (
            decode_step(packed, q, 0.1),
            decode_step(packed, q, 0.1, "torch"),
        ),
    }
    print(f"GPU check: quantize codes bit-identical to torch: {codes_equal}")
    worst = 0.0
    for name, (got, expected) in checks.items():
        error = float((got - expected).abs().max() / expected.abs().max())
        worst = max(worst, error)
        print(f"GPU check: {name:<24} relative error vs torch {error:.2e}")
    if worst > 1e-3 or not codes_equal:  # fp16 queries and the fp16 codebook round to 2^-11
        raise RuntimeError("the Triton kernels disagree with the torch references on this GPU")


def run_gpu(args) -> int:
    """Time fused_scores / the fused attention against fp16 SDPA for each kv_len."""
    device = torch.device("cuda")
    peak = hbm_peak_gbps(args)
    print(f"device: {torch.cuda.get_device_name()}, peak HBM {peak or 'unknown'} GB/s")
    check_on_gpu(args, device)

    d, batch, kv_heads = args.head_dim, args.batch, args.kv_heads
    q_heads = kv_heads * args.group
    key_qz = make_quantizer(args.key_method, d, args.key_bits)
    value_qz = make_quantizer(args.value_method, d, args.value_bits)
    scale = 1 / math.sqrt(d)
    header = (
        f"{'kv_len':>7} {'kernel':<26} {'time us':>9} {'MB read':>9} {'GB/s':>7} "
        f"{'% HBM':>6} {'vs SDPA':>8}"
    )
    print(
        f"\nbatch {batch}, {q_heads} query heads / {kv_heads} KV heads, head_dim {d}, "
        f"keys {key_qz.method} {key_qz.bits} bits, values {value_qz.method} "
        f"{value_qz.bits} bits\n{header}"
    )
    for kv_len in args.kv_lens:
        timings = time_one_length(args, kv_len, key_qz, value_qz, scale, device)
        for name, ms, nbytes, sdpa_ms in timings:
            gbps = nbytes / ms / 1e6
            share = f"{100 * gbps / peak:>5.1f}%" if peak else "     ?"
            print(
                f"{kv_len:>7} {name:<26} {ms * 1e3:>9.1f} {nbytes / 1e6:>9.2f} {gbps:>7.0f} "
                f"{share} {sdpa_ms / ms:>7.2f}x"
            )
        torch.cuda.empty_cache()
    print(
        "\nMB read counts the bytes each kernel must read at least (stored cache + partial "
        "results); GB/s = MB read / time. The target: 'attention K, V packed' >= 2.5x SDPA at "
        "32k with >= 70% of HBM bandwidth."
    )
    return 0


def partial_bytes(layer, q_heads: int, batch: int, value_width: int, device) -> int:
    """Bytes of the attention's partial results in a decode step, written once and read back
    once, with the splits the launch chooses on ``device``
    (:func:`rqlib.kernels.launch.split_plan`)."""
    from rqlib.kernels.launch import split_plan

    state = layer.state()
    kv_heads = state.keys.rings[0].heads
    rows = q_heads // kv_heads  # one query token: the GQA group
    span = state.end - state.first
    splits, _ = split_plan(span, batch * kv_heads, torch.device(device), None)
    return batch * kv_heads * splits * geo.partial_bytes(rows, geo.accumulator_width(value_width))


def time_one_length(args, kv_len: int, key_qz, value_qz, scale: float, device):
    """(name, milliseconds, bytes read, SDPA milliseconds) of each kernel at one kv_len."""
    import triton.testing

    batch, kv_heads, d = args.batch, args.kv_heads, args.head_dim
    q_heads = kv_heads * args.group
    k = torch.randn(batch, kv_heads, kv_len, d, device=device, dtype=torch.float16)
    v = torch.randn(batch, kv_heads, kv_len, d, device=device, dtype=torch.float16)
    q = torch.randn(batch, q_heads, 1, d, device=device, dtype=torch.float16)
    keys = kernels.quantize(key_qz, k)
    exact_values = decode_layer(key_qz, None, k, v, n_sink=0, band=0)
    packed = decode_layer(key_qz, value_qz, k, v, n_sink=0, band=0)
    fp16_bytes = 2 * k.numel() * k.element_size()
    key_bytes = batch * kv_heads * kv_len * key_qz.bits_per_vector // 8
    value_bytes = batch * kv_heads * kv_len * value_qz.bits_per_vector // 8
    runs = [
        (
            "SDPA fp16",
            lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, scale=scale, enable_gqa=True
            ),
            fp16_bytes,
        ),
        (
            "fused_scores",
            lambda: kernels.fused_scores(q, keys, scale=scale),
            keys.nbytes() + batch * q_heads * kv_len * 4,
        ),
        (
            "attention K packed, V fp16",
            lambda: decode_step(exact_values, q, scale),
            key_bytes + v.numel() * 2 + partial_bytes(exact_values, q_heads, batch, d, device),
        ),
        (
            "attention K, V packed",
            lambda: decode_step(packed, q, scale),
            key_bytes + value_bytes + partial_bytes(packed, q_heads, batch, d, device),
        ),
    ]
    results = []
    for name, fn, nbytes in runs:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
        sdpa_ms = results[0][1] if results else ms
        results.append((name, ms, nbytes, sdpa_ms))
    return results


# --------------------------------------------------------------------------------------------
# decode steps on CPU, side by side


#: The label suffix of a preset timed with a decoded copy of its codes.
DECODED_COPY = "+copy"


def decode_cpu(
    model_name: str = "smollm2-135m",
    context: int = 1024,
    steps: int = 32,
    presets: tuple[str, ...] = ("rq-3.5",),
    threads: int | None = None,
    progress: bool = True,
    batch: int = 1,
) -> dict:
    """Median time per decode step after ``context`` tokens: fp ``DynamicCache`` and presets.

    Each preset is timed twice: as stored (``preset:NAME``: attention decodes the packed codes at
    every step) and with a decoded copy (``preset:NAME+copy``,
    :meth:`rqlib.hf.cache.CompressedCache.keep_decoded`, what ``rqlib eval --mode decode`` runs).
    Each method gets its own copy of the model and its own cache, prefilled with the same
    ``context`` tokens of pydoc; then the next ``steps`` tokens are fed one at a time, the methods
    taking turns at every step (in a rotating order), so that a change of machine load hits all
    of them alike. With ``batch`` > 1, a step feeds one token to each of ``batch`` sequences
    (consecutive stretches of pydoc), as ``rqlib eval --batch`` does. Returns ``{"context",
    "steps", "batch", "threads", "load", "methods": {label: {"ms": median ms per step,
    "ms_per_token": that / batch, "ratio": median / fp median, "times": [...]}}}``.
    """
    import contextlib
    import copy
    import os
    import statistics
    import time

    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from rqlib.base.corpora import load_corpus, tokenize_corpus
    from rqlib.hf import compress
    from rqlib.hf.models import load_model
    from rqlib.study.allocation import resolve

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name)
    ids = tokenize_corpus(load_corpus("pydoc"), tokenizer, batch * (context + steps))
    ids = ids.reshape(batch, context + steps)
    labels = ["fp"] + [f"preset:{name}{how}" for name in presets for how in ("", DECODED_COPY)]
    times: dict[str, list[float]] = {label: [] for label in labels}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        runners = {}
        fp_cache = DynamicCache(config=model.config)
        model(ids[:, :context], cache=fp_cache, use_cache=True)
        runners["fp"] = (model, fp_cache)
        for label in labels[1:]:
            copy_ = copy.deepcopy(model)
            config = resolve(label.removesuffix(DECODED_COPY), copy_, tokenizer, progress=False)
            cache = stack.enter_context(compress(copy_, config, tokenizer=tokenizer))
            cache.keep_decoded(label.endswith(DECODED_COPY))
            copy_(ids[:, :context], cache=cache, use_cache=True)
            runners[label] = (copy_, cache)
        for step in tqdm(range(steps), desc="decode steps", disable=not progress):
            token = ids[:, context + step : context + step + 1]
            order = labels[step % len(labels) :] + labels[: step % len(labels)]
            for label in order:
                runner, cache = runners[label]
                start = time.perf_counter()
                runner(token, cache=cache, use_cache=True)
                times[label].append(time.perf_counter() - start)
    fp_median = statistics.median(times["fp"])
    methods = {
        label: {
            "ms": 1000 * statistics.median(t),
            "ms_per_token": 1000 * statistics.median(t) / batch,
            "ratio": statistics.median(t) / fp_median,
            "times": [round(1000 * x, 3) for x in t],
        }
        for label, t in times.items()
    }
    return {
        "model": model_name,
        "context": context,
        "steps": steps,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "load": os.getloadavg()[0],
        "methods": methods,
    }


def print_decode_cpu(result: dict) -> None:
    """The table of :func:`decode_cpu`."""
    print(
        f"{result['model']}, decode after {result['context']} tokens, {result['steps']} steps, "
        f"batch {result['batch']}, {result['threads']} threads, load average {result['load']:.1f}"
    )
    print(f"{'method':<20} {'ms/step':>9} {'ms/token':>9} {'vs fp':>7}")
    for label, row in result["methods"].items():
        print(f"{label:<20} {row['ms']:>9.1f} {row['ms_per_token']:>9.1f} {row['ratio']:>6.2f}x")
