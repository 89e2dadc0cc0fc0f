"""The Triton interpreter, made to multiply like a GPU's tensor cores.

Under ``TRITON_INTERPRET=1`` a ``tl.dot`` is a numpy matrix product at its inputs' precision,
whatever its ``input_precision``. On a GPU, a dot with ``input_precision="tf32"`` rounds its
float32 inputs to tf32 (10 mantissa bits) before the tensor core multiplies them. A kernel
whose correctness rests on that rounding changing nothing
(:func:`rqlib.kernels.triton_common.exact_dot`) cannot be checked on CPU unless the interpreter
rounds the same way: :func:`tf32_like_tensor_cores` makes it do so, with the rounding of
:func:`round_to_tf32`. The test suite runs every kernel under it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["TF32_DROPPED_BITS", "round_to_tf32", "tf32_like_tensor_cores"]

#: float32 mantissa bits that tf32 drops: a tf32 number keeps 10 of the 23
TF32_DROPPED_BITS = 13


def round_to_tf32(values: torch.Tensor) -> torch.Tensor:
    """``values`` as float32 numbers with 10 mantissa bits (tf32), rounded to nearest, ties
    away from zero: what PTX ``cvt.rna.tf32.f32`` does to a tensor core's float32 input."""
    bits = values.to(torch.float32).contiguous().view(torch.int32)
    half = 1 << (TF32_DROPPED_BITS - 1)
    rounded = (bits + half) & -(1 << TF32_DROPPED_BITS)  # sign and magnitude: ties away
    return rounded.view(torch.float32)


def _rounded(handle, tensor_handle):
    """``handle`` with its float32 data rounded to tf32 (other dtypes as they are)."""
    import numpy as np
    import triton.language as tl

    if handle.dtype != tl.float32:
        return handle
    data = round_to_tf32(torch.from_numpy(np.ascontiguousarray(handle.data))).numpy()
    return tensor_handle(data, handle.dtype)


@contextlib.contextmanager
def tf32_like_tensor_cores() -> Iterator[None]:
    """Within the block, the interpreter rounds the float32 inputs of every tf32 ``tl.dot`` to
    tf32 before multiplying, as a GPU's tensor cores do. Raises ``RuntimeError`` when Triton's
    interpreter does not have the hook this relies on (a Triton version it was not written for),
    rather than checking nothing."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or not hasattr(interpreter, "TensorHandle"):
        raise RuntimeError("this Triton's interpreter has no InterpreterBuilder.create_dot")
    tf32 = ir.INPUT_PRECISION.TF32

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision == tf32:
            a = _rounded(a, interpreter.TensorHandle)
            b = _rounded(b, interpreter.TensorHandle)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original
