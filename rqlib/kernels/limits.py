"""What the kernels accept, checked in one place, and the launch constants they share.

Every public kernel entry point calls one of the ``check_*`` functions before it launches
anything, so an input with no kernel raises a ``ValueError`` naming what is supported instead
of producing uninitialized output. :func:`check_codecs` runs the same checks on a layer's codecs
when a cache is built for a CUDA model, so that a config the fused attention cannot serve is
refused at ``compress()`` time. The same constants feed the ahead-of-time compile list in
:mod:`rqlib.kernels.aot`.

Design: the attention kernel compiles one specialization per storage format of a layer
(:func:`attention_formats`: head dimension, which streams are exact or codes, code widths,
rotated dimensions, norm widths, QJL or not), so that a decode step issues no instruction for a
format it does not have (chapter 3 counts what a decode step issues). A model compiles a
handful, one per distinct per-layer format (and softcap or not: ``launch.attention``), in the
one configuration of that format (:func:`attention_config`), whatever the context's length.
Positions, lengths, capacities, the mask, the window and the softcap's value stay run-time
arguments. The fused-score and quantize kernels take every size at run time.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rqlib.kernels.numerics import CODEBOOK_DTYPE

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
MAX_MSE_BITS = 8  # codes of up to 8 bits straddle at most two bytes: the unpack reads two
MAX_QJL_DIM = 1024
MAX_NORM_BITS = 16  # norm fields straddle at most three bytes: the kernel reads three
SUPPORTED_NORM_DTYPES = (torch.float16,)
SUPPORTED_QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_EXACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tile sizes; tl.dot needs every block dimension >= 16 on a GPU.
CHUNK = 32  # coordinates per inner step (codes, signs, exact keys) of scores and quantize
ATTENTION_CHUNK = 16  # the same in the attention kernel at 256 accumulator columns
#: coordinates per step of the attention kernel's scores, by accumulator width (BLOCK_V): a
#: whole head of up to 128 coordinates in one step, so that the scores need no inner loop and
#: the query tile is read once a tile (fewer instructions per key: count them with
#: rqlib.book.sass); ATTENTION_CHUNK at 256 columns, where wider steps spill registers
ATTENTION_CHUNKS = {64: 64, 128: 128, 256: ATTENTION_CHUNK}
SCORES_BLOCK_S = 32  # keys per fused_scores tile
ATTENTION_BLOCK_S = 16  # keys per attention tile (also the K dimension of P.V)
#: Ring capacities are multiples of this many slots (rqlib.kernels.store): the attention
#: kernel's key tile (``AttentionConfig.block_s``) divides it, so no tile crosses the end of a
#: ring.
RING_GRANULE = 64
BLOCK_ROWS = 16  # query rows per tile: (position, head of the group) pairs, the M of tl.dot
BLOCK_N = 16  # vectors per quantize program
NUM_WARPS = 8  # scores and quantize kernels
ATTENTION_MAX_REGISTERS = 255  # a thread of the attention kernel may take up to this many
# registers (one block an SM at four warps); at 128 (two blocks an SM) the presets' layout
# spills at head_dim 128 (tests/test_kernels_aot.py measures it)
REDUCE_NUM_WARPS = 4
REDUCE_BLOCK = 128  # accumulator columns per reduce program
SPLIT_WAVES = 2  # a decode step launches enough splits for this many programs per SM
MAX_SPLITS = 64  # the most splits a decode step cuts its keys into (its partials' size)
DEFAULT_SPLITS = 4  # splits of a decode step where the SM count is unknown (the interpreter)
VALUE_BLOCKS = (64, 128, 256)  # accumulator widths per program (next power of two >= 64)
MAX_VALUE_WIDTH = 512  # wider value vectors have no kernel
#: The trellis encoder kernel (triton_trellis): a program holds the costs of all 2^L states
#: (at most 2^MAX_TRELLIS_STATE_BITS), in Triton's default warps (untimed); the back pointers
#: of one launch take at most TRELLIS_SCRATCH_BYTES (a longer input is coded in several).
MAX_TRELLIS_STATE_BITS = 12
TRELLIS_NUM_WARPS = 4
TRELLIS_SCRATCH_BYTES = 1 << 28


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How an attention program runs: its warps, whether the scores of codes run on fp16
    tensor cores (``triton_common.split_dot``) or on the CUDA cores, and how many keys a tile
    holds (``block_s``; a decode step's splits start and end on whole tiles). Both compute the
    same sums to float32 accuracy; they differ in instructions and registers."""

    num_warps: int
    score_tensor_cores: bool
    block_s: int = ATTENTION_BLOCK_S

    @property
    def score_codebook_dtype(self) -> torch.dtype:
        """The dtype the scores read the keys' codebook in: fp16 for the tensor cores, float32
        on the CUDA cores (the same values: ``numerics.kernel_centroids``)."""
        return CODEBOOK_DTYPE if self.score_tensor_cores else torch.float32

    def constexprs(self) -> dict[str, int]:
        """The kernel's compile-time arguments for this configuration."""
        return {"SCORE_TENSOR_CORES": int(self.score_tensor_cores), "BLOCK_S": self.block_s}


