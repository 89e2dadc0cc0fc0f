"""TurboQuant and RotorQuant vector quantizers and their inner-product estimators.

A vector x ∈ R^d is stored as its norm and the codes of its rotated direction:

    y = R x / ‖x‖,   idx_i = #{boundaries < y_i},   ĉ = centroids[idx],   x̂_mse = ‖x‖ Rᵀ ĉ

with the Lloyd-Max codebook of :mod:`rqlib.core.codebooks` and a rotation of
:mod:`rqlib.core.rotations` (dense for TurboQuant, Cl(3,0) rotor blocks for RotorQuant).
⟨q, x̂_mse⟩ is a *biased* estimate of ⟨q, x⟩: it shrinks it by 1 − D_mse on average.

The ``-prod`` variants add TurboQuant's 1-bit QJL correction of the residual r = y − ĉ
(taken in the rotated space, where ⟨Rq, r⟩ = ⟨q, x − x̂_mse⟩/‖x‖): m sign bits sign(S r) of
a random sketch S ∈ R^{m×D} and the residual norm ‖x‖·‖r‖. Then

    ⟨q, x⟩ ≈ ‖x‖ ⟨Rq, ĉ⟩ + ‖x‖‖r‖ · γ/m · ⟨S R q, sign(S r)⟩

is unbiased over the draw of S, with γ = √(π/2) for a Gaussian sketch (the paper) and
γ = 1/(√D · E|u₁|) for an orthogonal sketch whose rows have length √D (the official QJL
code's choice; u uniform on the unit sphere of R^D). Its variance is at most
π/(2m)·‖q‖²‖x‖²‖r‖² for the Gaussian sketch.

Storage accounting (``bits_per_vector``): a ``-prod`` quantizer with b bits spends b − 1 bits
per rotated coordinate on the MSE codes and one bit per sketch row on QJL signs (m = d by
default), so at m = d it stores as many code bits as the ``-mse`` quantizer with b bits, plus
one extra norm (the residual's). Norms are stored in ``norm_dtype`` (float16: 16 bits each), or
with ``norm_mantissa_bits=m`` rounded to a sign-free float of 5 exponent and ``m`` mantissa
bits (a norm is never negative): 5 + m bits each, held in float16 containers by this reference
implementation and counted at 5 + m bits by :attr:`Quantizer.bits_per_vector`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from rqlib.core.codebooks import Codebook, lloyd_max
from rqlib.core.estimator import key_terms, paired_scores
from rqlib.core.packing import pack_bits, pack_signs, packed_size
from rqlib.core.rotations import Rotation, haar_orthogonal, make_rotation
from rqlib.core.trellis import BitshiftTrellis

METHODS = {
    # method: (default rotation, has QJL)
    "turboquant-mse": ("dense", False),
    "turboquant-prod": ("dense", True),
    "rotorquant-mse": ("rotor", False),
    "rotorquant-prod": ("rotor", True),
}
SKETCHES = ("gaussian", "orthogonal")
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SKETCH_DRAW_OFFSET = 1_000_003  # the sketch's random stream is independent of the rotation's


def mean_abs_coordinate(dim: int) -> float:
    """E|u₁| for u uniform on the unit sphere of R^dim: Γ(dim/2) / (√π Γ((dim+1)/2))."""
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


def qjl_gamma(sketch: str, dim: int) -> float:
    """The constant γ making ‖r‖·γ/m·⟨Sq, sign(Sr)⟩ unbiased for ⟨q, r⟩.

    Each sketch row s gives E[sign⟨s, r⟩ ⟨s, q⟩] = c·⟨q, r⟩/‖r‖ with c = √(2/π) for
    s ~ N(0, I) and c = √dim · E|u₁| for s uniform on the sphere of radius √dim (a row of a
    scaled orthogonal matrix); γ = 1/c.
    """
    if sketch == "gaussian":
        return math.sqrt(math.pi / 2)
    if sketch == "orthogonal":
        return 1.0 / (math.sqrt(dim) * mean_abs_coordinate(dim))
    raise ValueError(f"qjl_sketch must be one of {SKETCHES}, got {sketch!r}")


def make_sketch(kind: str, m: int, dim: int, draw: int) -> torch.Tensor:
    """The QJL sketch S ∈ R^{m×dim} (float32).

    ``"gaussian"``: i.i.d. N(0, 1) entries. ``"orthogonal"``: rows of independent Haar
    orthogonal ``dim × dim`` blocks (as many as m needs), scaled to length √dim, so rows within
    a block are exactly orthogonal and every row is uniform on the sphere of radius √dim.
    """
    draw = int(draw) + SKETCH_DRAW_OFFSET
    if kind == "gaussian":
        generator = torch.Generator().manual_seed(draw)
        return torch.randn(m, dim, generator=generator, dtype=torch.float64).float()
    if kind == "orthogonal":
        blocks = [haar_orthogonal(dim, draw + i) for i in range(math.ceil(m / dim))]
        return (torch.cat(blocks)[:m] * math.sqrt(dim)).float()
    raise ValueError(f"qjl_sketch must be one of {SKETCHES}, got {kind!r}")


@dataclass(frozen=True, eq=False)
class CompressedVectors:
    """A batch of compressed vectors, batch shape ``norms.shape``.

    Attributes:
        codes: ``uint8 [..., ceil(D·mse_bits/8)]`` packed codebook indices of the rotated
            direction (D = ``quantizer.rotated_dim``); empty last axis when mse_bits = 0.
        norms: ``[...]`` ‖x‖ in the quantizer's ``norm_dtype``.
        qjl_signs: ``uint8 [..., ceil(m/8)]`` packed signs of S r (prod only, else None).
        residual_norms: ``[...]`` ‖x‖·‖r‖ in ``norm_dtype`` (prod only, else None).
        quantizer: the :class:`Quantizer` that made them (needed to decode).
    """

    codes: torch.Tensor
    norms: torch.Tensor
    qjl_signs: torch.Tensor | None
    residual_norms: torch.Tensor | None
    quantizer: Quantizer = field(repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.norms.shape

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by field name (None fields left out)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def nbytes(self) -> int:
        """Bytes actually held by the stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> CompressedVectors:
        """Apply ``fn`` to every stored tensor (e.g. a slice along batch dims, ``.to(device)``)."""
        return replace(self, **{name: fn(t) for name, t in self.tensors().items()})

    @classmethod
    def cat(cls, items: list[CompressedVectors], dim: int) -> CompressedVectors:
        """Concatenate along batch dimension ``dim`` (counted from the front, >= 0)."""
        if not items:
            raise ValueError("cat needs at least one CompressedVectors")
        if dim < 0 or dim >= len(items[0].shape):
            raise ValueError(f"dim must index a batch dimension (0..{len(items[0].shape) - 1})")
        if any(item.quantizer is not items[0].quantizer for item in items):
            raise ValueError("cannot concatenate vectors compressed by different quantizers")
        names = items[0].tensors().keys()
        return replace(
            items[0], **{n: torch.cat([getattr(i, n) for i in items], dim=dim) for n in names}
        )


