"""Kernels over the compressed KV cache, with a dispatcher between Triton and torch.

Public functions (each validates its input, then runs on the backend :func:`select_backend`
picks):

- :func:`quantize`          a Quantizer's ``quantize``, with bucketize + pack (+ QJL) fused
- :func:`fused_scores`      attention scores straight from packed keys, [B, QH, Lq, S] float32
- :func:`decode_attention`  one decode step: scores, online softmax, P.V, partition + reduce

Backends: CUDA tensors run the Triton kernels (``RuntimeError`` if triton cannot be imported:
there is no slow path); CPU tensors run the pure-torch references of
:mod:`rqlib.kernels.reference`, or the Triton kernels in the interpreter when
``TRITON_INTERPRET=1`` was set before this package was imported. ``backend="triton"`` or
``"torch"`` forces one. An input no kernel supports raises ``ValueError`` naming what is
supported (:mod:`rqlib.kernels.limits`).
"""

from __future__ import annotations

import importlib
import os

import torch

from rqlib.kernels import limits as geo
from rqlib.kernels import reference

BACKENDS = ("auto", "triton", "torch")

__all__ = ["BACKENDS", "decode_attention", "fused_scores", "quantize", "select_backend"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launch_module():
    """Import the Triton host code, turning a missing triton into a clear RuntimeError."""
    try:
        return importlib.import_module("rqlib.kernels.launch")
    except ImportError as error:
        if "triton" not in str(error):
            raise
        raise RuntimeError(
            "the rqlib kernels need triton (pip install triton==3.9.0); it could not be "
            f"imported: {error}"
        ) from error


def select_backend(device: torch.device, backend: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device`` (see the module doc)."""
    backend = "auto" if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "torch":
        return "torch"
    if device.type == "cuda":
        _launch_module()
        return "triton"
    if backend == "auto":
        return "triton" if _interpreting() else "torch"
    if device.type != "cpu":
        raise ValueError(f"the Triton kernels run on cuda (or cpu when interpreted), not {device}")
    if not _interpreting():
        raise RuntimeError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before rqlib.kernels "
            "is imported"
        )
    module = _launch_module()
    if type(module.fused_scores_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after the Triton kernels were defined; set it before "
            "importing rqlib.kernels"
        )
    return "triton"


def fused_scores(
    q: torch.Tensor,
    keys,
    *,
    scale: float,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention scores of ``q`` against compressed ``keys``, float32 [B, QH, Lq, S].

    ``q`` is [batch, q_heads, q_len, head_dim] (fp32, fp16 or bf16); ``keys`` a
    CompressedVectors of shape [batch, kv_heads, kv_len]; query head h reads kv head
    h // (q_heads // kv_heads). The score is
    ``scale * (||k|| <R q, c[codes]> + ||r|| gamma/m <S R q, signs>)``, the second term only for
    prod keys: the same estimator as ``keys.quantizer.inner_product``. No mask is applied.
    ``out`` (optional) is a float32 contiguous buffer of the output shape.
    """
    _check_scores_inputs(q, keys)
    if out is not None:
        _check_out(out, (*q.shape[:3], keys.shape[2]), q.device)
    if select_backend(q.device, backend) == "torch":
        result = reference.fused_scores(q, keys, scale=scale)
        return result if out is None else out.copy_(result)
    return _launch_module().fused_scores(q, keys, float(scale), out)


def decode_attention(
    q: torch.Tensor,
    keys,
    values,
    *,
    scale: float,
    sink_keys: torch.Tensor | None = None,
    sink_values: torch.Tensor | None = None,
    recent_keys: torch.Tensor | None = None,
    recent_values: torch.Tensor | None = None,
    window: int | None = None,
    partition_size: int = geo.DEFAULT_PARTITION,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of attention over a compressed cache; returns [B, QH, 1, d] in q's dtype.

    ``q`` [batch, q_heads, 1, d] is the query at position S-1; ``keys`` a CompressedVectors
    [batch, kv_heads, S]; ``values`` a float tensor [batch, kv_heads, S, d] or an MSE
    CompressedVectors [batch, kv_heads, S]. ``sink_keys`` / ``recent_keys`` [B, KV, n, d] are the
    exact first / last n keys and replace the compressed ones at those positions;
    ``sink_values`` / ``recent_values`` do the same for compressed values (they must be given
    exactly when the matching keys are, and only with compressed values). ``window``: keys at
    positions < S - window are invisible (sliding-window layers). Computed in float32;
    ``partition_size`` keys per partition of the split softmax (a multiple of 16).
    """
    _check_decode_inputs(
        q,
        keys,
        values,
        sink_keys,
        sink_values,
        recent_keys,
        recent_values,
        window,
        partition_size,
    )
    if out is not None:
        _check_out(out, tuple(q.shape), q.device, dtype=q.dtype)
    options = dict(
        scale=scale,
        sink_keys=sink_keys,
        sink_values=sink_values,
        recent_keys=recent_keys,
        recent_values=recent_values,
        window=window,
    )
    if select_backend(q.device, backend) == "torch":
        result = reference.decode_attention(q, keys, values, **options).to(q.dtype)
        return result if out is None else out.copy_(result)
    result = _launch_module().decode_attention(
        q, keys, values, partition_size=partition_size, out=None, **options
    )
    result = result.to(q.dtype)
    return result if out is None else out.copy_(result)


def quantize(quantizer, x: torch.Tensor, *, backend: str | None = None):
    """``quantizer.quantize(x)`` computed by the fused kernel: bit-identical codes.

    Rotation and normalization run in torch with the quantizer's own operations; bucketize,
    packing, residual, sketch, sign packing and the residual norm run in one Triton kernel
    (see :mod:`rqlib.kernels.triton_quantize` for why the rotation stays in torch).
    """
    geo.check_quantizer(quantizer, "quantizer")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point torch.Tensor")
    if x.shape[-1] != quantizer.d:
        raise ValueError(f"x must have last dimension {quantizer.d}, got {tuple(x.shape)}")
    if select_backend(x.device, backend) == "torch":
        return reference.quantize(quantizer, x)
    return _launch_module().quantize(quantizer, x)


def _check_out(out: torch.Tensor, shape, device, dtype=torch.float32) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must be a tensor of shape {tuple(shape)}")
    if out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor on {device}")


def _check_scores_inputs(q: torch.Tensor, keys) -> None:
    geo.check_query(q)
    geo.check_compressed(keys, "keys", ndim=3)
    if q.shape[0] != keys.shape[0]:
        raise ValueError(f"q batch {q.shape[0]} != keys batch {keys.shape[0]}")
    if q.shape[-1] != keys.quantizer.d:
        raise ValueError(f"q head_dim {q.shape[-1]} != keys head_dim {keys.quantizer.d}")
    if keys.norms.device != q.device:
        raise ValueError(f"q is on {q.device} but keys are on {keys.norms.device}")
    geo.group_size(q.shape[1], keys.shape[1])


def _check_exact(t: torch.Tensor | None, name: str, q: torch.Tensor, kv_heads: int, kv_len: int):
    if t is None:
        return 0
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
        raise ValueError(f"{name} must be a float tensor [batch, kv_heads, n, head_dim]")
    batch, _, _, head_dim = q.shape
    if (t.shape[0], t.shape[1], t.shape[3]) != (batch, kv_heads, head_dim):
        raise ValueError(
            f"{name} must be [{batch}, {kv_heads}, n, {head_dim}], got {tuple(t.shape)}"
        )
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if t.shape[2] > kv_len:
        raise ValueError(f"{name} holds {t.shape[2]} tokens but the cache only {kv_len}")
    return t.shape[2]


def _check_decode_inputs(
    q, keys, values, sink_keys, sink_values, recent_keys, recent_values, window, partition_size
) -> None:
    _check_scores_inputs(q, keys)
    if q.shape[2] != 1:
        raise ValueError(f"decode_attention takes one query position, got q_len {q.shape[2]}")
    batch, kv_heads, kv_len = keys.shape
    if kv_len < 1:
        raise ValueError("decode_attention needs at least one key")
    head_dim = q.shape[-1]
    if isinstance(values, torch.Tensor):
        if values.shape != (batch, kv_heads, kv_len, head_dim):
            raise ValueError(
                f"values must be [{batch}, {kv_heads}, {kv_len}, {head_dim}], "
                f"got {tuple(values.shape)}"
            )
        if values.dtype not in geo.SUPPORTED_VALUE_DTYPES:
            raise ValueError(
                f"values dtype {values.dtype} not supported; use {geo.SUPPORTED_VALUE_DTYPES}"
            )
        if values.device != q.device:
            raise ValueError(f"values are on {values.device}, q on {q.device}")
        if sink_values is not None or recent_values is not None:
            raise ValueError(
                "sink_values / recent_values are only for compressed values; full-precision "
                "values are already exact"
            )
    else:
        geo.check_compressed(values, "values", ndim=3)
        if tuple(values.shape) != tuple(keys.shape):
            raise ValueError(f"values shape {tuple(values.shape)} != keys {tuple(keys.shape)}")
        if values.quantizer.has_qjl or values.quantizer.mse_bits == 0:
            raise ValueError("compressed values must come from an MSE quantizer (no QJL)")
        if values.quantizer.d != head_dim:
            raise ValueError(f"values head_dim {values.quantizer.d} != q head_dim {head_dim}")
        if (sink_keys is None) != (sink_values is None):
            raise ValueError("with compressed values give sink_keys and sink_values together")
        if (recent_keys is None) != (recent_values is None):
            raise ValueError("with compressed values give recent_keys and recent_values together")
    n_sink = _check_exact(sink_keys, "sink_keys", q, kv_heads, kv_len)
    n_recent = _check_exact(recent_keys, "recent_keys", q, kv_heads, kv_len)
    if (
        sink_values is not None
        and _check_exact(sink_values, "sink_values", q, kv_heads, kv_len) != n_sink
    ):
        raise ValueError("sink_values must hold as many tokens as sink_keys")
    if recent_values is not None and (
        _check_exact(recent_values, "recent_values", q, kv_heads, kv_len) != n_recent
    ):
        raise ValueError("recent_values must hold as many tokens as recent_keys")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if partition_size < geo.DECODE_BLOCK_S or partition_size % geo.DECODE_BLOCK_S:
        raise ValueError(f"partition_size must be a positive multiple of {geo.DECODE_BLOCK_S}")
