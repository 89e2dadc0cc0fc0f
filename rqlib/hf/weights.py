"""Which weights a model holds, whatever dtype it is loaded in: :func:`weight_signature`.

A table measured on a model (the per-layer sensitivities of :mod:`rqlib.study.allocation`)
must be found again for the same weights loaded in fp32, fp16 or bf16, and must not be used
once any weight has changed. A hash of the raw bytes cannot do both (the bytes change with the
dtype), so the signature is a few numbers per parameter tensor that move by a known, tiny
amount under rounding to a narrower dtype and by much more under any real change:

- ``norm``: the Frobenius norm ``||W||``;
- ``z_j = u_j^T W v_j / ||W||`` for :data:`PROJECTIONS` pairs of fixed ±1 vectors ``u_j``,
  ``v_j`` (``W`` viewed as a matrix, rows by the first dimension). For any fixed ``W`` the
  ``z_j`` are ~N(0, 1) over the signs; a change ``dW`` moves ``z_j`` by about
  ``||dW|| / ||W||``.

Rounding each weight to a dtype with unit roundoff ``eps`` (round to nearest) changes it by a
relative error uniform in ``[-eps, eps]``, hence ``||dW|| / ||W|| <= eps`` and each ``z_j`` moves
by a N(0, (eps/sqrt(3))^2) amount: 2.3e-3 for bf16 (eps = 2^-8), 2.8e-4 for fp16 (2^-11). Two
signatures match when every number agrees within :data:`TOLERANCE` of the coarser dtype of the
two, over ten standard deviations of that rounding noise (so a table is found again after a
change of dtype), while fp32 weights must agree to 1e-4 (float sums in another order move a
``z_j`` by ~1e-7): a change of one tensor by more than that, relative, is seen.

The ±1 vectors come from an integer hash of the index (no random generator whose stream could
change between library versions), so signatures are comparable across machines.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch

from rqlib.spec.geometry import model_geometry

__all__ = [
    "PROJECTIONS",
    "SCHEME",
    "TOLERANCE",
    "signature_difference",
    "signature_digest",
    "signatures_match",
    "weight_signature",
]

SCHEME = "rqlib-weights-v1"
PROJECTIONS = 4
#: Largest difference allowed in any signature number, by the coarser dtype of the two compared.
TOLERANCE = {"float32": 1e-4, "float64": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
_ROWS_PER_CHUNK = 4096
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signs(n: int, salt: int) -> torch.Tensor:
    """``n`` fixed pseudo-random ±1 (float64) from a 32-bit integer hash of the index."""
    mask = 0xFFFFFFFF
    h = (torch.arange(n, dtype=torch.int64) * 0x9E3779B1 + salt * 0x85EBCA6B + 0x165667B1) & mask
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & mask
    h = h ^ (h >> 12)
    h = (h * 0x297A2D39) & mask
    h = h ^ (h >> 15)
    return 1.0 - 2.0 * ((h >> 7) & 1).to(torch.float64)


def _tensor_numbers(weight: torch.Tensor, index: int) -> list[float]:
    """``[norm, z_1, ..., z_P]`` of one tensor (see the module docstring)."""
    matrix = weight.detach().reshape(weight.shape[0], -1) if weight.dim() > 1 else weight[None]
    rows, cols = matrix.shape
    salts = [(index * PROJECTIONS + j) * 2 for j in range(PROJECTIONS)]
    device = matrix.device
    v = torch.stack([_signs(cols, salt + 1) for salt in salts], dim=1)  # [cols, P]
    u = torch.stack([_signs(rows, salt) for salt in salts], dim=1)  # [rows, P]
    v32 = v.to(device, torch.float32)
    square = 0.0
    projection = torch.zeros(PROJECTIONS, dtype=torch.float64)
    # float32 sums (pairwise in torch): relative errors ~1e-6, far below TOLERANCE["float32"]
    for start in range(0, rows, _ROWS_PER_CHUNK):
        chunk = matrix[start : start + _ROWS_PER_CHUNK].float()
        square += float(torch.linalg.vector_norm(chunk, dtype=torch.float64) ** 2)
        rows_v = (chunk @ v32).cpu().double()  # [chunk, P]
        projection += (u[start : start + _ROWS_PER_CHUNK] * rows_v).sum(dim=0)
    norm = square**0.5
    z = (projection / norm).tolist() if norm > 0 else [0.0] * PROJECTIONS
    return [norm, *z]


def _state_key(model: torch.nn.Module) -> tuple:
    """What changes whenever a weight changes: each parameter's storage, version and dtype."""
    return tuple(
        (name, p.data_ptr(), p._version, str(p.dtype)) for name, p in model.named_parameters()
    )


def weight_signature(model: torch.nn.Module) -> dict:
    """The signature of ``model``'s weights: ``scheme``, ``dtype`` (the coarsest floating dtype
    among its parameters), ``geometry`` and ``tensors`` (parameter name -> numbers).

    Memoized per model while no parameter is replaced or modified in place.
    """
    key = _state_key(model)
    cached = _MEMO.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    coarsest = max(dtypes, key=lambda d: TOLERANCE.get(str(d).removeprefix("torch."), 1.0))
    config = model.config.get_text_config(decoder=True)
    geometry = {"model_type": getattr(config, "model_type", None)}
    geometry.update(model_geometry(model).to_dict())
    geometry["hidden_size"] = getattr(config, "hidden_size", None)
    tensors = {}
    with torch.no_grad():
        for index, (name, parameter) in enumerate(sorted(model.named_parameters())):
            tensors[name] = _tensor_numbers(parameter, index)
    signature = {
        "scheme": SCHEME,
        "dtype": str(coarsest).removeprefix("torch."),
        "geometry": geometry,
        "tensors": tensors,
    }
    _MEMO[model] = (key, signature)
    return signature


def signature_difference(a: dict, b: dict) -> tuple[float, str]:
    """The largest difference between two signatures and where it is (``inf`` when their
    schemes, geometries or parameter names differ); norms are compared relatively."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return float("inf"), "not a weight signature (an older fingerprint?)"
    for field in ("scheme", "geometry"):
        if a.get(field) != b.get(field):
            return float("inf"), f"{field} differs"
    if set(a["tensors"]) != set(b["tensors"]):
        return float("inf"), "parameter names differ"
    worst, where = 0.0, ""
    for name, first in a["tensors"].items():
        second = b["tensors"][name]
        scale = max(abs(first[0]), abs(second[0]), 1e-30)
        differences = [abs(first[0] - second[0]) / scale]
        differences += [abs(x - y) for x, y in zip(first[1:], second[1:])]
        if max(differences) > worst:
            worst, where = max(differences), name
    return worst, where


def signatures_match(a: dict, b: dict) -> bool:
    """Whether two signatures are of the same weights, up to the rounding of the coarser
    dtype of the two (:data:`TOLERANCE`)."""
    difference, _ = signature_difference(a, b)
    if difference == float("inf"):
        return False
    tolerance = max(TOLERANCE.get(a.get("dtype"), 1.0), TOLERANCE.get(b.get("dtype"), 1.0))
    return difference <= tolerance


def signature_digest(signature: dict) -> str:
    """A short hash of a signature's scheme and geometry (for file names; models with the same
    geometry share it, so a lookup compares the signatures themselves)."""
    identity = json.dumps([signature["scheme"], signature["geometry"]], sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:12]