class Quantizer:
    """A TurboQuant / RotorQuant quantizer for vectors of dimension ``d``.

    Build it with :func:`make_quantizer`. See the module docstring for the estimator.
    """

    def __init__(
        self,
        method: str,
        d: int,
        bits: int,
        *,
        draw: int,
        rotation: str,
        qjl_sketch: str | None,
        qjl_dim: int | None,
        codebook_law: str,
        norm_dtype: torch.dtype,
        norm_mantissa_bits: int | None = None,
        trellis_state_bits: int | None = None,
        trellis_tail_biting: bool = False,
    ):
        self.method, self.d, self.bits, self.draw = method, d, bits, draw
        self.has_qjl = METHODS[method][1]
        self.mse_bits = bits - 1 if self.has_qjl else bits
        self.norm_dtype = norm_dtype
        self.norm_mantissa_bits = norm_mantissa_bits
        self.rotation: Rotation = make_rotation(rotation, d, draw)
        self.rotated_dim = self.rotation.out_dim
        self.codebook: Codebook | None = (
            lloyd_max(d, self.mse_bits, codebook_law) if self.mse_bits else None
        )
        if self.codebook is not None:
            self.centroids = torch.tensor(self.codebook.centroids, dtype=torch.float32)
            self.boundaries = torch.tensor(self.codebook.boundaries, dtype=torch.float32)
        else:  # pure QJL (prod with 1 bit): the MSE stage reconstructs zero
            self.centroids = torch.zeros(0)
            self.boundaries = torch.zeros(0)
        #: A bitshift trellis that codes the rotated coordinates instead of the Lloyd-Max code
        #: (same bits: one symbol of ``mse_bits`` per coordinate), or ``None``.
        self.trellis: BitshiftTrellis | None = None
        if trellis_state_bits is not None and self.mse_bits:
            self.trellis = BitshiftTrellis(
                state_bits=trellis_state_bits, draw=draw, tail_biting=trellis_tail_biting
            )
        #: What a trellis register reads: its table scaled to a unit vector's coordinates
        #: (float64, ``2^L`` values), the role the centroids play for Lloyd-Max codes.
        self.trellis_levels: torch.Tensor | None = None
        if self.trellis is not None:
            self.trellis_levels = self.trellis.table / math.sqrt(self.rotated_dim)
        self.qjl_sketch = qjl_sketch
        self.qjl_dim = qjl_dim if self.has_qjl else 0
        if self.has_qjl:
            self.sketch = make_sketch(qjl_sketch, qjl_dim, self.rotated_dim, draw)
            self.qjl_scale = qjl_gamma(qjl_sketch, self.rotated_dim) / qjl_dim
        else:
            self.sketch, self.qjl_scale = None, 0.0

    def __repr__(self) -> str:
        qjl = f", qjl_sketch={self.qjl_sketch!r}, qjl_dim={self.qjl_dim}" if self.has_qjl else ""
        trellis = f", trellis_state_bits={self.trellis.state_bits}" if self.trellis else ""
        if self.trellis and self.trellis.tail_biting:
            trellis += ", trellis_tail_biting=True"
        return (
            f"Quantizer({self.method!r}, d={self.d}, bits={self.bits}, "
            f"rotation={self.rotation.kind!r}{qjl}{trellis}, draw={self.draw})"
        )

    # -- storage ---------------------------------------------------------------------------

    @property
    def norm_bits(self) -> int:
        """Bits of one stored norm: the dtype's, or 5 + m for the sign-free e5m<m> format."""
        if self.norm_mantissa_bits is not None:
            return FP16_EXPONENT_BITS + self.norm_mantissa_bits
        return torch.finfo(self.norm_dtype).bits

    @property
    def bits_per_vector(self) -> int:
        """Exact storage of one compressed vector in bits: codes, norm, QJL signs and norm."""
        code_bits = 8 * packed_size(self.rotated_dim, self.mse_bits) if self.mse_bits else 0
        qjl_bits = 8 * packed_size(self.qjl_dim, 1) + self.norm_bits if self.has_qjl else 0
        return code_bits + self.norm_bits + qjl_bits

    # -- encode ----------------------------------------------------------------------------

    def _as_float32(self, x: torch.Tensor, name: str, validate: bool = True) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
        if x.ndim == 0 or x.shape[-1] != self.d:
            raise ValueError(f"{name} must have last dimension d={self.d}, got {tuple(x.shape)}")
        if validate and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} contains NaN or infinite values")
        return x.float()

    def store_norms(
        self, values: torch.Tensor, name: str = "norm", validate: bool = True
    ) -> torch.Tensor:
        """Norms rounded to ``norm_dtype`` (and to ``norm_mantissa_bits`` if set) for storage;
        an overflow is an error, not an inf. ``validate=False`` skips the checks that read
        values back to the host (the caller checks finiteness itself)."""
        stored = values.to(self.norm_dtype)
        if self.norm_mantissa_bits is not None:
            stored = round_fp16_mantissa(stored, self.norm_mantissa_bits, validate=validate)
        if validate and not bool(torch.isfinite(stored).all()):
            raise ValueError(
                f"a {name} overflows {self.norm_dtype} (largest {float(values.max()):.3g}); "
                "use norm_dtype=torch.float32"
            )
        return stored

    def rotated_unit(
        self, x: torch.Tensor, validate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(‖x‖, R x/‖x‖)`` in float32: the first step of :meth:`quantize` (a zero vector
        gives a zero direction). Kernels call it too, so that their codes are bit-identical."""
        x = self._as_float32(x, "x", validate)
        norms = x.norm(dim=-1)
        unit = x / norms.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        return norms, self.rotation.apply(unit)

    def quantize(
        self, x: torch.Tensor, validate: bool = True, trellis_search=None
    ) -> CompressedVectors:
        """Compress ``x [..., d]`` (float16/bfloat16/float32/float64; computed in float32).

        ``validate=False`` skips the checks that read values back to the host (finite inputs,
        no norm overflow): for callers that check finiteness themselves. ``trellis_search``
        replaces the torch search of a trellis code (:meth:`trellis_code`)."""
        norms, y = self.rotated_unit(x, validate)
        if self.trellis is not None:
            indices, c_hat = self.trellis_code(y, trellis_search)
            codes = pack_bits(indices, self.mse_bits, validate=False)
        elif self.mse_bits:
            indices = torch.bucketize(y.contiguous(), self.boundaries.to(y.device)).to(torch.uint8)
            codes = pack_bits(indices, self.mse_bits, validate=False)
            c_hat = self.centroids.to(y.device)[indices.long()]
        else:
            codes = torch.zeros(*y.shape[:-1], 0, dtype=torch.uint8, device=y.device)
            c_hat = torch.zeros_like(y)
        qjl_signs = residual_norms = None
        if self.has_qjl:
            residual = y - c_hat
            projected = residual @ self.sketch.to(residual.device).T
            qjl_signs = pack_signs(projected >= 0)
            residual_norms = self.store_norms(
                norms * residual.norm(dim=-1), "residual norm", validate
            )
        return CompressedVectors(
            codes, self.store_norms(norms, validate=validate), qjl_signs, residual_norms, self
        )

    def trellis_code(self, y: torch.Tensor, search=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(symbols uint8, c_hat float32)`` of rotated unit vectors ``y [..., D]`` by the
        trellis, on ``y``'s device: the coordinates, scaled to unit variance (times sqrt(D)),
        are one sequence. ``search(quantizer, samples [N, D] float64)`` returns the same pair
        ``[N, D]`` in place of the torch Viterbi search (``None``) and :meth:`trellis_values`."""
        flat = y.reshape(-1, self.rotated_dim).double() * math.sqrt(self.rotated_dim)
        if search is None:
            symbols = self.trellis.encode(flat, self.mse_bits).to(torch.uint8)
            c_hat = self.trellis_values(symbols, torch.float32)
        else:
            symbols, c_hat = search(self, flat)
        return symbols.reshape(y.shape), c_hat.reshape(y.shape)

    def trellis_values(self, symbols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``c_hat [..., D]`` of stored trellis ``symbols [..., D]``: the levels
        (:attr:`trellis_levels`) at the shift register's states."""
        flat = symbols.reshape(-1, self.rotated_dim)
        states = self.trellis.states(flat, self.mse_bits)
        values = self.trellis_levels.to(symbols.device)[states]
        return values.to(dtype).reshape(symbols.shape)

    # -- decode ----------------------------------------------------------------------------

    def _check_compressed(self, c: CompressedVectors) -> None:
        if not isinstance(c, CompressedVectors):
            raise TypeError(f"expected CompressedVectors, got {type(c).__name__}")
        if c.quantizer is not self:
            raise ValueError(f"these vectors were compressed by {c.quantizer!r}, not {self!r}")

    def dequantize(self, c: CompressedVectors) -> torch.Tensor:
        """The reconstruction x̂ ``[..., d]`` (float32); for prod it includes the QJL term
        γ/m·Sᵀ sign(S r), so that ⟨q, dequantize(c)⟩ equals :meth:`inner_product`."""
        self._check_compressed(c)
        rotated, qjl = key_terms(c)
        if qjl is not None:
            rotated = rotated + qjl @ self.sketch.to(qjl.device)
        return self.rotation.inverse(rotated)

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """R q ``[..., D]`` (float32)."""
        return self.rotation.apply(self._as_float32(q, "q"))

    def sketch_query(self, q: torch.Tensor) -> torch.Tensor:
        """S R q ``[..., m]`` (float32); prod quantizers only."""
        if not self.has_qjl:
            raise ValueError(f"{self.method} has no QJL sketch")
        rotated = self.rotate_query(q)
        return rotated @ self.sketch.to(rotated.device).T

    def inner_product(self, q: torch.Tensor, c: CompressedVectors) -> torch.Tensor:
        """The estimate of ⟨q, x⟩ from the compressed x (float32), :mod:`rqlib.core.estimator`.

        ``q [..., d]``'s leading dimensions broadcast against ``c.shape``: e.g. q of shape
        ``[B, H, L, 1, d]`` against keys of shape ``[B, H, 1, S]`` gives ``[B, H, L, S]``.
        """
        self._check_compressed(c)
        return paired_scores(self._as_float32(q, "q"), c)


FP16_EXPONENT_BITS, FP16_MANTISSA_BITS = 5, 10


def round_fp16_mantissa(
    values: torch.Tensor, mantissa_bits: int, validate: bool = True
) -> torch.Tensor:
    """Round non-negative float16 ``values`` to ``mantissa_bits`` bits of mantissa (to nearest).

    Works on the bit pattern: adding half of the dropped unit and clearing the dropped bits
    rounds to nearest (ties away from zero), and a carry out of the mantissa correctly bumps the
    exponent. The result is exactly representable with 5 exponent and ``mantissa_bits`` bits.
    ``validate=False`` skips the check for negative values (it reads them back to the host).
    """
    if values.dtype != torch.float16:
        raise TypeError(f"values must be float16, got {values.dtype}")
    if not 1 <= mantissa_bits <= FP16_MANTISSA_BITS:
        raise ValueError(f"mantissa_bits must be in 1..{FP16_MANTISSA_BITS}, got {mantissa_bits}")
    if validate and bool((values < 0).any()):
        raise ValueError("norms are non-negative; got a negative value")
    dropped = FP16_MANTISSA_BITS - mantissa_bits
    if dropped == 0:
        return values
    pattern = values.view(torch.int16).to(torch.int32)
    pattern = (pattern + (1 << (dropped - 1))) & ~((1 << dropped) - 1)
    return pattern.to(torch.int16).view(torch.float16)


def make_quantizer(
    method: str,
    d: int,
    bits: int,
    *,
    draw: int = 0,
    rotation: str | None = None,
    qjl_sketch: str | None = None,
    qjl_dim: int | None = None,
    codebook_law: str = "beta",
    norm_dtype: torch.dtype = torch.float16,
    norm_mantissa_bits: int | None = None,
    trellis_state_bits: int | None = None,
    trellis_tail_biting: bool = False,
) -> Quantizer:
    """Build a quantizer.

    Args:
        method: ``"turboquant-mse"``, ``"turboquant-prod"``, ``"rotorquant-mse"`` or
            ``"rotorquant-prod"``.
        d: vector dimension (>= 2).
        bits: total code bits per coordinate, 1..8; ``-prod`` spends ``bits - 1`` on the MSE
            codes and 1 on the QJL signs (``bits = 1``: QJL alone).
        draw: the draw number that fixes the rotation and the sketch.
        rotation: ``"dense"``, ``"hadamard"`` (power-of-two d), ``"rotor"`` or ``"none"``;
            default dense for TurboQuant and rotor for RotorQuant.
        qjl_sketch: ``"gaussian"`` (the paper, default) or ``"orthogonal"`` (the official QJL
            code); prod only.
        qjl_dim: number of sketch rows m (default d); prod only.
        codebook_law: ``"beta"`` (the exact coordinate law) or ``"gaussian"`` (N(0, 1/d)).
        norm_dtype: storage dtype of the norms (float16, bfloat16 or float32).
        norm_mantissa_bits: with float16 norms, keep only this many mantissa bits (1..10):
            norms then cost 5 + m bits (sign-free e5m<m>); default all 10 (16 bits with sign).
        trellis_state_bits: code the rotated coordinates with a bitshift trellis of this many
            state bits (:mod:`rqlib.core.trellis`; more than the code bits, at most 16) instead
            of the Lloyd-Max code; the same bits are stored. Default ``None``: Lloyd-Max.
        trellis_tail_biting: read that trellis tail-biting (its register starts from the end
            of its own stream: no sample is coded from a part of the table); needs
            ``trellis_state_bits`` and at least that many code bits per vector.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    if isinstance(d, bool) or not isinstance(d, int) or d < 2:
        raise ValueError(f"d must be an integer >= 2, got {d!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    default_rotation, has_qjl = METHODS[method]
    if has_qjl:
        qjl_sketch = "gaussian" if qjl_sketch is None else qjl_sketch
        qjl_dim = d if qjl_dim is None else qjl_dim
        if qjl_sketch not in SKETCHES:
            raise ValueError(f"qjl_sketch must be one of {SKETCHES}, got {qjl_sketch!r}")
        if isinstance(qjl_dim, bool) or not isinstance(qjl_dim, int) or qjl_dim < 1:
            raise ValueError(f"qjl_dim must be a positive integer, got {qjl_dim!r}")
    elif qjl_sketch is not None or qjl_dim is not None:
        raise ValueError(f"qjl_sketch/qjl_dim apply to '-prod' methods only, not {method!r}")
    if norm_dtype not in NORM_DTYPES:
        raise ValueError(f"norm_dtype must be one of {NORM_DTYPES}, got {norm_dtype!r}")
    if norm_mantissa_bits is not None:
        if norm_dtype != torch.float16:
            raise ValueError("norm_mantissa_bits rounds float16 norms; use norm_dtype=float16")
        if (
            isinstance(norm_mantissa_bits, bool)
            or not isinstance(norm_mantissa_bits, int)
            or not 1 <= norm_mantissa_bits <= FP16_MANTISSA_BITS
        ):
            raise ValueError(
                f"norm_mantissa_bits must be an int in 1..{FP16_MANTISSA_BITS}, "
                f"got {norm_mantissa_bits!r}"
            )
    if trellis_state_bits is not None:
        code_bits = bits - 1 if has_qjl else bits
        if (
            isinstance(trellis_state_bits, bool)
            or not isinstance(trellis_state_bits, int)
            or not code_bits < trellis_state_bits <= 16
        ):
            raise ValueError(
                f"trellis_state_bits must be an int in {code_bits + 1}..16 (more than the "
                f"{code_bits} code bits), got {trellis_state_bits!r}"
            )
    if not isinstance(trellis_tail_biting, bool):
        raise ValueError(f"trellis_tail_biting must be a bool, got {trellis_tail_biting!r}")
    if trellis_tail_biting and trellis_state_bits is None:
        raise ValueError("trellis_tail_biting needs a trellis: give trellis_state_bits")
    return Quantizer(
        method,
        d,
        bits,
        draw=int(draw),
        rotation=default_rotation if rotation is None else rotation,
        qjl_sketch=qjl_sketch,
        qjl_dim=qjl_dim,
        codebook_law=codebook_law,
        norm_dtype=norm_dtype,
        norm_mantissa_bits=norm_mantissa_bits,
        trellis_state_bits=trellis_state_bits,
        trellis_tail_biting=trellis_tail_biting,
    )
