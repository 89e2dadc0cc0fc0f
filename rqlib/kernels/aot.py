"""Ahead-of-time compilation of the kernels' specializations for real GPUs.

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` runs
the whole pipeline (TTIR, TTGIR, LLVM IR, PTX, and a cubin from the ptxas bundled with
triton). Registers and spills come from ``cuobjdump --dump-resource-usage`` on the cubin (the
compiled metadata only gets ``n_regs`` when a kernel is loaded on a device); shared memory from
the metadata; the theoretical occupancy from both (:func:`occupancy`).

The kernels must be real ``JITFunction`` objects, so this module refuses to run under
``TRITON_INTERPRET=1``; the tests run it in a subprocess without it::

    python -m rqlib.kernels.aot            # one JSON line per (kernel, specialization, arch)

The fused-score, quantize and reduce kernels have every specialization the dispatcher can pick
listed, the trellis encoder the formats of :data:`TRELLIS_FORMATS`; the attention kernel
compiles one per layer format (an open set, of which :func:`attention_layouts` lists a covering
one), in the configuration of its format (``limits.attention_config``). Triton's JIT also
specializes integer arguments equal to 1 (e.g. q_len = 1 in decode) and pointer/integer
divisibility by 16 at launch; those variants are the same source with extra hints, and one of
them (all of group, q_len = 1) is compiled here as a representative.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from rqlib.kernels import limits as geo
from rqlib.kernels.numerics import CODEBOOK_DTYPE, PAIR_DTYPES

ARCHS = (80, 90, 100)
FLOAT_ARGS = {"qjl_scale", "scale", "softcap", "k_qjl_scale"}
TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
#: the element types of the kernels' pointers: the float dtypes and the integers of the
#: attention kernel's tables of centroid pairs
POINTER_DTYPES = {**TRITON_DTYPES, torch.int32: "i32", torch.int64: "i64"}
CODEBOOK = TRITON_DTYPES[CODEBOOK_DTYPE]


@dataclass(frozen=True)
class Specialization:
    """One compile: a kernel, its constexprs, pointer types and integer args fixed to 1."""

    kernel: str
    constexprs: dict = field(default_factory=dict)
    pointers: dict = field(default_factory=dict)  # argument -> element type; default fp32
    ones: tuple[str, ...] = ()
    num_warps: int = geo.NUM_WARPS
    num_stages: int | None = None  # None: Triton's default
    maxnreg: int | None = None  # registers per thread at most; None: ptxas chooses

    @property
    def label(self) -> str:
        """A name unique to the compile: constexprs, pointer types, ones and warps (two
        attention configurations differ in their warps alone)."""
        parts = [f"{k}={v}" for k, v in self.constexprs.items()]
        parts += [f"{k}:{v}" for k, v in self.pointers.items()]
        parts += [f"{k}=1" for k in self.ones]
        parts.append(f"num_warps={self.num_warps}")
        if self.num_stages is not None:
            parts.append(f"num_stages={self.num_stages}")
        return f"{self.kernel}[{', '.join(parts)}]"


KEY_POINTERS = {
    "codes_ptr": "u8",
    "norms_ptr": "fp16",
    "signs_ptr": "u8",
    "rnorms_ptr": "fp16",
}
SCORES_TILE = {"BLOCK_ROWS": geo.BLOCK_ROWS, "BLOCK_S": geo.SCORES_BLOCK_S, "CHUNK": geo.CHUNK}
#: the fused-score kernel's codes: Lloyd-Max, or a tail-biting trellis of 10 state bits
SCORES_CODES = (
    {"trellis_state_bits": 0, "trellis_tail_biting": 0},
    {"trellis_state_bits": 10, "trellis_tail_biting": 1},
)
#: the trellis encoder's formats: the bits the allocation gives keys (2..5) and values (1..4),
#: tail-biting, in a trellis of 10 state bits (``tcq``), one read from 0, and the most states
#: the kernel takes
TRELLIS_FORMATS = (
    *({"STATE_BITS": 10, "BITS": bits, "TAIL_BITING": 1} for bits in range(1, 6)),
    {"STATE_BITS": 10, "BITS": 3, "TAIL_BITING": 0},
    {"STATE_BITS": geo.MAX_TRELLIS_STATE_BITS, "BITS": 3, "TAIL_BITING": 1},
)
TRELLIS_POINTERS = {
    "x_ptr": "fp64",
    "table_ptr": "fp64",
    "levels_ptr": "fp64",
    "pointers_ptr": "u8",
    "symbols_ptr": "u8",
}
ATTENTION_TILE = {"BLOCK_ROWS": geo.BLOCK_ROWS}  # keys per tile: AttentionConfig.block_s
#: uint8 buffers of the attention kernel (codes, norm streams, signs, the mask)
ATTENTION_BYTES = (
    "k_codes_ptr k_norms_ptr k_signs_ptr k_rnorms_ptr v_codes_ptr v_norms_ptr bk_codes_ptr "
    "bk_norms_ptr bv_codes_ptr bv_norms_ptr mask_ptr"
).split()
#: exact vectors of the attention kernel, in the layer's dtype
ATTENTION_EXACT = "k_exact_ptr v_exact_ptr bk_exact_ptr bv_exact_ptr sink_k_ptr sink_v_ptr".split()
#: the attention kernel's centroids of the values, a codebook in
#: rqlib.kernels.numerics.CODEBOOK_DTYPE, and its tables of the keys' centroid pairs
#: (rqlib.kernels.numerics.kernel_table), of centroids in the configuration's
#: AttentionConfig.score_codebook_dtype
ATTENTION_CODEBOOKS = "v_centroids_ptr bv_centroids_ptr".split()
ATTENTION_SCORE_TABLES = "k_table_ptr bk_table_ptr".split()


def coded_layout(
    head_dim: int,
    key_bits: int = 3,
    value_bits: int = 2,
    norm_bits: int = 11,
    trellis_state_bits: int = 0,
    trellis_tail_biting: bool = False,
) -> dict:
    """The compile-time arguments of a layer whose keys and values are codes of the full head
    dimension (``key_bits`` and ``value_bits`` bits; Lloyd-Max, or a trellis of
    ``trellis_state_bits`` read tail-biting or not) with ``norm_bits``-bit norms, no QJL, a
    recent band of 8-bit Lloyd-Max codes and no softcap; the defaults are the presets'
    layout."""
    fmt = geo.StreamFormat
    trellis = dict(trellis_state_bits=trellis_state_bits, trellis_tail_biting=trellis_tail_biting)

    def codes(bits, **options):
        return fmt(dim=head_dim, bits=bits, norm_width=norm_bits, **options)

    layout = geo.attention_formats(
        head_dim, codes(key_bits, **trellis), codes(value_bits, **trellis), codes(8), codes(8)
    )
    return {**layout, "SOFTCAP": 0}


def attention_layouts() -> list[tuple[dict, str]]:
    """The layers compiled here, as ``(compile-time arguments, exact dtype)``: their
    :func:`rqlib.kernels.limits.attention_formats` and ``SOFTCAP`` (whether scores are
    softcapped).

    The formats are compile-time (:mod:`rqlib.kernels.limits`), so the set a model can launch
    is open-ended. This list holds the presets' layout (3-bit keys, 2-bit values and 8-bit band
    codes, 11-bit norms) at every supported head dimension and exact dtype; an exact layer in
    each dtype; every code width 1-8 for keys and for values, with each kind of band; QJL keys,
    with and without codes; exact keys with coded values and the reverse; the rotors' padded
    widths (at head_dim 256, values 258 wide: two value blocks); and softcapped scores at head
    dims 128 and 256; the presets' layout with trellis codes (``tcq:tb``, and ``tcq`` read
    from 0) at head dims 64 and 128. Each is compiled in the configuration of its format
    (:func:`rqlib.kernels.limits.attention_config`), the one a launch runs."""
    fmt, formats = geo.StreamFormat, geo.attention_formats
    exact = fmt(exact=True)

    def codes(d, bits, width=11, qjl=0):
        return fmt(dim=d, bits=bits, qjl=qjl, norm_width=width)

    def capped(layout, softcap=0):
        return {**layout, "SOFTCAP": softcap}

    layouts = []
    for dtype in ("fp16", "bf16", "fp32"):
        for d in geo.SUPPORTED_HEAD_DIMS:
            layouts.append((coded_layout(d), dtype))
        layouts.append((capped(formats(128, exact, exact, None, None)), dtype))
    bands = (None, exact, "codes keys", "codes")
    for bits in range(1, geo.MAX_MSE_BITS + 1):
        value_bits = geo.MAX_MSE_BITS + 1 - bits
        band = bands[bits % len(bands)]
        band_keys = codes(128, value_bits, 16) if isinstance(band, str) else band
        band_values = codes(128, bits, 16) if band == "codes" else None
        keys, values = codes(128, bits, 16), codes(128, value_bits, 16)
        layout = formats(128, keys, values, band_keys, band_values)
        layouts.append((capped(layout), "fp16"))
    layouts += [
        (capped(formats(128, codes(128, 2, 16, qjl=128), codes(128, 3), exact, None)), "fp16"),
        (capped(formats(128, fmt(qjl=256, norm_width=16), codes(128, 4), None, None)), "bf16"),
        (capped(formats(128, exact, codes(128, 4), exact, None), softcap=1), "fp16"),
        (capped(formats(128, codes(128, 4), exact, codes(128, 8), None)), "fp16"),
    ]
    for d in (64, 128):  # trellis codes: the register is read from 0 or as a circle
        for tail_biting in (False, True):
            layout = coded_layout(d, trellis_state_bits=10, trellis_tail_biting=tail_biting)
            layouts.append((layout, "fp16"))
    for d in (64, 128, 256):  # rotor blocks of three coordinates pad d to 3 * ceil(d / 3)
        rotated = codes(3 * ((d + 2) // 3), 3)
        layout = formats(d, rotated, rotated, rotated, rotated)
        layouts.append((capped(layout, softcap=int(d == 256)), "fp16"))
    return layouts


def attention_specialization(
    layout: dict, dtype: str, config: geo.AttentionConfig | None = None
) -> Specialization:
    """``attention_kernel`` compiled for the compile-time arguments ``layout`` (a layer's
    :func:`rqlib.kernels.limits.attention_formats` and ``SOFTCAP``) and exact vectors of
    ``dtype``, in ``config`` (default: the one ``launch.attention`` runs the format in,
    :func:`rqlib.kernels.limits.attention_config`), with the tiles and compile options that
    ``launch.attention`` picks for it."""
    pointers = {name: "u8" for name in ATTENTION_BYTES}
    pointers.update({name: dtype for name in ATTENTION_EXACT})
    pointers.update({name: CODEBOOK for name in ATTENTION_CODEBOOKS})
    block = geo.value_block(max(layout["head_dim"], layout["v_dim"], layout["bv_dim"]))
    width = block * geo.value_blocks(max(layout["head_dim"], layout["v_dim"], layout["bv_dim"]))
    config = geo.attention_config(width, bool(layout["k_qjl"])) if config is None else config
    scores = POINTER_DTYPES[PAIR_DTYPES[config.score_codebook_dtype]]
    pointers.update({name: scores for name in ATTENTION_SCORE_TABLES})
    constexprs = {
        **layout,
        "BLOCK_V": block,
        **ATTENTION_TILE,
        "CHUNK": geo.attention_chunk(block),
        **config.constexprs(),
    }
    return Specialization(
        "attention_kernel",
        constexprs,
        pointers,
        num_warps=config.num_warps,
        maxnreg=geo.ATTENTION_MAX_REGISTERS,
    )


def attention_specializations() -> list[Specialization]:
    """The specialization of each layout of :func:`attention_layouts`."""
    return [attention_specialization(layout, dtype) for layout, dtype in attention_layouts()]


def specializations() -> list[Specialization]:
    """Every constexpr / pointer-type combination the host code in launch.py can launch: the
    fused-score, quantize and reduce kernels, and the attention kernel for each layout of
    :func:`attention_layouts`."""
    specs = [
        *(
            Specialization("fused_scores_kernel", {**SCORES_TILE, **codes}, KEY_POINTERS)
            for codes in SCORES_CODES
        ),
        Specialization(
            "fused_scores_kernel",
            {**SCORES_TILE, **SCORES_CODES[0]},
            KEY_POINTERS,
            ones=("group", "q_len"),
        ),
        Specialization(
            "quantize_kernel",
            {"BLOCK_N": geo.BLOCK_N, "CHUNK": geo.CHUNK},
            {"codes_ptr": "u8", "signs_ptr": "u8"},
        ),
        Specialization(
            "reduce_kernel", {"BLOCK": geo.REDUCE_BLOCK}, num_warps=geo.REDUCE_NUM_WARPS
        ),
        *(
            Specialization(
                "trellis_encode_kernel", form, TRELLIS_POINTERS, num_warps=geo.TRELLIS_NUM_WARPS
            )
            for form in TRELLIS_FORMATS
        ),
    ]
    return specs + attention_specializations()


def kernel_objects() -> dict:
    """The JITFunctions by name (refuses interpreted kernels, which cannot be compiled)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("AOT compilation needs TRITON_INTERPRET unset (run in a subprocess)")
    from rqlib.kernels.triton_attention import attention_kernel, reduce_kernel
    from rqlib.kernels.triton_quantize import quantize_kernel
    from rqlib.kernels.triton_scores import fused_scores_kernel
    from rqlib.kernels.triton_trellis import trellis_encode_kernel

    return {
        "fused_scores_kernel": fused_scores_kernel,
        "quantize_kernel": quantize_kernel,
        "attention_kernel": attention_kernel,
        "reduce_kernel": reduce_kernel,
        "trellis_encode_kernel": trellis_encode_kernel,
    }


