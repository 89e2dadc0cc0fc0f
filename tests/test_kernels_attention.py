"""The fused attention kernel (Triton, interpreted) against the torch implementation in float64.

Each case builds one :class:`CompressedLayer` from codecs (no model), feeds it a prompt, decode
steps and a short chunk, and after every update compares ``kernels.attention(...,
backend="triton")`` with ``reference.attention(..., dtype=float64)`` on the same stored state
read with the kernel's codebook (the codebook rounded to fp16, ``numerics.on_kernel_codebook``),
and the float32 torch path with the same reference on the float32 codebook. Decode steps use
many splits (``DEFAULT_SPLITS`` is set to 8, so short contexts also have empty splits) so that
the reduce merges several partial results. Every launch is also checked to be one of the
specializations ``tests/test_kernels_aot.py`` compiles for real GPUs and checks for spills.

Tolerance: both sides read the same stored codes and norms, and exact vectors converted to
float exactly; the fp32 paths accumulate at most D + m <= 1282 products per score and softmax
over <= 40 keys, so their rounding error is of order sqrt(D) * 2^-24 ~ 1e-6 relative to the
largest output. The kernel multiplies codebook values on fp16 tensor cores with the other
factor split in two fp16 parts (``triton_common.split_dot``), which loses at most
``2^-22 |x| + 2^-25`` of each factor, below that fp32 level (the interpreter multiplies fp16
inputs exactly, as a tensor core does). 1e-5 leaves a 10x margin, while any logic error (a
band pair read from the main stream, a missing sink, a wrong norm, a mask off by one, a weight
rounded to fp16 instead of split, a codebook read unrounded) moves outputs at the 1e-4 to 1e-2
level (the mutation checks in the report were caught by these cases).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import triton
import triton.language as tl

from rqlib import kernels
from rqlib.core.quantizers import make_quantizer
from rqlib.hf.cache import CompressedLayer
from rqlib.hf.codec import ChannelPart, VectorCodec
from rqlib.kernels import aot, launch, numerics, reference
from rqlib.kernels import limits as geo
from rqlib.kernels.state import CausalMask, DenseMask
from rqlib.kernels.store import NORM_TAIL, round_capacity
from rqlib.kernels.triton_attention import aligned_start, ring_tile, tile_range

pytestmark = pytest.mark.interpreter

TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def small_splits_and_poison(monkeypatch):
    """Every buffer the kernels write starts as NaN; decode steps use 8 splits."""
    monkeypatch.setattr(launch, "POISON_BUFFERS", True)
    monkeypatch.setattr(geo, "DEFAULT_SPLITS", 8)


#: a tail-biting trellis of 10 state bits, as the spec tokens tcq:tb make
TAIL_BITING = {"trellis_state_bits": 10, "trellis_tail_biting": True}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    keys: tuple | None = ("turboquant-mse", 3, {})  # (method, bits, options); None: exact layer
    values: tuple | None = ("turboquant-mse", 2, {})  # None: exact values
    band: int | str | None = None  # None, "exact", or the band codecs' bits
    n_sink: int = 0
    window: int = 0  # the recent band W
    d: int = 64
    group: int = 3
    kv_heads: int = 2
    batch: int = 2
    dtype: torch.dtype = torch.float32
    mean: bool = False
    key_scale: bool = False
    value_scale: bool = False
    norm_mantissa: int | None = None
    sliding: int | None = None
    softcap: float | None = None
    padding: bool = True
    dense: bool = False
    once: bool = False  # the band stored once: the main streams lag W tokens behind
    steps: tuple = ((0, 19), (19, 20), (20, 21), (21, 25))


CASES = [
    Case("presets' format", band=8, n_sink=1, window=6, mean=True, norm_mantissa=6),
    Case(
        "prod keys, exact values and band",
        keys=("turboquant-prod", 3, {"qjl_sketch": "orthogonal"}),
        values=None,
        band="exact",
        n_sink=2,
        window=4,
        d=128,
        group=4,
        kv_heads=1,
    ),
    Case(
        "exact layer, sliding window",
        keys=None,
        values=None,
        group=1,
        sliding=6,
        steps=((0, 9), (9, 10), (10, 11), (11, 12), (12, 13), (13, 17), (17, 18), (18, 19)),
    ),  # fmt: skip
    Case(
        "rotor, exact band with coded values, softcap",
        keys=("rotorquant-mse", 3, {}),
        values=("rotorquant-mse", 3, {}),
        band="exact",
        n_sink=1,
        window=5,
        d=96,
        group=8,
        kv_heads=1,
        batch=1,
        softcap=5.0,
        padding=False,
    ),
    Case(
        "hadamard, channel scaling, fp16 model",
        keys=("turboquant-mse", 4, {"rotation": "hadamard"}),
        values=("turboquant-mse", 3, {"rotation": "hadamard"}),
        band=6,
        n_sink=1,
        window=3,
        d=256,
        group=1,
        kv_heads=1,
        dtype=torch.float16,
        mean=True,
        key_scale=True,
        value_scale=True,
    ),
    Case("group of 20", band=8, n_sink=1, window=4, group=20, kv_heads=1, batch=1),
    Case(
        "rotor at head_dim 256: 258 value columns, two value blocks",
        keys=("rotorquant-mse", 3, {}),
        values=("rotorquant-mse", 2, {}),
        band=4,
        n_sink=1,
        window=3,
        d=256,
        group=2,
        kv_heads=1,
        batch=1,
        mean=True,
    ),
    Case("sliding layer with band and sink", band=8, n_sink=1, window=3, sliding=5, mean=True),
    Case(
        "a band longer than a key tile, in a ring that wraps",
        band=8,
        n_sink=1,
        window=20,
        steps=((0, 30), (30, 31), (31, 32), (32, 36), (36, 37)),
    ),
    Case("dense mask", band="exact", n_sink=1, window=4, dense=True),
    Case(
        "presets' format, band stored once, a prompt shorter than the band",
        band=8,
        n_sink=1,
        window=6,
        mean=True,
        once=True,
        steps=((0, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 19), (19, 20), (20, 25)),
    ),
    Case(
        "exact values, keys with their exact band stored once",
        values=None,
        band="exact",
        n_sink=2,
        window=4,
        once=True,
        steps=((0, 9), (9, 10), (10, 11), (11, 19), (19, 20)),
    ),
    Case(
        "presets' format with tail-biting trellis codes (the band's too), stored once",
        keys=("turboquant-mse", 3, TAIL_BITING),
        values=("turboquant-mse", 2, TAIL_BITING),
        band=8,
        n_sink=1,
        window=6,
        mean=True,
        norm_mantissa=6,
        once=True,
        steps=((0, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 19), (19, 20), (20, 25)),
    ),
    Case(
        "prod keys and values by a trellis read from 0, exact band",
        keys=("turboquant-prod", 4, {"qjl_sketch": "orthogonal", "trellis_state_bits": 9}),
        values=("turboquant-mse", 1, {"trellis_state_bits": 9}),
        band="exact",
        n_sink=1,
        window=4,
        d=128,
        group=4,
        kv_heads=1,
    ),
    Case(
        "a band stored once, longer than a key tile, in a sliding window",
        band=8,
        n_sink=1,
        window=20,
        sliding=26,
        once=True,
        steps=((0, 30), (30, 31), (31, 32), (32, 36), (36, 37)),
    ),
]
#: keys over many tiles and several splits, in a sliding window whose first key is on no
#: tile's boundary
LONG_CASE = Case(
    "presets' format in a sliding window over several wide tiles",
    band=8,
    n_sink=1,
    window=6,
    mean=True,
    norm_mantissa=6,
    sliding=90,
    kv_heads=1,
    steps=((0, 150), (150, 151), (151, 152), (152, 155)),
)


def codec(spec, d, rng, mean=None, scale=None, nm=None) -> VectorCodec:
    method, bits, options = spec
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    quantizer = make_quantizer(method, d, bits, draw=seed, norm_mantissa_bits=nm, **options)
    return VectorCodec([ChannelPart(quantizer, None)], d, mean=mean, scale=scale)


def build_layer(case: Case, rng) -> CompressedLayer:
    if case.keys is None:
        return CompressedLayer(0, None, None, sliding_window=case.sliding)
    d, kv = case.d, case.kv_heads
    mean = torch.randn(kv, d, generator=rng) if case.mean else None

    def positive(flag):
        return torch.exp(0.5 * torch.randn(kv, d, generator=rng)) if flag else None

    nm = case.norm_mantissa
    key_codec = codec(case.keys, d, rng, mean, positive(case.key_scale), nm)
    value_codec = None
    if case.values is not None:
        value_codec = codec(case.values, d, rng, None, positive(case.value_scale), nm)
    bands = (None, None)
    if isinstance(case.band, int):
        family = case.keys[0].rsplit("-", 1)[0] + "-mse"
        band_spec = (family, case.band, case.keys[2])
        bands = (
            codec(band_spec, d, rng, mean, None, nm),
            codec(band_spec, d, rng, None, None, nm) if value_codec is not None else None,
        )
    window = case.window if case.band is not None else 0
    return CompressedLayer(
        0,
        key_codec,
        value_codec,
        case.n_sink,
        window,
        bands,
        sliding_window=case.sliding,
        band_once=case.once,
    )


def mask_for(case: Case, padding, first: int, last: int, rng):
    kv_offset = 0 if case.sliding is None else max(0, first - case.sliding + 1)
    causal = CausalMask(
        case.batch, first, last - first, kv_offset, last - kv_offset, case.sliding, padding
    )
    if not case.dense:
        return causal
    dense = causal.dense() | (torch.rand(case.batch, 1, last - first, last, generator=rng) < 0.3)
    return DenseMask(dense, 0)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    error = float((out.double() - ref).abs().max() / ref.abs().max())
    print(f"relative error {error:.3e}")
    return error


class RecordedKernel:
    """Stands in for ``launch.attention_kernel``: runs it and records each launch's run-time
    arguments by name, and its constexprs and compile options."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []
        parameters = inspect.signature(kernel.fn).parameters
        self.names = list(parameters)
        self.constexprs = {
            name for name, p in parameters.items() if "constexpr" in str(p.annotation)
        }

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            named = {**dict(zip(self.names, args)), **kwargs}
            runtime = {
                k: v for k, v in named.items() if k in self.names and k not in self.constexprs
            }
            options = {k: v for k, v in named.items() if k not in runtime}
            self.launches.append((runtime, options))
            return self.kernel[grid](*args, **kwargs)

        return launch_


