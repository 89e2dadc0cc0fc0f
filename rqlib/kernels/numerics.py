"""What the attention kernel computes on a GPU's tensor cores, stated once.

The attention kernel multiplies on fp16 tensor cores, which take fp16 inputs, multiply them
exactly (11 by 11 significant bits fit in the 24 of float32) and accumulate in float32. Three
choices make that an exact statement about what it computes:

- **The kernel's codebook is the codebook rounded to fp16** (:func:`kernel_centroids`): every
  centroid moves by at most ``2^-11`` of itself (:data:`CODEBOOK_ROUNDING`), a fixed change of
  the codebook, not a rounding of each product. The torch implementation reads the float32
  codebook.
- **The other factor is split in two fp16 parts** (``triton_common.split_dot``): the rotated
  query rows and the weights ``p ||v||``. ``x = hi + lo + r`` with
  ``|r| <= 2^-22 |x| + 2^-25``: float32 accuracy, in two products.
- **Query rows are scaled into [-1, 1] by a power of two** (:func:`scaled_rows`), exactly, so
  that no rotated query overflows fp16 and every part keeps its relative accuracy; the scores
  are multiplied back by the same power. A weight ``p ||v||`` is at most ``||v||``, a float16
  norm, so it cannot overflow either.

So the kernel computes, to float32 accuracy, the attention of the cache read with the fp16
codebook: :func:`on_kernel_codebook` gives that state, for the torch implementation
(``rqlib.kernels.reference``) to compute in float64 as the kernel's oracle. Against the float32
codebook a score ``||k|| <R q, c>`` moves by at most ``2^-11 ||k|| sum_j |(R q)_j| |c_j|``.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch

__all__ = [
    "CODEBOOK_DTYPE",
    "CODEBOOK_ROUNDING",
    "PART_REMAINDER",
    "kernel_centroids",
    "kernel_quantizer",
    "on_kernel_codebook",
    "scaled_rows",
]

#: the dtype of the attention kernel's codebook (and of its tensor-core inputs)
CODEBOOK_DTYPE = torch.float16
#: how far a centroid moves, relative to itself, when rounded to fp16 (fp16 keeps 11
#: significant bits: half a unit of the last is at most 2^-11 of the number)
CODEBOOK_ROUNDING = 2.0**-11
#: ``(relative, absolute)``: ``|x - hi - lo| <= relative |x| + absolute`` for the fp16 parts of
#: a float32 ``x`` in fp16's range (``absolute``: half the spacing of fp16's subnormals)
PART_REMAINDER = (2.0**-22, 2.0**-25)


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # quantizer -> its tables


def kernel_centroids(quantizer, device, dtype: torch.dtype = CODEBOOK_DTYPE) -> torch.Tensor:
    """The attention kernel's codebook for ``quantizer``: its centroids rounded to fp16 (to
    nearest), on ``device``, held in ``dtype`` (fp16, or float32 for the scores on the CUDA
    cores: the same values); a one-element zero table for a quantizer without codes. Made once
    per quantizer, device and dtype: a launch reads it without converting anything."""
    tables = _TABLES.setdefault(quantizer, {})
    key = (torch.device(device), dtype)
    if key not in tables:
        centroids = quantizer.centroids
        if centroids.numel() == 0:
            table = torch.zeros(1, dtype=dtype, device=device)
        else:
            table = centroids.to(device=device, dtype=CODEBOOK_DTYPE).to(dtype).contiguous()
        tables[key] = table
    return tables[key]


def kernel_quantizer(quantizer):
    """A copy of ``quantizer`` that decodes with the kernel's codebook (its float32 centroids
    replaced by the values of :func:`kernel_centroids`); it stores codes exactly as
    ``quantizer`` does (same boundaries, rotation and sketch)."""
    rounded = copy.copy(quantizer)
    if quantizer.centroids.numel():
        device = quantizer.centroids.device
        rounded.centroids = kernel_centroids(quantizer, device).to(torch.float32)
    return rounded


def _on_kernel_codebook_stream(stream, rounded: dict):
    if stream is None or stream.is_exact:
        return stream
    parts = []
    for part in stream.parts:
        qz = part.quantizer
        if id(qz) not in rounded:
            rounded[id(qz)] = kernel_quantizer(qz)
        ring = copy.copy(part.ring)  # shares the stored buffers; decodes with the copy
        ring.quantizer, ring.has_decoded = rounded[id(qz)], False
        parts.append(dataclasses.replace(part, quantizer=rounded[id(qz)], ring=ring))
    return dataclasses.replace(stream, parts=tuple(parts))


def on_kernel_codebook(state):
    """The :class:`~rqlib.kernels.state.AttentionState` ``state`` read with the kernel's
    codebook: the same stored bytes, decoded with :func:`kernel_quantizer` of each quantizer.
    The torch implementation of the attention computes, on it, what the kernel computes."""
    rounded: dict = {}
    streams = ("keys", "values", "band_keys", "band_values")
    return dataclasses.replace(
        state,
        **{name: _on_kernel_codebook_stream(getattr(state, name), rounded) for name in streams},
    )


def scaled_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows / s, s)`` for float32 ``rows [..., n]``: ``s [...]`` the power of two above the
    largest magnitude of its row, at most twice it (1 for a row of zeros), so that the scaled
    rows lie in ``(-1, 1)``, within fp16's range, and dividing by ``s`` is exact. Both
    contiguous."""
    largest = rows.abs().amax(dim=-1)
    _, exponent = torch.frexp(largest)  # largest = f 2^e, 0.5 <= f < 1, so largest < 2^e
    scale = torch.ldexp(torch.ones_like(largest), exponent)
    scale = torch.where(largest > 0, scale, torch.ones_like(scale))
    return (rows / scale[..., None]).contiguous(), scale.contiguous()