#: The configuration every launch of the attention kernel runs in, decode step or prompt: four
#: warps, the products with codebook values on fp16 tensor cores. No configuration is chosen
#: by a model of the GPU or tuned at run time: a launch compiles one specialization per layer
#: format and step kind, and nothing else (a GPU timing, ``python -m rqlib bench gpu``, is what
#: may change this).
ATTENTION_CONFIG = AttentionConfig(4, True)
#: The one alternative: the scores on the CUDA cores in eight warps, for the formats whose
#: tensor-core specialization spills far more (QJL keys, accumulators wider than 128 columns;
#: tests/test_kernels_aot.py compiles them; :func:`attention_config` picks by format, never by
#: timing).
CUDA_CORE_CONFIG = AttentionConfig(8, False)
#: Accumulators wider than this many columns take :data:`CUDA_CORE_CONFIG`.
TENSOR_CORE_MAX_WIDTH = 128


def attention_config(acc_width: int, qjl: bool = False) -> AttentionConfig:
    """The configuration of a layer whose accumulator is ``acc_width`` columns wide (over its
    value blocks) and whose keys carry QJL signs or not: :data:`ATTENTION_CONFIG`, or
    :data:`CUDA_CORE_CONFIG` for QJL keys or past :data:`TENSOR_CORE_MAX_WIDTH`. A function of
    the format alone, so a model compiles at most one specialization per layer format and step
    kind."""
    if qjl or acc_width > TENSOR_CORE_MAX_WIDTH:
        return CUDA_CORE_CONFIG
    return ATTENTION_CONFIG


def partial_bytes(rows: int, acc_width: int) -> int:
    """Bytes of one split's partial results for ``rows`` query rows, written by the split and
    read back by the reduce: per row, ``m`` and ``l`` of each of the three streams (main, band,
    sink) and the main stream's accumulator of ``acc_width`` floats (the band's and the sink's
    are written only by the splits that hold their keys)."""
    return 2 * rows * (3 * 2 + acc_width) * 4


def even_partition(span: int, splits: int, block: int = ATTENTION_BLOCK_S) -> tuple[int, int]:
    """``(splits, partition)``: ``span`` keys cut into at most ``splits`` near-equal splits of
    whole key tiles of ``block`` keys (``partition`` a positive multiple of ``block``,
    ``splits * partition >= span``)."""
    partition = max(block, math.ceil(span / max(1, splits) / block) * block)
    return math.ceil(span / partition), partition


def decode_splits(programs: int, sm_count: int | None) -> int:
    """How many splits a decode step cuts its keys into: with one query token there are only
    ``programs`` = batch x KV heads groups of rows, far fewer than a GPU's SMs, so the keys
    provide the parallelism. Given the ``sm_count``, enough splits that the programs fill
    ``SPLIT_WAVES`` waves of the SMs, at most ``MAX_SPLITS``; without one (the interpreter),
    ``DEFAULT_SPLITS``. The count does not depend on the context: the partial results a step
    writes have one size for the whole generation, allocated once (``launch.DecodePlan``), and
    each split covers ``ceil(span / splits)`` keys rounded up to whole tiles
    (:func:`split_partition`)."""
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    if sm_count is None:
        return DEFAULT_SPLITS
    if sm_count < 1:
        raise ValueError(f"sm_count must be >= 1, got {sm_count}")
    return max(1, min(MAX_SPLITS, math.ceil(SPLIT_WAVES * sm_count / programs)))