@pytest.fixture
def recorded(monkeypatch) -> RecordedKernel:
    recorder = RecordedKernel(launch.attention_kernel)
    monkeypatch.setattr(launch, "attention_kernel", recorder)
    return recorder


def assert_compiled_ahead_of_time(recorder: RecordedKernel, listed: bool) -> None:
    """Every launch is the specialization ``aot.attention_specialization`` builds for its
    formats, in the one configuration of its format: the same compile-time arguments,
    exact-vector dtype, warps and register cap, so the AOT test (which checks for spills)
    compiles what a GPU would launch; its splits start and end on its key tiles.
    With ``listed``, the launch is also one of the specializations that test compiles."""
    specs = {spec.label for spec in aot.specializations()}
    assert recorder.launches
    for arguments, keywords in recorder.launches:
        options = tuple(keywords.get(name) for name in ("num_warps", "num_stages", "maxnreg"))
        constexprs = {
            k: v for k, v in keywords.items() if k not in ("num_warps", "num_stages", "maxnreg")
        }
        dtype = aot.TRITON_DTYPES[arguments["sink_k_ptr"].dtype]
        tiles = {*aot.ATTENTION_TILE, "BLOCK_V", "CHUNK", "SCORE_TENSOR_CORES", "BLOCK_S"}
        layout = {k: v for k, v in constexprs.items() if k not in tiles}
        expected = aot.attention_specialization(layout, dtype)
        assert constexprs == expected.constexprs
        config = next(
            c
            for c in (geo.ATTENTION_CONFIG, geo.CUDA_CORE_CONFIG)
            if c.constexprs().items() <= constexprs.items() and c.num_warps == keywords["num_warps"]
        )
        # splits are whole key tiles of the configuration (a split that starts inside a tile
        # reads keys that it masks, right but wasted)
        assert arguments["split_lo"] % config.block_s == 0
        assert arguments["partition"] % config.block_s == 0
        for name in (*aot.ATTENTION_CODEBOOKS, *aot.ATTENTION_SCORE_TABLES):
            assert aot.POINTER_DTYPES[arguments[name].dtype] == expected.pointers[name], name
        assert options == (expected.num_warps, expected.num_stages, expected.maxnreg)
        if listed:
            assert expected.label in specs, expected.label


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_attention_matches_the_torch_implementation(case, rng, recorded):
    layer = build_layer(case, rng)
    layer.active = True
    total = case.steps[-1][1]
    keys = torch.randn(case.batch, case.kv_heads, total, case.d, generator=rng) * 2
    values = torch.randn(case.batch, case.kv_heads, total, case.d, generator=rng)
    keys, values = keys.to(case.dtype), values.to(case.dtype)
    padding = None
    if case.padding:
        padding = torch.ones(case.batch, total, dtype=torch.bool)
        padding[-1, :3] = False  # the last row is left-padded by 3 slots
    scale = case.d**-0.5
    for first, last in case.steps:
        layer.update(keys[:, :, first:last], values[:, :, first:last])
        q_heads = case.kv_heads * case.group
        q = torch.randn(case.batch, q_heads, last - first, case.d, generator=rng).to(case.dtype)
        mask = mask_for(case, None if padding is None else padding[:, :last], first, last, rng)
        state = layer.state()
        options = dict(scale=scale, softcap=case.softcap)
        expected = reference.attention(state, q.double(), mask, dtype=torch.float64, **options)
        on_kernel_codebook = numerics.on_kernel_codebook(state)
        kernel_expected = reference.attention(
            on_kernel_codebook, q.double(), mask, dtype=torch.float64, **options
        )
        got = kernels.attention(state, q, mask, backend="triton", **options)
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert relative_error(got, kernel_expected) <= TOLERANCE
        if case.keys is not None:  # the rounded codebook is what the kernel reads
            assert relative_error(got, expected) > relative_error(got, kernel_expected)
        torch_path = kernels.attention(state, q, mask, backend="torch", **options)
        assert relative_error(torch_path, expected) <= TOLERANCE
        if padding is not None and first < 3 and not case.dense:  # pad queries see no key
            assert torch.equal(got[-1, :, : 3 - first], torch.zeros_like(got[-1, :, : 3 - first]))
    assert_compiled_ahead_of_time(recorded, listed=case.name == "presets' format")
    if case.sliding is not None:  # tokens beyond the window are evicted, not only masked
        ring = layer.streams["keys"].rings[0]
        from rqlib.hf.cache import SHORT_QUERY

        assert ring.capacity <= 2 * round_capacity(case.sliding - 1 + SHORT_QUERY - 1)
        assert layer.stored_tokens()["keys"] == case.sliding - case.once * case.window


