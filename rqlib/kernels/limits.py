"""What the kernels accept, checked in one place, and the launch constants they share.

Every public kernel entry point calls one of the ``check_*`` functions before it launches
anything, so an input with no kernel raises a ``ValueError`` naming what is supported instead
of producing uninitialized output. The same constants feed the ahead-of-time compile list in
:mod:`rqlib.kernels.aot`, so "every specialization the dispatcher can pick" is a finite,
enumerable set.

Design: the head dimension D, the sketch dimension m and the code width b are *runtime*
arguments of the kernels (loops over chunks of ``CHUNK`` coordinates), so they add no
specializations; only the width of the decode accumulator (``BLOCK_V``) and the storage dtype
of full-precision values are compile-time.
"""

from __future__ import annotations

import torch

from rqlib.core import gqa

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
MAX_MSE_BITS = 8  # codes of up to 8 bits straddle at most two bytes: the unpack reads two
MAX_QJL_DIM = 1024
MAX_GROUP = 16  # query heads per KV head: one padded block of rows (tl.dot needs M >= 16)
SUPPORTED_NORM_DTYPES = (torch.float16,)
SUPPORTED_QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tile sizes, chosen from the AOT register report (python -m rqlib.kernels.aot) so that no
# specialization but the widest compressed-value decode spills on sm_90; see the report in the
# tests. tl.dot needs every block dimension >= 16 on a GPU.
CHUNK = 32  # coordinates per inner step (codes, signs, exact keys)
SCORES_BLOCK_S = 32  # keys per fused_scores tile
DECODE_BLOCK_S = 16  # keys per decode tile (also the K dimension of P.V)
BLOCK_ROWS = 16  # query rows per tile (padded GQA group or prefill rows)
BLOCK_N = 16  # vectors per quantize program
NUM_WARPS = 8  # scores, decode partition and quantize kernels
REDUCE_NUM_WARPS = 4
DEFAULT_PARTITION = 512  # keys per decode partition (a multiple of DECODE_BLOCK_S)
VALUE_BLOCKS = (64, 128, 256, 512)  # decode accumulator widths (next power of two >= 64)


def value_block(width: int) -> int:
    """The decode accumulator width for ``width`` value coordinates (a power of two >= 64)."""
    for block in VALUE_BLOCKS:
        if width <= block:
            return block
    raise ValueError(f"value width {width} exceeds the largest accumulator {VALUE_BLOCKS[-1]}")


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
    """Query heads per KV head; raise unless it is a whole number in 1..MAX_GROUP."""
    group = gqa.group_size(q_heads, kv_heads)
    if group > MAX_GROUP:
        raise ValueError(f"{group} query heads per KV head; supported: 1..{MAX_GROUP}")
    return group