def split_partition(span: int, splits: int, block: int = ATTENTION_BLOCK_S) -> int:
    """Keys per split when ``span`` keys are cut into ``splits`` splits of whole tiles of
    ``block`` keys (the last splits may be short or empty)."""
    if span < 0 or splits < 1:
        raise ValueError(f"need span >= 0 and splits >= 1, got {span} and {splits}")
    return max(block, math.ceil(span / splits / block) * block)


def attention_chunk(block_v: int) -> int:
    """The attention kernel's ``CHUNK`` for an accumulator of ``block_v`` columns."""
    return ATTENTION_CHUNKS.get(block_v, ATTENTION_CHUNK)


def value_block(width: int) -> int:
    """The accumulator width of one program for ``width`` value coordinates (a power of two
    >= 64, at most ``VALUE_BLOCKS[-1]``: wider accumulators are cut, see
    :func:`value_blocks`)."""
    if not 1 <= width <= MAX_VALUE_WIDTH:
        raise ValueError(f"value width {width} has no kernel; supported: 1..{MAX_VALUE_WIDTH}")
    block = next((block for block in VALUE_BLOCKS if width <= block), VALUE_BLOCKS[-1])
    if block == 256 and width < 256:  # a 256-column block that masks columns spills on sm_90;
        return 128  # two blocks of 128 (a rotor's 129 at head_dim 128) do not
    return block


def value_blocks(width: int) -> int:
    """How many programs of :func:`value_block` columns cover ``width`` value coordinates."""
    return math.ceil(width / value_block(width))


def accumulator_width(width: int) -> int:
    """Columns of a row's accumulator (over all its value blocks) for ``width`` coordinates."""
    return value_block(width) * value_blocks(width)