def test_a_state_the_kernel_cannot_serve_is_refused(rng):
    d = 64
    q1 = make_quantizer("turboquant-mse", 8, 3, draw=1)
    q2 = make_quantizer("turboquant-mse", d - 8, 3, draw=2)
    channels = torch.arange(8).expand(1, 8)
    rest = torch.arange(8, d).expand(1, d - 8)
    split = VectorCodec([ChannelPart(q1, channels), ChannelPart(q2, rest)], d)
    with pytest.raises(ValueError, match="outlier channel split"):
        kernels.check_layer(split, None)
    layer = CompressedLayer(0, split, None)
    layer.active = True
    layer.update(torch.randn(1, 1, 5, d, generator=rng), torch.randn(1, 1, 5, d, generator=rng))
    mask = CausalMask(1, 0, 5, 0, 5)
    q = torch.randn(1, 2, 5, d, generator=rng)
    with pytest.raises(ValueError, match="outlier channel split"):
        kernels.attention(layer.state(), q, mask, scale=0.1, backend="triton")
    # the torch implementation serves it
    assert torch.isfinite(kernels.attention(layer.state(), q, mask, scale=0.1)).all()
    # band or sink pairs without their own values read coded main values: torch only
    keys, values = (codec(("turboquant-mse", bits, {}), d, rng) for bits in (3, 2))
    layer = CompressedLayer(0, keys, values, n_sink=1, recent_window=4)
    layer.active = True
    layer.update(torch.randn(1, 1, 9, d, generator=rng), torch.randn(1, 1, 9, d, generator=rng))
    mask = CausalMask(1, 0, 9, 0, 9)
    q = torch.randn(1, 2, 9, d, generator=rng)
    for missing, message in (
        ("band_values", "without band values"),
        ("sink_values", "without sink"),
    ):
        state = dataclasses.replace(layer.state(), **{missing: None})
        with pytest.raises(ValueError, match=message):
            kernels.attention(state, q, mask, scale=0.1, backend="triton")
        assert torch.isfinite(kernels.attention(state, q, mask, scale=0.1)).all()
    with pytest.raises(ValueError, match="head_dim 32 has no kernel"):
        kernels.check_layer(codec(("turboquant-mse", 3, {}), 32, rng), None)


