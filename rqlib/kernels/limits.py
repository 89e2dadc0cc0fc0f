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
handful, one per distinct per-layer format (and softcap or not: ``launch.attention``), for its
prompts and again for its decode steps, whose few rows cut the key tiles into lanes
(:func:`lanes`).
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
#: Ring capacities are multiples of this many slots (rqlib.kernels.store): every key tile the
#: attention kernel is compiled with (``AttentionConfig.block_s`` of every configuration of
#: :func:`tuned_configs`) divides it, so no tile crosses the end of a ring.
RING_GRANULE = 64
BLOCK_ROWS = 16  # query rows per tile: (position, head of the group) pairs
#: the most lanes a program cuts a key tile into (rqlib.kernels.triton_attention): four lanes of
#: four keys. A tile row per (query row, lane) is the kernel's unit of work, so a lane of fewer
#: keys leaves threads of a two-warp program idle
MAX_LANES = 4
BLOCK_N = 16  # vectors per quantize program
NUM_WARPS = 8  # scores and quantize kernels
#: pipeline stages of the attention kernel's loops in the configurations taken untimed; the
#: pipelined ones (PIPELINED_STAGES) are tried only where launches are timed
ATTENTION_NUM_STAGES = 1
PIPELINED_STAGES = 2  # the next tile's loads in flight while this one is computed
ATTENTION_MAX_REGISTERS = 255  # ptxas would cap a narrow tile at 128 (two blocks an SM) and
# spill; the attention kernel takes the registers it needs instead (one block an SM)
REDUCE_NUM_WARPS = 4
REDUCE_BLOCK = 128  # accumulator columns per reduce program
DEFAULT_PARTITION = 512  # keys per split of a decode step when the SM count is unknown
SPLIT_WAVES = 2  # a decode step launches enough splits for this many programs per SM
MAX_PARTIAL_SHARE = 0.25  # a split's partial results cost at most this share of what it reads
VALUE_BLOCKS = (64, 128, 256)  # accumulator widths per program (next power of two >= 64)
MAX_VALUE_WIDTH = 512  # wider value vectors have no kernel


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How an attention program runs: its warps, whether the scores of codes run on fp16
    tensor cores (``triton_common.split_dot``) or on the CUDA cores, and whether the values'
    centroids are read two a load from a table of centroid pairs
    (``numerics.kernel_table``; the keys' always are) or one a load from the codebook, in
    how many pipeline stages its loops run (``num_stages`` > 1: Triton's software pipelining
    issues the loads of the next key tile, staged in shared memory, while this one is
    computed), and how many keys a tile holds (``block_s``; a decode step's splits start and
    end on whole tiles). All compute the same sums to float32 accuracy; they differ in
    instructions, registers and shared memory."""

    num_warps: int
    score_tensor_cores: bool
    value_pairs: bool = False
    num_stages: int = ATTENTION_NUM_STAGES
    block_s: int = ATTENTION_BLOCK_S

    @property
    def score_codebook_dtype(self) -> torch.dtype:
        """The dtype the scores read the keys' codebook in: fp16 for the tensor cores, float32
        on the CUDA cores (the same values: ``numerics.kernel_centroids``)."""
        return CODEBOOK_DTYPE if self.score_tensor_cores else torch.float32

    def constexprs(self) -> dict[str, int]:
        """The kernel's compile-time arguments for this configuration."""
        return {
            "SCORE_TENSOR_CORES": int(self.score_tensor_cores),
            "VALUE_PAIRS": int(self.value_pairs),
            "BLOCK_S": self.block_s,
        }


#: The attention kernel's configurations, in order of preference. The fewer warps, the fewer
#: instructions per key (rqlib.book.sass counts them: each warp repeats the bookkeeping of a
#: tile, and a tile of 16 rows and 16 keys is too small to share among four warps without
#: copies), and fewer with the scores on tensor cores (their multiply-adds leave the CUDA cores)
#: and with the values' centroids read in pairs; but the fewer the warps, the more registers
#: each thread holds. Two warps fit the presets' formats in a decode step at head dims 64 and
#: 128 (with lanes, which shrink a tile's softmax), four warps with the scores on tensor cores
#: the lighter formats of a prompt (some only without the value pairs), and eight warps with
#: the scores on the CUDA cores every format of the covering set. A layer format on a GPU
#: launches the fastest measured of the configurations whose compiled kernel does not spill
#: registers, the first of them where nothing is timed (``launch.attention_config``;
#: tests/test_kernels_aot.py).
ATTENTION_CONFIGS = (
    AttentionConfig(2, True, value_pairs=True),
    AttentionConfig(4, True, value_pairs=True),
    AttentionConfig(4, True),
    AttentionConfig(8, False),
)
#: The tensor-core configurations again, software-pipelined. A prefetched tile costs registers
#: and shared memory, and whether hiding the loads' latency is worth them depends on the GPU and
#: the context, so they are never taken untimed (after ATTENTION_CONFIGS, whose last fits every
#: format): where launches are timed, each is compiled, dropped if it spills, and timed with the
#: others (``launch.attention_config``).
PIPELINED_CONFIGS = tuple(
    dataclasses.replace(config, num_stages=PIPELINED_STAGES)
    for config in ATTENTION_CONFIGS
    if config.score_tensor_cores
)

#: Wider key tiles, in the configurations where they fit: a tile of more keys shares its
#: bookkeeping (the softmax's maxima and rescaling, the loop's addresses) among more keys, but
#: holds more registers, so it needs more warps. Compiled for the presets' layout, a tile of 32
#: keys fits four warps and one of 64 keys eight warps at head dimension 64, while at head
#: dimension 128 both spill (tests/test_kernels_aot.py compiles them). Against the first
#: configuration's two warps on 16 keys they issue about as many instructions a key (count them
#: with rqlib.book.sass); what they may buy is latency hidden by more warps a block, which only
#: a GPU can time. So, like the pipelined ones, they are taken only where timed, and a format
#: they spill in drops them.
WIDE_TILE_CONFIGS = (
    AttentionConfig(4, True, value_pairs=True, block_s=2 * ATTENTION_BLOCK_S),
    AttentionConfig(8, True, value_pairs=True, block_s=4 * ATTENTION_BLOCK_S),
)


def tuned_configs() -> tuple[AttentionConfig, ...]:
    """Every configuration a launch may run, in order of preference where nothing is timed:
    :data:`ATTENTION_CONFIGS`, then :data:`PIPELINED_CONFIGS` and :data:`WIDE_TILE_CONFIGS`
    (read when called, so that a study that narrows these tuples narrows the tuner too)."""
    return ATTENTION_CONFIGS + PIPELINED_CONFIGS + WIDE_TILE_CONFIGS


def widest_tile() -> int:
    """The most keys a tile of any of :func:`tuned_configs` holds: a ring's capacity must be a
    multiple of it (:data:`RING_GRANULE` is)."""
    return max(config.block_s for config in tuned_configs())


def lanes(rows: int) -> int:
    """The lanes the attention kernel cuts each key tile into for a block of ``rows`` query rows
    (rqlib.kernels.triton_attention): as many copies of the rows as fill the ``BLOCK_ROWS``
    rows of a tile, a power of two up to ``MAX_LANES``; 1 for a block that fills them (a
    prompt, or a group of more than ``BLOCK_ROWS / 2`` heads)."""
    if rows < 1:
        raise ValueError(f"a block has at least one row, got {rows}")
    lanes = 1
    while lanes < MAX_LANES and rows * 2 * lanes <= BLOCK_ROWS:
        lanes *= 2
    return lanes


def partial_bytes(rows: int, acc_width: int, lanes: int = 1) -> int:
    """Bytes of one split's partial results for ``rows`` query rows in ``lanes`` lanes, written
    by the split and read back by the reduce: per row and lane, ``m`` and ``l`` of each of the
    three streams (main, band, sink) and the main stream's accumulator of ``acc_width`` floats.
    An accumulator is written only where its row saw a key, so the band's and the sink's are
    written by the one or two splits that hold their keys, a constant of the step
    (:func:`stream_partial_bytes`), not a cost of every split."""
    return 2 * rows * lanes * (3 * 2 + acc_width) * 4


def stream_partial_bytes(rows: int, acc_width: int, lanes: int = 1) -> int:
    """Bytes of the accumulators of one stream of a step's partial results, written by one
    split and read back by the reduce: ``acc_width`` floats per row and lane (the band and the
    sink, once each per step; see :func:`partial_bytes`)."""
    return 2 * rows * lanes * acc_width * 4


def even_partition(span: int, splits: int, block: int = ATTENTION_BLOCK_S) -> tuple[int, int]:
    """``(splits, partition)``: ``span`` keys cut into at most ``splits`` near-equal splits of
    whole key tiles of ``block`` keys (``partition`` a positive multiple of ``block``,
    ``splits * partition >= span``)."""
    partition = max(block, math.ceil(span / max(1, splits) / block) * block)
    return math.ceil(span / partition), partition


def decode_splits(
    span: int,
    programs: int,
    sm_count: int | None,
    partial_bytes: int,
    key_bytes: float,
    block: int = ATTENTION_BLOCK_S,
) -> tuple[int, int]:
    """``(splits, partition)``: how a decode step cuts its ``span`` keys, in splits of
    ``partition`` keys (a multiple of the key tile's ``block`` keys;
    ``splits * partition >= span``).

    With one query token there are only ``programs`` = batch x KV heads groups of rows, far
    fewer than a GPU's SMs, so the keys provide the parallelism. Given the ``sm_count``, the
    step asks for enough splits that the programs fill ``SPLIT_WAVES`` waves of the SMs, but no
    split so short that the ``partial_bytes`` it writes and the reduce reads back (its rows'
    ``m``, ``l`` and accumulators) exceed ``MAX_PARTIAL_SHARE`` of the bytes of the keys and
    values it reads (``key_bytes`` per key position). Without an SM count (the interpreter),
    splits of ``DEFAULT_PARTITION`` keys."""
    if span < 1 or programs < 1:
        raise ValueError(f"span and programs must be >= 1, got {span} and {programs}")
    if sm_count is None:
        splits = math.ceil(span / DEFAULT_PARTITION)
    else:
        if sm_count < 1 or key_bytes <= 0 or partial_bytes < 0:
            raise ValueError(
                f"need sm_count >= 1, key_bytes > 0 and partial_bytes >= 0, got {sm_count}, "
                f"{key_bytes} and {partial_bytes}"
            )
        fill = math.ceil(SPLIT_WAVES * sm_count / programs)
        shortest = max(block, partial_bytes / (MAX_PARTIAL_SHARE * key_bytes))
        splits = min(fill, max(1, math.floor(span / shortest)))
    return even_partition(span, splits, block)


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
    and, for keys, ``qjl`` sign bits (0: no QJL; ``dim`` is 0 for a QJL-only quantizer)."""

    exact: bool = False
    dim: int = 0
    bits: int = 0
    qjl: int = 0
    norm_width: int = 0

    @classmethod
    def of(cls, stream) -> StreamFormat:
        """The format of a :class:`~rqlib.kernels.state.Stream` or codec (``None`` or an exact
        stream: exact vectors)."""
        if stream is None or getattr(stream, "is_exact", False):
            return cls(exact=True)
        qz = stream.parts[0].quantizer
        return cls(
            dim=qz.rotated_dim if qz.mse_bits else 0,
            bits=qz.mse_bits,
            qjl=qz.qjl_dim if qz.has_qjl else 0,
            norm_width=qz.norm_bits,
        )

    @property
    def code_bytes(self) -> int:
        """Bytes of one vector's packed codes."""
        return math.ceil(self.dim * self.bits / 8)

    def constexprs(self, prefix: str) -> dict[str, int]:
        """The kernel's compile-time arguments ``<prefix>_dim``, ``_bits``, ``_code_bytes``,
        ``_width`` (all 0 for exact vectors)."""
        coded = not self.exact
        return {
            f"{prefix}_dim": self.dim * coded,
            f"{prefix}_bits": self.bits * coded,
            f"{prefix}_code_bytes": self.code_bytes * coded,
            f"{prefix}_width": self.norm_width * coded,
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
