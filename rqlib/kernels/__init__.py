"""Kernels over the compressed KV cache, with a dispatcher between Triton and torch.

Public functions (each validates its input, then runs on the backend :func:`select_backend`
picks):

- :func:`quantize`      a Quantizer's ``quantize``, with bucketize + pack (+ QJL) fused, or
  a trellis code's Viterbi search
- :func:`fused_scores`  attention scores straight from packed keys, [B, QH, Lq, S] float32
- :func:`attention`     attention over one layer of the compressed cache (its stored streams,
  sink and recent band), fused: one kernel (and a reduce) per layer and step, or a prompt in
  query and key blocks

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

from rqlib.core.gqa import group_size as gqa_group
from rqlib.kernels import limits as geo
from rqlib.kernels import reference

BACKENDS = ("auto", "triton", "torch")

__all__ = [
    "BACKENDS",
    "attention",
    "check_layer",
    "fused_scores",
    "quantize",
    "select_attention_backend",
    "select_backend",
]


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


def select_attention_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend of :func:`attention` for tensors on ``device``: ``"auto"`` is Triton on CUDA
    and torch on CPU (the interpreter is far too slow to be a default); ``"triton"`` and
    ``"torch"`` force one (see :func:`select_backend`)."""
    backend = "auto" if backend is None else backend
    if backend == "auto" and torch.device(device).type != "cuda":
        return "torch"
    return select_backend(device, backend)


def attention(
    state,
    q: torch.Tensor,
    mask,
    *,
    scale: float,
    softcap: float | None = None,
    backend: str | None = None,
    partition: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hq, Lq, d]`` over one layer of the compressed cache.

    ``state`` is an :class:`~rqlib.kernels.state.AttentionState` (the stored streams; the
    queries sit at positions ``state.start .. state.end - 1``), ``mask`` a
    :class:`~rqlib.kernels.state.CausalMask` or :class:`~rqlib.kernels.state.DenseMask`.
    Returns float32 ``[B, Hq, Lq, d]``. The same semantics run in torch
    (:func:`rqlib.kernels.reference.attention`) and in one fused Triton kernel
    (:mod:`rqlib.kernels.triton_attention`); a state the kernel cannot serve raises
    ``ValueError`` naming the feature (:func:`rqlib.kernels.limits.check_state`).

    ``partition``: at most this many keys per split of a decode step in the Triton kernel (a
    positive multiple of ``ATTENTION_BLOCK_S``); by default a fixed number of splits chosen
    from the GPU's SM count (:func:`rqlib.kernels.limits.decode_splits`). The torch path has
    no splits and ignores it.
    """
    if partition is not None and (
        isinstance(partition, bool)
        or not isinstance(partition, int)
        or partition <= 0
        or partition % geo.ATTENTION_BLOCK_S
    ):
        raise ValueError(
            f"partition must be a positive multiple of {geo.ATTENTION_BLOCK_S} keys, got "
            f"{partition!r}"
        )
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not q.is_floating_point():
        raise ValueError("q must be a float tensor [batch, q_heads, q_len, head_dim]")
    if q.shape[2] != state.end - state.start:
        raise ValueError(
            f"q holds {q.shape[2]} positions but the state's chunk is "
            f"{state.start}..{state.end - 1}"
        )
    gqa_group(q.shape[1], state.keys.rings[0].heads)
    if select_attention_backend(q.device, backend) == "torch":
        return reference.attention(state, q, mask, scale=scale, softcap=softcap)
    geo.check_query(q)
    geo.check_state(state)
    return _launch_module().attention(state, q, mask, float(scale), softcap, partition)


def check_layer(keys, values, band_keys=None, band_values=None) -> None:
    """Raise ``ValueError`` naming the feature unless the fused attention serves a layer with
    these codecs (``None``: kept exact): :func:`rqlib.kernels.limits.check_codecs`."""
    geo.check_codecs(keys, values, band_keys, band_values)


def quantize(quantizer, x: torch.Tensor, *, backend: str | None = None, validate: bool = True):
    """``quantizer.quantize(x)`` computed by the fused kernel: bit-identical codes.

    Rotation and normalization run in torch with the quantizer's own operations; bucketize,
    packing, residual, sketch, sign packing and the residual norm run in one Triton kernel
    (see :mod:`rqlib.kernels.triton_quantize` for why the rotation stays in torch). A trellis
    code is searched by its own kernel (:mod:`rqlib.kernels.triton_trellis`, a Viterbi search
    over ``2^L`` states, one program a vector) and packed in torch.
    ``validate=False`` skips the checks that read values back to the host (finite input, no
    norm overflow).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point torch.Tensor")
    if x.shape[-1] != quantizer.d:
        raise ValueError(f"x must have last dimension {quantizer.d}, got {tuple(x.shape)}")
    if select_backend(x.device, backend) == "torch":
        return reference.quantize(quantizer, x, validate=validate)
    geo.check_quantizer(quantizer, "quantizer")
    if getattr(quantizer, "trellis", None) is not None:
        return _launch_module().trellis_quantize(quantizer, x, validate=validate)
    return _launch_module().quantize(quantizer, x, validate=validate)


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