@triton.jit
def walk_ring_kernel(out_ptr, lo, hi, capacity, BLOCK_S: tl.constexpr):
    """Write ``(key, slot, read)`` for every key of every tile of the attention kernel's loop
    over keys ``lo .. hi - 1`` of a ring of ``capacity`` slots, in the order it walks them: the
    keys of each tile (``tile_range``) against the slots they are read from (``ring_tile``)."""
    tile_lo, slot_lo = aligned_start(lo, hi, capacity, BLOCK_S)
    row = 0
    for tile in range(tile_lo, hi, BLOCK_S):
        slots, slot_lo = ring_tile(tile, slot_lo, capacity, BLOCK_S)
        keys, in_range = tile_range(tile, lo, hi, BLOCK_S)
        at = (row + tl.arange(0, BLOCK_S))[None, :] * 3
        tl.store(out_ptr + at, keys)
        tl.store(out_ptr + (row + tl.arange(0, BLOCK_S)) * 3 + 1, slots)
        tl.store(out_ptr + at + 2, in_range.to(tl.int32))
        row += BLOCK_S


def ring_walk_errors(
    lo: int, hi: int, capacity: int, block: int = geo.ATTENTION_BLOCK_S
) -> list[str]:
    """What is wrong with the kernel's walk over keys ``lo .. hi - 1`` of a ring in tiles of
    ``block`` keys: a key read twice, missed or out of order, a slot outside the ring or not
    ``key % capacity``, a tile that does not start on a multiple of the tile size, a tile with
    nothing to read."""
    rows = (max(hi - lo, 0) // block + 2) * block
    out = torch.full((rows, 3), -1, dtype=torch.int32)
    walk_ring_kernel[(1,)](out, lo, hi, capacity, BLOCK_S=block)
    walked = out[out[:, 0] >= 0]
    keys, slots, read = walked[:, 0], walked[:, 1], walked[:, 2].bool()
    errors = []
    if keys[read].tolist() != list(range(lo, hi)):
        errors.append(f"read keys {keys[read].tolist()}, not {lo}..{hi - 1}")
    if ((slots < 0) | (slots >= capacity)).any():
        errors.append(f"slots {sorted(set(slots[slots >= capacity].tolist()))} outside the ring")
    if (slots != keys % capacity).any():
        errors.append("a slot that is not its key modulo the capacity")
    if (keys[::block] % block).any():
        errors.append(f"tiles starting at {keys[::block].tolist()}")
    if not read.reshape(-1, block).any(dim=1).all():  # (a stream may have no buffers to read)
        errors.append("a tile with no key to read")
    return errors


def test_the_kernel_walks_each_ring_key_once_in_its_slot_and_never_past_the_ring(rng):
    """The loops of the attention kernel read whole tiles of a ring without masks, so every key
    of every tile must lie inside the ring, in slot ``key % capacity``, and the keys it reads
    must be exactly the loop's range. Checked on random ranges (up to a full ring, crossing its
    end, empty), and rejecting a ring whose capacity is not a multiple of the tile."""
    block = geo.ATTENTION_BLOCK_S
    cases = [(5, 5, block), (9, 3, block), (0, block, block)]
    for _ in range(15):
        capacity = block * int(torch.randint(1, 5, (1,), generator=rng))
        lo = int(torch.randint(0, 10 * capacity, (1,), generator=rng))
        length = int(torch.randint(0, capacity + 1, (1,), generator=rng))
        cases.append((lo, lo + length, capacity))
    for lo, hi, capacity in cases:
        assert ring_walk_errors(lo, hi, capacity, block) == [], (lo, hi, capacity)
    # the check can fail: with 24 slots (not a multiple of 16) a tile crosses the ring's end
    assert any("outside the ring" in e for e in ring_walk_errors(20, 40, 24))


def test_a_ring_the_kernel_would_read_past_is_refused(rng):
    """A ring whose capacity is not a multiple of the key tile, or whose norm stream
    lacks its spare bytes, is refused at launch with the stream named, not read past its
    end."""
    d = 64
    keys, values = (codec(("turboquant-mse", bits, {}), d, rng) for bits in (3, 2))
    mask, q = CausalMask(1, 0, 5, 0, 5), torch.randn(1, 2, 5, d, generator=rng)

    def layer():
        layer = CompressedLayer(0, keys, values)
        layer.active = True
        layer.update(torch.randn(1, 1, 5, d, generator=rng), torch.randn(1, 1, 5, d, generator=rng))
        return layer

    state = layer().state()
    for slots in (24, 40):
        for stream in (state.keys, state.values):
            stream.rings[0]._reallocate(slots, keep_from=0)
        with pytest.raises(ValueError, match=f"the keys ring has {slots} slots.*multiple of 16"):
            kernels.attention(state, q, mask, scale=0.1, backend="triton")
    state = layer().state()
    ring = state.values.rings[0]
    ring.buffers["norms"] = ring.buffers["norms"][..., :-NORM_TAIL]
    with pytest.raises(
        ValueError, match=r"the values ring's norms stream has \d+ bytes; the kernel reads"
    ):
        kernels.attention(state, q, mask, scale=0.1, backend="triton")


def decode_step_after_200_keys(rng, coded_values: bool):
    """``(state, q, mask, expected)``: a decode step of a GQA pair of heads at head_dim 64 over
    200 keys of 3-bit codes, with exact values, or with values of the same codec, a sink and an
    exact band of 5; ``expected`` is the float64 reference on the kernel's codebook."""
    d, total = 64, 200
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    quantizer = make_quantizer("turboquant-mse", d, 3, draw=seed)
    codec = VectorCodec([ChannelPart(quantizer, None)], d)
    if coded_values:
        layer = CompressedLayer(0, codec, codec, 1, 5)
    else:
        layer = CompressedLayer(0, codec, None)
    layer.active = True
    keys, values = torch.randn(2, 1, 1, total, d, generator=rng)
    layer.update(keys, values)
    state = dataclasses.replace(layer.state(), start=total - 1)
    mask = CausalMask(1, total - 1, 1, 0, total)
    q = torch.randn(1, 2, 1, d, generator=rng)
    kernel_state = numerics.on_kernel_codebook(state)
    expected = reference.attention(kernel_state, q.double(), mask, scale=0.1, dtype=torch.float64)
    return state, q, mask, expected


def test_partition_sets_the_splits_of_a_decode_step(rng, monkeypatch):
    """A decode step cut into 16-key splits by the argument (the default left at one split)
    equals the reference; a partition that is not a positive multiple of the key tile is
    refused."""
    monkeypatch.setattr(geo, "DEFAULT_SPLITS", 1)
    state, q, mask, expected = decode_step_after_200_keys(rng, coded_values=False)
    calls = []
    original = launch.attention
    monkeypatch.setattr(
        launch, "attention", lambda *a: calls.append(a[5]) or original(*a), raising=True
    )
    got = kernels.attention(state, q, mask, scale=0.1, backend="triton", partition=16)
    assert calls == [16]
    assert relative_error(got, expected) <= TOLERANCE
    for bad in (0, -16, 10, 16.0, True):
        with pytest.raises(ValueError, match="partition must be a positive multiple of 16"):
            kernels.attention(state, q, mask, scale=0.1, backend="triton", partition=bad)


def test_a_decode_step_has_the_same_splits_and_buffers_at_every_context(rng, recorded, monkeypatch):
    """A decode step's splits are a fixed number (``limits.decode_splits``: 2 waves of 132 SMs
    for 8 programs would be 33), each a whole number of key tiles covering the context, and
    their partial results are one buffer made once: the launches at two context lengths pass
    the same ``n_splits`` and the same ``part_acc`` tensor, and both equal the reference."""
    assert geo.decode_splits(8, 132) == 33 and geo.decode_splits(1, 132) == geo.MAX_SPLITS
    assert 8 * geo.decode_splits(8, 132) >= 2 * 132  # at least two waves on an H100/H200
    monkeypatch.setattr(geo, "DEFAULT_SPLITS", 5)
    seen = []
    for _ in range(2):
        state, q, mask, expected = decode_step_after_200_keys(rng, coded_values=True)
        got = kernels.attention(state, q, mask, scale=0.1, backend="triton")
        assert relative_error(got, expected) <= TOLERANCE
        arguments, _ = recorded.launches[-1]
        assert arguments["n_splits"] == 5 and arguments["partition"] % geo.ATTENTION_BLOCK_S == 0
        assert arguments["n_splits"] * arguments["partition"] >= state.end - arguments["split_lo"]
        seen.append(arguments["part_acc_ptr"])
    assert seen[0] is seen[1]
    assert_compiled_ahead_of_time(recorded, listed=False)


def test_a_layer_runs_in_the_configuration_of_its_format(rng, recorded):
    """No configuration is tuned or timed: the presets' format runs on tensor cores in four
    warps, and an accumulator wider than 128 columns (a rotor's padded values at head_dim 128:
    two blocks of 128) on the CUDA cores in eight."""
    assert geo.attention_config(128) == geo.ATTENTION_CONFIG
    assert geo.attention_config(256) == geo.CUDA_CORE_CONFIG
    state, q, mask, expected = decode_step_after_200_keys(rng, coded_values=True)
    got = kernels.attention(state, q, mask, scale=0.1, backend="triton")
    assert relative_error(got, expected) <= TOLERANCE
    for _, keywords in recorded.launches:
        config = geo.attention_config(keywords["BLOCK_V"])
        assert keywords["num_warps"] == config.num_warps
        assert config.constexprs().items() <= keywords.items()