def signature(kernel, spec: Specialization) -> dict[str, str]:
    """ASTSource signature: pointer element types, i32 / fp32 scalars, constexpr markers."""
    result = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in spec.constexprs or name in spec.ones:
            result[name] = "constexpr"
        elif name.endswith("_ptr"):
            result[name] = "*" + spec.pointers.get(name, "fp32")
        elif name in FLOAT_ARGS:
            result[name] = "fp32"
        else:
            result[name] = "i32"
    return result


def cuobjdump() -> str:
    """Path of the cuobjdump bundled with triton."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, spill stores and static shared memory of a cubin, via cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run(
            [cuobjdump(), "--dump-resource-usage", handle.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = {}
    for key, pattern in (
        ("regs", r"REG:(\d+)"),
        ("stack", r"STACK:(\d+)"),
        ("smem", r"SHARED:(\d+)"),
    ):
        match = re.search(pattern, text)
        if match:
            usage[key] = int(match.group(1))
    return usage


#: Per-SM limits of the compute capabilities compiled for (CUDA occupancy rules): registers,
#: resident warps and blocks, shared memory per SM, and what the driver reserves per block.
SM_LIMITS = {
    80: {"regs": 65536, "warps": 64, "blocks": 32, "smem": 167936, "smem_per_block": 1024},
    90: {"regs": 65536, "warps": 64, "blocks": 32, "smem": 233472, "smem_per_block": 1024},
    100: {"regs": 65536, "warps": 64, "blocks": 32, "smem": 233472, "smem_per_block": 1024},
}
REG_GRANULE = 256  # registers are allocated to a warp in units of 256


def occupancy(regs: int, shared: int, num_warps: int, arch: int) -> dict[str, float]:
    """Theoretical occupancy of a kernel on one SM of sm_``arch``: resident ``blocks``, resident
    ``warps`` and their fraction of the SM's maximum (``occupancy``), and which resource bounds
    it (``limit``: ``"registers"``, ``"shared memory"`` or ``"warps"``)."""
    sm = SM_LIMITS[arch]
    per_warp = -(-regs * 32 // REG_GRANULE) * REG_GRANULE
    bounds = {
        "registers": (sm["regs"] // per_warp) // num_warps if per_warp else sm["blocks"],
        "shared memory": sm["smem"] // (shared + sm["smem_per_block"]),
        "warps": min(sm["warps"] // num_warps, sm["blocks"]),
    }
    limit = min(bounds, key=bounds.get)
    blocks = bounds[limit]
    return {
        "blocks": blocks,
        "warps": blocks * num_warps,
        "occupancy": blocks * num_warps / sm["warps"],
        "limit": limit,
    }


def compile_kernel(kernel, spec: Specialization, arch: int):
    """``triton.compile`` ``spec`` of ``kernel`` (a JITFunction) for sm_``arch``, no GPU needed.

    Returns Triton's CompiledKernel: ``.asm`` holds ``ttir``, ``ttgir``, ``llir``, ``ptx`` and
    ``cubin``, ``.metadata`` the launch metadata (``shared``: dynamic shared memory in bytes).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**spec.constexprs, **{name: 1 for name in spec.ones}}
    source = ASTSource(fn=kernel, signature=signature(kernel, spec), constexprs=constexprs)
    options = {"num_warps": spec.num_warps}
    if spec.num_stages is not None:
        options["num_stages"] = spec.num_stages
    if spec.maxnreg is not None:
        options["maxnreg"] = spec.maxnreg
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_one(kernel, spec: Specialization, arch: int) -> dict:
    """Compile ``spec`` for sm_``arch``; returns a JSON-able record (ok, regs, shared, ...)."""
    record = {"kernel": spec.label, "arch": f"sm_{arch}"}
    try:
        compiled = compile_kernel(kernel, spec, arch)
    except Exception as error:  # noqa: BLE001 - reported, the test fails on it
        record.update(ok=False, error=f"{type(error).__name__}: {error}"[:2000])
        return record
    metadata = compiled.metadata
    record.update(
        ok="cubin" in compiled.asm,
        shared=getattr(metadata, "shared", None),
        num_warps=metadata.num_warps,
        ptx_lines=compiled.asm.get("ptx", "").count("\n"),
    )
    if "cubin" in compiled.asm:
        record.update(resource_usage(compiled.asm["cubin"]))
    if "regs" in record and record["shared"] is not None and arch in SM_LIMITS:
        record.update(occupancy(record["regs"], record["shared"], record["num_warps"], arch))
    return record


def supported_archs() -> list[int]:
    """The archs of ``ARCHS`` whose target this triton's NVIDIA backend accepts."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return [a for a in ARCHS if CUDABackend.supports_target(GPUTarget("cuda", a, 32))]


def main(argv: list[str] | None = None) -> int:
    """Compile every specialization of :func:`specializations` for the archs given as arguments
    (default: every supported one); one JSON line each. Exit 1 if any produced no cubin (a
    spill is reported in the record's ``stack``, not a failure here: the tests judge it)."""
    archs = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or supported_archs()
    kernels = kernel_objects()
    failures = 0
    for spec in specializations():
        for arch in archs:
            record = compile_one(kernels[spec.kernel], spec, arch)
            failures += not record["ok"]
            print(json.dumps(record), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