def rotated_dims(head_dim: int) -> set[int]:
    """The rotated dimensions D a supported head_dim can have (rotor blocks pad to 3*ceil(d/3))."""
    return {head_dim, 3 * ((head_dim + 2) // 3)}


def check_quantizer(quantizer, name: str) -> None:
    """Raise ``ValueError`` unless the kernels support ``quantizer``'s geometry."""
    if quantizer.d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{name}: head_dim {quantizer.d} has no kernel; supported head dims are "
            f"{SUPPORTED_HEAD_DIMS}"
        )
    if not 0 <= quantizer.mse_bits <= MAX_MSE_BITS:
        raise ValueError(
            f"{name}: {quantizer.mse_bits}-bit codes have no kernel; supported code widths are "
            f"0..{MAX_MSE_BITS} bits (0 only with QJL signs)"
        )
    if quantizer.mse_bits == 0 and not quantizer.has_qjl:
        raise ValueError(f"{name}: a quantizer with neither codes nor QJL signs stores nothing")
    if quantizer.has_qjl and not 1 <= quantizer.qjl_dim <= MAX_QJL_DIM:
        raise ValueError(
            f"{name}: qjl_dim {quantizer.qjl_dim} has no kernel; supported: 1..{MAX_QJL_DIM}"
        )
    trellis = getattr(quantizer, "trellis", None)
    if trellis is not None and trellis.state_bits > MAX_TRELLIS_STATE_BITS:
        raise ValueError(
            f"{name}: tcq={trellis.state_bits} has no encoder kernel; the kernels code a trellis "
            f"of at most {MAX_TRELLIS_STATE_BITS} state bits (tcq=N, N <= "
            f"{MAX_TRELLIS_STATE_BITS})"
        )


def trellis_constexprs(quantizer) -> dict[str, int]:
    """The compile-time arguments ``trellis_state_bits`` (``L``, 0 without a trellis) and
    ``trellis_tail_biting`` of a quantizer's codes (``None``: exact vectors)."""
    trellis = getattr(quantizer, "trellis", None)
    return {
        "trellis_state_bits": trellis.state_bits if trellis is not None else 0,
        "trellis_tail_biting": int(trellis is not None and trellis.tail_biting),
    }


def check_compressed(c, name: str, ndim: int) -> None:
    """Raise ``ValueError`` unless ``c`` is a CompressedVectors the kernels can read."""
    if not hasattr(c, "quantizer") or not hasattr(c, "codes"):
        raise TypeError(f"{name} must be a CompressedVectors, got {type(c).__name__}")
    check_quantizer(c.quantizer, name)
    if len(c.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} batch dims, got shape {tuple(c.shape)}")
    if c.norms.dtype not in SUPPORTED_NORM_DTYPES:
        raise ValueError(
            f"{name}: norms of dtype {c.norms.dtype} have no kernel; supported norm dtypes are "
            f"{SUPPORTED_NORM_DTYPES}"
        )
    if c.residual_norms is not None and c.residual_norms.dtype not in SUPPORTED_NORM_DTYPES:
        raise ValueError(
            f"{name}: residual norms of dtype {c.residual_norms.dtype} have no kernel; supported "
            f"are {SUPPORTED_NORM_DTYPES}"
        )


def check_query(q: torch.Tensor, name: str = "q") -> None:
    """Raise unless ``q`` is a 4-d floating tensor of a supported dtype."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"{name} must be [batch, q_heads, q_len, head_dim], got {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_QUERY_DTYPES:
        raise ValueError(f"{name} dtype {q.dtype} not supported; use {SUPPORTED_QUERY_DTYPES}")


def group_size(q_heads: int, kv_heads: int) -> int:
    """Query heads per KV head; raise unless it is a whole number (any size: the kernels tile
    the rows of a group in blocks of ``BLOCK_ROWS``)."""
    if kv_heads < 1 or q_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    return q_heads // kv_heads


def check_stream(stream, name: str, *, values: bool = False) -> None:
    """Raise ``ValueError`` naming the feature unless the fused attention can read ``stream``
    (a codec, a :class:`~rqlib.kernels.state.Stream`, or ``None`` for exact vectors)."""
    if stream is None or getattr(stream, "is_exact", False):
        return
    if getattr(stream, "transform", None) is not None:
        token = "vxf" if values else "kxf"
        raise ValueError(
            f"{name}: the calibrated transform (spec token {token}) has no fused attention "
            f"kernel; on CUDA use a config without {token} (it runs on the CPU's torch path)"
        )
    if len(stream.parts) != 1 or stream.parts[0].channels is not None:
        raise ValueError(
            f"{name}: an outlier channel split (spec tokens ko/vo/out) has no fused attention "
            "kernel; on CUDA use a config without it"
        )
    quantizer = stream.parts[0].quantizer
    check_quantizer(quantizer, name)
    if quantizer.norm_dtype not in SUPPORTED_NORM_DTYPES or quantizer.norm_bits > MAX_NORM_BITS:
        raise ValueError(f"{name}: {quantizer.norm_bits}-bit norms have no fused attention kernel")
    if values and quantizer.has_qjl:
        raise ValueError(f"{name}: values must come from an MSE quantizer (no QJL)")
    if values and stream.mean is not None:
        raise ValueError(f"{name}: a mean subtracted from the values has no fused attention kernel")
    value_block(quantizer.rotated_dim)


def check_codecs(keys, values, band_keys=None, band_values=None) -> None:
    """:func:`check_stream` for each codec of one layer (``None``: kept exact)."""
    check_stream(keys, "keys")
    check_stream(values, "values", values=True)
    check_stream(band_keys, "recent band keys")
    check_stream(band_values, "recent band values", values=True)


def check_state(state) -> None:
    """Raise ``ValueError`` unless the fused attention can serve this
    :class:`~rqlib.kernels.state.AttentionState`."""
    check_codecs(state.keys, state.values, state.band_keys, state.band_values)
    if state.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {state.head_dim} has no kernel; supported head dims are "
            f"{SUPPORTED_HEAD_DIMS}"
        )
    for stream in (state.keys, state.values, state.band_keys, state.band_values):
        if stream is not None and stream.is_exact:
            if stream.exact.dtype not in SUPPORTED_EXACT_DTYPES:
                raise ValueError(
                    f"exact vectors of dtype {stream.exact.dtype} have no kernel; supported "
                    f"{SUPPORTED_EXACT_DTYPES}"
                )
    # band and sink pairs whose own values are missing read the main values; the kernel does
    # that only for exact ones (a layer whose values are codes stores both, see rqlib.hf.cache)
    if not state.values.is_exact:
        if state.band_keys is not None and state.band_values is None:
            raise ValueError(
                "a recent band of keys without band values has no kernel when the values are codes"
            )
        if state.n_sink and state.sink_values is None:
            raise ValueError("a sink without sink values has no kernel when the values are codes")


@dataclasses.dataclass(frozen=True)
class StreamFormat:
    """How one stream of a layer stores its vectors, as the attention kernel compiles it: exact
    vectors, or ``bits``-bit codes of ``dim`` rotated coordinates with ``norm_width``-bit norms
    and, for keys, ``qjl`` sign bits (0: no QJL; ``dim`` is 0 for a QJL-only quantizer); codes
    of a trellis have ``trellis_state_bits`` bits of state (0: Lloyd-Max codes) and may be read
    tail-biting."""

    exact: bool = False
    dim: int = 0
    bits: int = 0
    qjl: int = 0
    norm_width: int = 0
    trellis_state_bits: int = 0
    trellis_tail_biting: bool = False

    @classmethod
    def of(cls, stream) -> StreamFormat:
        """The format of a :class:`~rqlib.kernels.state.Stream` or codec (``None`` or an exact
        stream: exact vectors)."""
        if stream is None or getattr(stream, "is_exact", False):
            return cls(exact=True)
        qz = stream.parts[0].quantizer
        trellis = trellis_constexprs(qz)
        return cls(
            dim=qz.rotated_dim if qz.mse_bits else 0,
            bits=qz.mse_bits,
            qjl=qz.qjl_dim if qz.has_qjl else 0,
            norm_width=qz.norm_bits,
            trellis_state_bits=trellis["trellis_state_bits"],
            trellis_tail_biting=bool(trellis["trellis_tail_biting"]),
        )

    @property
    def code_bytes(self) -> int:
        """Bytes of one vector's packed codes."""
        return math.ceil(self.dim * self.bits / 8)

    def constexprs(self, prefix: str) -> dict[str, int]:
        """The kernel's compile-time arguments ``<prefix>_dim``, ``_bits``, ``_code_bytes``,
        ``_width``, ``_trellis_state_bits``, ``_trellis_tail_biting`` (all 0 for exact
        vectors)."""
        coded = not self.exact
        return {
            f"{prefix}_dim": self.dim * coded,
            f"{prefix}_bits": self.bits * coded,
            f"{prefix}_code_bytes": self.code_bytes * coded,
            f"{prefix}_width": self.norm_width * coded,
            f"{prefix}_trellis_state_bits": self.trellis_state_bits * coded,
            f"{prefix}_trellis_tail_biting": int(self.trellis_tail_biting and coded),
        }


def attention_formats(
    head_dim: int,
    keys: StreamFormat,
    values: StreamFormat,
    band_keys: StreamFormat | None = None,
    band_values: StreamFormat | None = None,
) -> dict[str, int]:
    """The compile-time arguments of ``attention_kernel`` for a layer stored in these formats
    (``band_keys`` ``None``: no recent band; ``band_values`` ``None``: the band reads exact
    values)."""
    if keys.exact and keys.qjl:
        raise ValueError("exact keys have no QJL signs")
    band_k_mode = 0 if band_keys is None else (1 if band_keys.exact else 2)
    band_values = band_values if band_keys is not None else None
    band_value_codes = band_values is not None and not band_values.exact
    return {
        "head_dim": head_dim,
        "k_exact": int(keys.exact),
        **keys.constexprs("k"),
        "k_qjl": int(not keys.exact and keys.qjl > 0),
        "v_exact": int(values.exact),
        **values.constexprs("v"),
        "band_k_mode": band_k_mode,
        **(band_keys or StreamFormat(exact=True)).constexprs("bk"),
        "BAND_VALUE_CODES": int(band_value_codes),
        **(band_values or StreamFormat(exact=True)).constexprs("bv"),
    }
