"""``CompressionConfig``: what the compressed cache does to each layer's keys and values.

A config is a frozen dataclass; ``to_dict``/``from_dict`` round-trip it through JSON and
:meth:`CompressionConfig.parse` reads the compact spec the eval command takes::

    METHOD[:TOKEN]...        e.g.  turboquant-mse:k3:v4:sink1:win32:ctr

METHOD is ``turboquant-mse``, ``turboquant-prod``, ``rotorquant-mse``, ``rotorquant-prod``, or
``preset:NAME`` (a named config from :mod:`rqlib.spec.presets`, optionally followed by tokens that
override it). TOKENs (``name=value`` or the short form):

=====================  ===================================================================
``k3`` / ``k=3``       key bits (1..8; the ``-prod`` methods need >= 2), default 3
``v4`` / ``v=4``       value bits (1..8); ``v=fp`` (default) keeps values in full precision
``b3``                 both key and value bits
``k0-1=4``, ``v29=5``  bits for a layer or an inclusive layer range (``v5=fp`` allowed)
``sink1``              the first N tokens of the sequence kept exact (K and V)
``win32``              a band of the W most recent tokens kept exact, relative to each query
``wb=8``               the recent band stored at 8 bits (MSE codes of the values' family,
                       norms as ``nm`` says) instead of exact 16-bit copies
``once``               the recent band stored once: a token gets its main codes when it leaves
                       the band, coded from what the band stores, so that the W newest tokens
                       are stored in the band only (needs ``winN``; a causal mask)
``twice``              the recent band stored twice: every token gets its main codes when it
                       arrives and keeps them while it is also in the band (the default of a
                       method; after a preset that stores its band once, it undoes ``once``)
``exact=0,-1``         layers kept exact (negative counts from the end); ``exact=none``
``ctr``                per-layer, per-KV-head key centering with a mean calibrated on pydoc
``kxf`` / ``vxf``      keys / values through a calibrated transform per layer and KV head (the
                       eigenvectors of the query- / o_proj-weighted covariance, centred), its
                       components in groups of 16 with one bit width a group chosen by
                       water-filling, each width's components coded as one TurboQuant vector;
                       the torch path only, refused on CUDA. The widths are resolved against
                       the model (``kg3=5331``: layer 3's key groups at 5, 3, 3 and 1 bits)
``ks``                 key channel scaling: each channel weighted by (query / key energy)^1/4,
                       calibrated on pydoc, so the error goes where queries do not look
``vs``                 value channel scaling by (o_proj column energy / value energy)^1/4
``ko32`` / ``vo32``    outlier channels of K / V (chosen by calibration) at +1 bit;
``out32``              both; ``obits=2`` changes the +1
``nc``                 norm correction (MSE methods): store the least-squares scale
``rot=hadamard``       rotation: dense, hadamard, rotor, none (default: by method)
``qjl=orthogonal``     QJL sketch kind (``-prod`` only); ``m=128`` sketch size (m > d allowed)
``law=gaussian``       Lloyd-Max codebook law passed to the quantizer
``tcq`` / ``tcq=12``   keys and values (not the band) coded by a bitshift trellis of 10 (12)
                       state bits instead of the Lloyd-Max code, at the same bits
                       (:mod:`rqlib.core.trellis`); the GPU kernels read it, and encode it
                       with a Viterbi search kernel (``tcq=N`` up to 12 there)
``tb``                 the trellis read tail-biting: its register starts from the end of its
                       own stream, so that no sample is coded from a part of the table (needs
                       ``tcq``; the same bits, two encoder passes)
``nm=6``               norms (and norm-corrected scales) rounded to 6 mantissa bits: 11 bits
                       each (sign-free e5m6) instead of 16
``draw=7``             which draw of the random rotations and sketches (default 0)
``calib=pydoc``        calibration corpus; ``ctok=2048`` its number of tokens
``clen=4096``          calibration chunks of N tokens (default 1024): the positions the
                       calibrated statistics see (a transform of keys after RoPE needs the
                       positions it will code)
``alloc=3.5``          per-layer key and value bits chosen for this model so that the average
                       bits are at most 3.5, where its measured sensitivity says they matter
                       (:mod:`rqlib.study.allocation`; resolved against a model before use).
                       It chooses every layer's bits, so per-layer bits, ``exact=`` and
                       uniform bits other than 3 (``b3`` is accepted) are refused with it
=====================  ===================================================================

Each setting is given once: a repeated or contradictory token (``k3:k4``, ``b3:k4``,
``k0-3=4:k2=5``, ``ctr:ctr``) is refused, as is a number out of range (the error names the
token). After ``preset:NAME`` the tokens override the preset's settings.

Values always use the MSE quantizer of the method's family (``turboquant-mse`` or
``rotorquant-mse``): an inner-product estimator is no use for a weighted sum of values.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from rqlib.base.corpora import CORPORA
from rqlib.core.codebooks import LAWS as CODEBOOK_LAWS
from rqlib.core.quantizers import METHODS as QUANTIZER_METHODS
from rqlib.core.quantizers import SKETCHES as QJL_SKETCHES
from rqlib.core.rotations import KINDS as ROTATIONS
from rqlib.spec.presets import PRESETS

__all__ = [
    "METHODS",
    "ROTATIONS",
    "QJL_SKETCHES",
    "CompressionConfig",
    "ConfigFieldError",
    "SPEC_TOKENS",
    "get_preset",
]

METHODS = tuple(QUANTIZER_METHODS)
MIN_BITS, MAX_BITS = 1, 8
#: The uniform bits a budget (``alloc=``) starts from; the allocation replaces them per layer.
BUDGET_START_BITS = 3
#: The trellis state bits ``tcq`` means; ``tcq=N`` takes N in MAX_BITS + 1 .. 16, more than any
#: code's bits.
TRELLIS_STATE_BITS = 10
#: Upper limits of the counts a spec may give (far above any real model; they stop a typo such
#: as ``sink99999999999`` from overflowing deep inside with an unrelated error).
LIMITS = {
    "layer": 4095,  # a layer index (per-layer bits, exact=): models have at most a few hundred
    "n_sink": 1 << 20,
    "recent_window": 1 << 20,
    "key_outliers": 1024,  # also checked against head_dim when the cache is built
    "value_outliers": 1024,
    "qjl_dim": 1 << 16,
    "draw": (1 << 32) - 1,  # rotations draw from draw * 1e6 + 10 * layer: must fit in 64 bits
    "calibration_tokens": 1 << 24,
    "calibration_chunk": 1 << 20,
}


class ConfigFieldError(ValueError):
    """A field of :class:`CompressionConfig` out of range; ``field`` names it (the spec parser
    names the token that set it)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def _check_bits(name: str, bits: Any, *, allow_none: bool, minimum: int = MIN_BITS, field=None):
    if bits is None and allow_none:
        return
    if isinstance(bits, bool) or not isinstance(bits, int) or not minimum <= bits <= MAX_BITS:
        allowed = f"an int in {minimum}..{MAX_BITS}" + (" or None (full precision)" * allow_none)
        raise ConfigFieldError(field or name, f"{name} must be {allowed}, got {bits!r}")


def _check_count(name: str, value: Any, field: str | None = None, limit: str | None = None):
    maximum = LIMITS.get(limit or name)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < 0
        or (maximum is not None and value > maximum)
    ):
        allowed = "an int >= 0" if maximum is None else f"an int in 0..{maximum}"
        raise ConfigFieldError(field or name, f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class CompressionConfig:
    """How keys and values are compressed; see the module docstring for the spec syntax.

    Everything attention reads is compressed and then decompressed or estimated, in prefill
    too, except what this config keeps exact: the first ``n_sink`` tokens, the
    ``recent_window`` most recent tokens relative to each query (query ``i`` reads keys
    ``i-W+1..i`` exactly, or at ``band_bits`` when that is set) and the layers in
    ``exact_layers``.
    """

    method: str = "turboquant-mse"
    key_bits: int = 3
    value_bits: int | None = None
    layer_key_bits: tuple[tuple[int, int], ...] = ()
    layer_value_bits: tuple[tuple[int, int | None], ...] = ()
    rotation: str | None = None
    qjl_sketch: str = "gaussian"
    qjl_dim: int | None = None
    codebook_law: str = "beta"
    trellis_state_bits: int | None = None
    trellis_tail_biting: bool = False
    norm_mantissa: int | None = None
    center_keys: bool = False
    transform_keys: bool = False
    transform_values: bool = False
    key_group_bits: tuple[tuple[int, tuple[int, ...]], ...] = ()
    value_group_bits: tuple[tuple[int, tuple[int, ...]], ...] = ()
    scale_keys: bool = False
    scale_values: bool = False
    n_sink: int = 0
    recent_window: int = 0
    band_bits: int | None = None
    band_once: bool = False
    exact_layers: tuple[int, ...] = ()
    key_outliers: int = 0
    value_outliers: int = 0
    outlier_extra_bits: int = 1
    norm_correction: bool = False
    draw: int = 0
    calibration_corpus: str = "pydoc"
    calibration_tokens: int = 2048
    calibration_chunk: int = 1024
    budget: float | None = None
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigFieldError(
                "method", f"method must be one of {METHODS}, got {self.method!r}"
            )
        key_minimum = 2 if self.is_prod else MIN_BITS
        _check_bits("key_bits", self.key_bits, allow_none=False, minimum=key_minimum)
        _check_bits("value_bits", self.value_bits, allow_none=True)
        for field_name, is_key in (("layer_key_bits", True), ("layer_value_bits", False)):
            layers = [layer for layer, _ in getattr(self, field_name)]
            if len(set(layers)) != len(layers):
                raise ConfigFieldError(field_name, f"{field_name} lists a layer twice: {layers}")
            for layer, bits in getattr(self, field_name):
                _check_count(f"layer index in {field_name}", layer, field_name, "layer")
                _check_bits(
                    f"{'key' if is_key else 'value'} bits of layer {layer}",
                    bits,
                    allow_none=not is_key,
                    minimum=key_minimum if is_key else MIN_BITS,
                    field=field_name,
                )
        if self.rotation is not None and self.rotation not in ROTATIONS:
            raise ConfigFieldError(
                "rotation", f"rotation must be one of {ROTATIONS} or None, got {self.rotation!r}"
            )
        if self.qjl_sketch not in QJL_SKETCHES:
            raise ConfigFieldError(
                "qjl_sketch", f"qjl_sketch must be one of {QJL_SKETCHES}, got {self.qjl_sketch!r}"
            )
        if self.qjl_dim is not None:
            _check_count("qjl_dim", self.qjl_dim)
            if self.qjl_dim == 0:
                raise ConfigFieldError("qjl_dim", "qjl_dim must be >= 1 (or None for m = d)")
            if not self.is_prod:
                raise ConfigFieldError(
                    "qjl_dim", f"qjl_dim applies to the -prod methods only, not {self.method}"
                )
        if self.codebook_law not in CODEBOOK_LAWS:
            raise ConfigFieldError(
                "codebook_law",
                f"codebook_law must be one of {CODEBOOK_LAWS}, got {self.codebook_law!r}",
            )
        if self.trellis_state_bits is not None:
            _check_count("trellis_state_bits", self.trellis_state_bits)
            if not MAX_BITS < self.trellis_state_bits <= 16:
                raise ConfigFieldError(
                    "trellis_state_bits",
                    f"trellis_state_bits must be in {MAX_BITS + 1}..16 (more than any code's "
                    f"bits), got {self.trellis_state_bits!r}",
                )
        if self.trellis_tail_biting and self.trellis_state_bits is None:
            raise ConfigFieldError(
                "trellis_tail_biting", "a tail-biting trellis (tb) needs the trellis code (tcq)"
            )
        if self.norm_mantissa is not None:
            _check_count("norm_mantissa", self.norm_mantissa)
            if not 1 <= self.norm_mantissa <= 10:
                raise ConfigFieldError(
                    "norm_mantissa", f"norm_mantissa must be in 1..10, got {self.norm_mantissa!r}"
                )
        for name in ("n_sink", "recent_window", "key_outliers", "value_outliers", "draw"):
            _check_count(name, getattr(self, name))
        if self.band_bits is not None:
            _check_bits("band_bits", self.band_bits, allow_none=False)
            if not self.recent_window:
                raise ConfigFieldError(
                    "band_bits", "band_bits (wb=) sets the precision of the recent band: add winN"
                )
        if self.band_once and not self.recent_window:
            raise ConfigFieldError(
                "band_once", "band_once (once) stores the recent band once: add winN"
            )
        _check_count("outlier_extra_bits", self.outlier_extra_bits)
        if not 1 <= self.outlier_extra_bits < MAX_BITS:
            raise ConfigFieldError(
                "outlier_extra_bits",
                f"outlier_extra_bits must be in 1..{MAX_BITS - 1}, got {self.outlier_extra_bits!r}",
            )
        if self.key_outliers:
            _check_bits(
                "key bits of the outlier channels",
                self.max_key_bits + self.outlier_extra_bits,
                allow_none=False,
                field="outlier_extra_bits",
            )
        if self.scale_values and self.value_bits is None and not self.layer_value_bits:
            raise ConfigFieldError(
                "scale_values", "scale_values needs compressed values (value_bits is None)"
            )
        if self.value_outliers:
            if self.value_bits is None and not self.layer_value_bits:
                raise ConfigFieldError(
                    "value_outliers", "value_outliers needs compressed values (value_bits is None)"
                )
            _check_bits(
                "value bits of the outlier channels",
                self.max_value_bits + self.outlier_extra_bits,
                allow_none=False,
                field="outlier_extra_bits",
            )
        if not all(
            isinstance(layer, int) and not isinstance(layer, bool) for layer in self.exact_layers
        ):
            raise ConfigFieldError(
                "exact_layers", f"exact_layers must be ints, got {self.exact_layers!r}"
            )
        if len(set(self.exact_layers)) != len(self.exact_layers):
            raise ConfigFieldError(
                "exact_layers", f"exact_layers lists a layer twice: {list(self.exact_layers)}"
            )
        for layer in self.exact_layers:
            if abs(layer) > LIMITS["layer"]:
                raise ConfigFieldError(
                    "exact_layers",
                    f"exact layer {layer} is out of range (|layer| <= {LIMITS['layer']})",
                )
        if self.norm_correction and self.is_prod:
            raise ConfigFieldError(
                "norm_correction",
                "norm_correction rescales the MSE reconstruction, which would invalidate the QJL "
                "residual of the -prod methods; use it with an -mse method",
            )
        self._check_transforms()
        if self.calibration_corpus not in CORPORA:
            raise ConfigFieldError(
                "calibration_corpus",
                f"calibration_corpus must be one of {CORPORA}, got {self.calibration_corpus!r}",
            )
        if self.calibration_corpus == "wikitext-2":
            raise ConfigFieldError(
                "calibration_corpus", "calibration must not use the evaluation corpus wikitext-2"
            )
        _check_count("calibration_tokens", self.calibration_tokens)
        if self.calibration_tokens < 16:
            raise ConfigFieldError(
                "calibration_tokens",
                f"calibration_tokens must be >= 16, got {self.calibration_tokens!r}",
            )
        _check_count("calibration_chunk", self.calibration_chunk)
        if self.calibration_chunk < 2:
            raise ConfigFieldError(
                "calibration_chunk",
                f"calibration_chunk must be >= 2 tokens, got {self.calibration_chunk!r}",
            )
        if self.budget is not None:
            self._check_budget()

    def _check_transforms(self) -> None:
        """The calibrated transforms (``kxf``, ``vxf``) and their group widths (``kg``, ``vg``)."""
        if self.transform_keys:
            if self.is_prod:
                raise ConfigFieldError(
                    "transform_keys", "kxf is implemented for the -mse methods only"
                )
            if self.scale_keys or self.key_outliers:
                raise ConfigFieldError(
                    "transform_keys",
                    "kxf replaces key channel scaling and outlier channels (ks, ko, out): "
                    "use one or the other",
                )
        if self.transform_values:
            if self.value_bits is None and not self.layer_value_bits:
                raise ConfigFieldError(
                    "transform_values", "vxf needs compressed values (value_bits is None)"
                )
            if self.scale_values or self.value_outliers:
                raise ConfigFieldError(
                    "transform_values",
                    "vxf replaces value channel scaling and outlier channels (vs, vo, out): "
                    "use one or the other",
                )
        for field_name, enabled, which in (
            ("key_group_bits", self.transform_keys, "k"),
            ("value_group_bits", self.transform_values, "v"),
        ):
            table = getattr(self, field_name)
            token = "kxf" if which == "k" else "vxf"
            if table and not enabled:
                raise ConfigFieldError(
                    field_name, f"{which}g= gives the group widths of {token}: add {token}"
                )
            layers = [layer for layer, _ in table]
            if len(set(layers)) != len(layers):
                raise ConfigFieldError(field_name, f"{field_name} lists a layer twice: {layers}")
            if len({len(groups) for _, groups in table}) > 1:
                raise ConfigFieldError(
                    field_name, f"{field_name}: every layer must have the same number of groups"
                )
            for layer, groups in table:
                _check_count(f"layer index in {field_name}", layer, field_name, "layer")
                if not groups or any(
                    isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BITS
                    for b in groups
                ):
                    raise ConfigFieldError(
                        field_name,
                        f"group widths of layer {layer} must be ints in 0..{MAX_BITS}, "
                        f"got {groups!r}",
                    )
                bits = self.key_bits_of(layer) if which == "k" else self.value_bits_of(layer)
                if bits is None or sum(groups) != bits * len(groups):
                    raise ConfigFieldError(
                        field_name,
                        f"the {len(groups)} groups of layer {layer} average "
                        f"{sum(groups) / len(groups):g} bits, not the layer's {bits} bits",
                    )

    def _check_budget(self) -> None:
        """A budget chooses every layer's bits: refuse what it could not honour."""
        budget = self.budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise ConfigFieldError("budget", f"budget must be a number of bits, got {budget!r}")
        if not 0 < budget < 16:  # also refuses nan and inf
            raise ConfigFieldError("budget", f"budget must be in (0, 16) bits, got {budget!r}")
        if self.is_prod:
            raise ConfigFieldError(
                "budget", "alloc= (a bit budget) is implemented for the -mse methods only"
            )
        if self.transform_keys or self.transform_values:
            raise ConfigFieldError(
                "budget",
                "alloc= cannot count the parts a calibrated transform (kxf, vxf) stores, which "
                "its calibration decides: give the bits per layer instead",
            )
        if self.value_bits is None:
            raise ConfigFieldError(
                "value_bits", "alloc= allocates key and value bits: compress values too (not v=fp)"
            )
        for field_name in ("layer_key_bits", "layer_value_bits", "exact_layers"):
            if getattr(self, field_name):
                raise ConfigFieldError(
                    field_name,
                    "alloc= chooses every layer's bits, so it cannot honour per-layer bits or "
                    "exact layers given with it; drop one or the other",
                )
        for field_name in ("key_bits", "value_bits"):
            if getattr(self, field_name) != BUDGET_START_BITS:
                raise ConfigFieldError(
                    field_name,
                    f"alloc= chooses every layer's bits, so uniform {field_name} "
                    f"{getattr(self, field_name)} would be ignored; drop it",
                )

    # ---- derived properties ------------------------------------------------------------------
    @property
    def is_prod(self) -> bool:
        """Whether keys use an inner-product (MSE + QJL) quantizer."""
        return self.method.endswith("-prod")

    @property
    def value_method(self) -> str:
        """The MSE method of the same family, used for values."""
        return self.method.rsplit("-", 1)[0] + "-mse"

    @property
    def needs_calibration(self) -> bool:
        """Whether :func:`rqlib.hf.compress` must run the calibration corpus first."""
        return (
            self.center_keys
            or self.transform_keys
            or self.transform_values
            or self.scale_keys
            or self.scale_values
            or self.key_outliers > 0
            or self.value_outliers > 0
        )

    @property
    def max_key_bits(self) -> int:
        return max([self.key_bits] + [bits for _, bits in self.layer_key_bits])

    @property
    def max_value_bits(self) -> int:
        bits = [self.value_bits] + [b for _, b in self.layer_value_bits]
        return max(b for b in bits if b is not None)

    def key_bits_of(self, layer: int) -> int:
        """Key bits of ``layer`` (the per-layer override if any)."""
        return dict(self.layer_key_bits).get(layer, self.key_bits)

    def value_bits_of(self, layer: int) -> int | None:
        """Value bits of ``layer``, ``None`` for full-precision values."""
        return dict(self.layer_value_bits).get(layer, self.value_bits)

    def exact_layer_set(self, n_layers: int) -> frozenset[int]:
        """``exact_layers`` resolved against a model with ``n_layers`` layers."""
        resolved = set()
        for layer in self.exact_layers:
            index = layer + n_layers if layer < 0 else layer
            if not 0 <= index < n_layers:
                raise ValueError(f"exact layer {layer} is out of range for {n_layers} layers")
            resolved.add(index)
        for layer, _ in self.layer_key_bits + self.layer_value_bits:
            if layer >= n_layers:
                raise ValueError(f"per-layer bits for layer {layer}, but the model has {n_layers}")
        return frozenset(resolved)

    @property
    def label(self) -> str:
        """The name given at parse time, else the canonical spec."""
        return self.name or self.spec()

    # ---- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists); :meth:`from_dict` inverts it."""
        out = dataclasses.asdict(self)

        def listed(value):
            return [listed(item) for item in value] if isinstance(value, (tuple, list)) else value

        for key, value in out.items():
            if isinstance(value, (tuple, list)):
                out[key] = listed(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompressionConfig:
        """Build a config from :meth:`to_dict` output; unknown keys raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown CompressionConfig fields {sorted(unknown)}; known {sorted(known)}"
            )
        kwargs = dict(data)
        for key in ("layer_key_bits", "layer_value_bits"):
            if key in kwargs:
                kwargs[key] = tuple(tuple(item) for item in kwargs[key])
        for key in ("key_group_bits", "value_group_bits"):
            if key in kwargs:
                kwargs[key] = tuple((layer, tuple(groups)) for layer, groups in kwargs[key])
        if "exact_layers" in kwargs:
            kwargs["exact_layers"] = tuple(kwargs["exact_layers"])
        return cls(**kwargs)

    def replace(self, **changes: Any) -> CompressionConfig:
        """A copy with ``changes`` applied (validated again).

        The copy keeps this config's ``name`` only if the changes leave every field equal (or
        pass a new ``name``): a changed config never carries the label of the spec it came from.
        """
        if "name" not in changes:
            changed = dataclasses.replace(self, **changes)
            return changed if changed == self else dataclasses.replace(changed, name=None)
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> CompressionConfig:
        """The named config of :mod:`rqlib.spec.presets` (``ValueError`` for an unknown name)."""
        return get_preset(name)

    # ---- the compact spec ------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str) -> CompressionConfig:
        """Parse ``METHOD[:TOKEN]...`` (see the module docstring); ``ValueError`` otherwise."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"a compression spec must be a non-empty string, got {spec!r}")
        parts = [part.strip() for part in spec.strip().split(":")]
        if parts[0] == "preset":
            if len(parts) < 2:
                raise ValueError("'preset' needs a name: preset:NAME[:TOKEN]...")
            base = cls.preset(parts[1])
            tokens = parts[2:]
        else:
            if parts[0] not in METHODS:
                raise ValueError(
                    f"unknown method {parts[0]!r} in spec {spec!r}; known: {METHODS} or preset:NAME"
                )
            base = None
            tokens = parts[1:]
        tokens_read = _Tokens(spec, base)
        for token in tokens:
            tokens_read.apply(token)
        changes = tokens_read.changes
        if base is None:
            changes["method"] = parts[0]
            if "budget" in changes and "value_bits" not in changes:
                changes["value_bits"] = BUDGET_START_BITS  # a budget compresses values
        changes["layer_key_bits"] = tuple(sorted(tokens_read.layer_keys.items()))
        changes["layer_value_bits"] = tuple(sorted(tokens_read.layer_values.items()))
        changes["key_group_bits"] = tuple(sorted(tokens_read.groups["k"].items()))
        changes["value_group_bits"] = tuple(sorted(tokens_read.groups["v"].items()))
        changes["name"] = spec.strip()
        try:
            config = base.replace(**changes) if base is not None else cls(**changes)
        except ConfigFieldError as error:
            raise tokens_read.named(error) from None
        if tokens_read.origin.get("band_once") == "twice" and not config.recent_window:
            raise ValueError(f"token 'twice' in spec {spec!r}: a band stored twice needs winN")
        return config

    def spec(self) -> str:
        """The canonical compact spec of this config (parses back to an equal config)."""
        default = CompressionConfig(method=self.method)
        tokens = [self.method, f"k{self.key_bits}"]
        tokens.append("v=fp" if self.value_bits is None else f"v{self.value_bits}")
        for layer, bits in self.layer_key_bits:
            tokens.append(f"k{layer}={bits}")
        for layer, bits in self.layer_value_bits:
            tokens.append(f"v{layer}={'fp' if bits is None else bits}")
        if self.n_sink:
            tokens.append(f"sink{self.n_sink}")
        if self.recent_window:
            tokens.append(f"win{self.recent_window}")
        if self.band_bits is not None:
            tokens.append(f"wb={self.band_bits}")
        if self.band_once:
            tokens.append("once")
        if self.exact_layers:
            tokens.append("exact=" + ",".join(str(layer) for layer in self.exact_layers))
        if self.center_keys:
            tokens.append("ctr")
        if self.transform_keys:
            tokens.append("kxf")
        if self.transform_values:
            tokens.append("vxf")
        tokens += _group_tokens("k", self.key_group_bits)
        tokens += _group_tokens("v", self.value_group_bits)
        if self.scale_keys:
            tokens.append("ks")
        if self.scale_values:
            tokens.append("vs")
        if self.key_outliers:
            tokens.append(f"ko{self.key_outliers}")
        if self.value_outliers:
            tokens.append(f"vo{self.value_outliers}")
        if self.outlier_extra_bits != default.outlier_extra_bits:
            tokens.append(f"obits={self.outlier_extra_bits}")
        if self.norm_correction:
            tokens.append("nc")
        if self.rotation is not None:
            tokens.append(f"rot={self.rotation}")
        if self.qjl_sketch != default.qjl_sketch:
            tokens.append(f"qjl={self.qjl_sketch}")
        if self.qjl_dim is not None:
            tokens.append(f"m={self.qjl_dim}")
        if self.codebook_law != default.codebook_law:
            tokens.append(f"law={self.codebook_law}")
        if self.trellis_state_bits is not None:
            state = self.trellis_state_bits
            tokens.append("tcq" if state == TRELLIS_STATE_BITS else f"tcq={state}")
        if self.trellis_tail_biting:
            tokens.append("tb")
        if self.norm_mantissa is not None:
            tokens.append(f"nm={self.norm_mantissa}")
        if self.draw != default.draw:
            tokens.append(f"draw={self.draw}")
        if self.calibration_corpus != default.calibration_corpus:
            tokens.append(f"calib={self.calibration_corpus}")
        if self.calibration_tokens != default.calibration_tokens:
            tokens.append(f"ctok={self.calibration_tokens}")
        if self.calibration_chunk != default.calibration_chunk:
            tokens.append(f"clen={self.calibration_chunk}")
        if self.budget is not None:
            tokens.append(f"alloc={self.budget:g}")
        return ":".join(tokens)


def _group_tokens(which: str, table) -> list[str]:
    """``kg0-2=5331``-style tokens for a group-width table, runs of equal layers as ranges."""
    tokens: list[str] = []
    runs: list[list] = []  # [first, last, groups]
    for layer, groups in table:
        if runs and runs[-1][1] == layer - 1 and runs[-1][2] == groups:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, groups])
    for first, last, groups in runs:
        layers = str(first) if first == last else f"{first}-{last}"
        tokens.append(f"{which}g{layers}=" + "".join(str(b) for b in groups))
    return tokens


_SHORT = re.compile(r"^(k|v|b|sink|win|ko|vo|out)(\d+)$")
_LAYER_BITS = re.compile(r"^([kv])(\d+)(?:-(\d+))?=(\d+|fp)$")
_GROUP_BITS = re.compile(r"^([kv])g(\d+)(?:-(\d+))?=(\d+)$")
_FLAGS = {
    "ctr": ("center_keys", True),
    "ks": ("scale_keys", True),
    "vs": ("scale_values", True),
    "nc": ("norm_correction", True),
    "tcq": ("trellis_state_bits", TRELLIS_STATE_BITS),
    "tb": ("trellis_tail_biting", True),
    "kxf": ("transform_keys", True),
    "vxf": ("transform_values", True),
    "once": ("band_once", True),
    "twice": ("band_once", False),
}
_KEYED = {
    "k": "key_bits",
    "v": "value_bits",
    "sink": "n_sink",
    "win": "recent_window",
    "wb": "band_bits",
    "ko": "key_outliers",
    "vo": "value_outliers",
    "obits": "outlier_extra_bits",
    "rot": "rotation",
    "qjl": "qjl_sketch",
    "m": "qjl_dim",
    "law": "codebook_law",
    "tcq": "trellis_state_bits",
    "nm": "norm_mantissa",
    "draw": "draw",
    "calib": "calibration_corpus",
    "ctok": "calibration_tokens",
    "clen": "calibration_chunk",
}
_INT_FIELDS = {
    "key_bits",
    "trellis_state_bits",
    "norm_mantissa",
    "n_sink",
    "recent_window",
    "band_bits",
    "key_outliers",
    "value_outliers",
    "outlier_extra_bits",
    "qjl_dim",
    "draw",
    "calibration_tokens",
    "calibration_chunk",
}

#: The spec language, one entry per token the parser above knows: its name as parsed -> (the
#: forms it takes, what it does). ``python -m rqlib eval --help`` and the book's legend print
#: this table; a test checks that every token the parser reads has its entry.
SPEC_TOKENS: dict[str, tuple[str, str]] = {
    "k": ("k3 | k=3", "key bits (1..8; the -prod methods need >= 2); default 3"),
    "v": ("v4 | v=4 | v=fp", "value bits; fp (the default) keeps the values in full precision"),
    "b": ("b3", "key and value bits at once"),
    "layer bits": (
        "k0-1=4 | v29=5 | v3=fp",
        "the bits of one layer or of an inclusive range of layers (values may be fp)",
    ),
    "exact": ("exact=0,-1", "layers kept exact (negative: counted from the end)"),
    "sink": ("sink1", "the first N tokens kept exact (attention sinks)"),
    "win": ("win32", "the W most recent tokens of each query kept exact (the recent band)"),
    "wb": ("wb=8", "the recent band stored as 8-bit codes instead of exact copies"),
    "once": (
        "once",
        "the recent band stored once: a token's main codes are written when it leaves the band, "
        "from the band's copy (the W newest tokens cost the band's bits only)",
    ),
    "twice": (
        "twice",
        "the recent band stored twice: a token's main codes are written when it arrives and "
        "kept while it is in the band too (the default; after a preset, undoes its once)",
    ),
    "ctr": ("ctr", "per-head key centering, its mean calibrated on pydoc (never the eval text)"),
    "kxf": (
        "kxf",
        "keys through a calibrated transform (query-weighted eigenvectors, centred), groups of "
        "16 components at water-filled widths (torch path; refused on CUDA)",
    ),
    "vxf": (
        "vxf",
        "values through a calibrated transform (o_proj-weighted eigenvectors, centred), groups "
        "of 16 components at water-filled widths (torch path; refused on CUDA)",
    ),
    "group bits": (
        "kg3=5331 | vg0-29=4431",
        "the widths of the groups of kxf / vxf for a layer or range (set by resolving against "
        "the model; each layer's groups average its bits)",
    ),
    "ks": ("ks", "key channels scaled by calibrated query / key energies"),
    "vs": ("vs", "value channels scaled by calibrated o_proj energies"),
    "ko": ("ko32", "32 calibrated key outlier channels stored with more bits"),
    "vo": ("vo32", "32 calibrated value outlier channels stored with more bits"),
    "out": ("out32", "key and value outlier channels at once"),
    "obits": ("obits=2", "the extra bits of the outlier channels (default 1)"),
    "nc": ("nc", "norm correction: a least-squares scale undoes the shrinkage (-mse methods)"),
    "nm": ("nm=6", "norms rounded to 6 mantissa bits (11 bits each instead of 16)"),
    "alloc": (
        "alloc=3.5",
        "a budget: per-layer K and V bits chosen from measured sensitivity so that the average "
        "stored bits are at most 3.5 (the presets use it)",
    ),
    "rot": ("rot=dense|hadamard|rotor|none", "the random rotation applied before quantizing"),
    "qjl": ("qjl=gaussian|orthogonal", "the QJL sketch S of the -prod methods"),
    "m": ("m=128", "rows of the QJL sketch (default: the head dimension d)"),
    "law": ("law=beta|gaussian", "the coordinate law the Lloyd-Max codebook is fitted to"),
    "tcq": (
        "tcq | tcq=12",
        "keys and values coded by a bitshift trellis of 10 (12) state bits instead of the "
        "Lloyd-Max code, same bits (the GPU kernels read and encode it, up to tcq=12)",
    ),
    "tb": (
        "tb",
        "the trellis read tail-biting: its register starts from its stream's end, so every "
        "sample sees the whole table (needs tcq; same bits, two encoder passes)",
    ),
    "draw": ("draw=0", "which draw of the random rotations and sketches (an integer, default 0)"),
    "calib": ("calib=pydoc", "the corpus calibrations are measured on"),
    "ctok": ("ctok=2048", "the number of calibration tokens"),
    "clen": (
        "clen=4096",
        "calibration chunks of this many tokens (default 1024): the positions calibrated "
        "statistics see",
    ),
}


def _int(token: str, text: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"token {token!r} in spec {spec!r} needs an integer, got {text!r}"
        ) from None


class _Tokens:
    """The tokens of one spec read into field changes, each field set by one token only.

    ``origin`` remembers which token set which field, so that a value out of range is reported
    with the token that gave it, and a field set twice (``k3:k4``, ``b3:k4``, ``ctr:ctr``,
    overlapping layer ranges) is refused instead of silently taking the last value.
    """

    def __init__(self, spec: str, base: CompressionConfig | None) -> None:
        self.spec = spec
        self.changes: dict[str, Any] = {}
        self.layer_keys = dict(base.layer_key_bits) if base else {}
        self.layer_values = dict(base.layer_value_bits) if base else {}
        self.groups: dict[str, dict[int, tuple[int, ...]]] = {
            "k": dict(base.key_group_bits) if base else {},
            "v": dict(base.value_group_bits) if base else {},
        }
        self.origin: dict[str, str] = {}
        self.layer_origin: dict[tuple[str, int], str] = {}

    def _error(self, token: str, message: str) -> ValueError:
        return ValueError(f"token {token!r} in spec {self.spec!r}: {message}")

    def named(self, error: ConfigFieldError) -> ConfigFieldError:
        """``error`` with the token that set its field (or the whole spec) in front."""
        token = self.origin.get(error.field)
        if token is None and error.field in ("layer_key_bits", "layer_value_bits"):
            which = "k" if error.field == "layer_key_bits" else "v"
            tokens = sorted({t for (w, _), t in self.layer_origin.items() if w == which})
            token = ", ".join(tokens) if tokens else None
        where = f"token {token!r} in spec" if token else "spec"
        return ConfigFieldError(error.field, f"{where} {self.spec!r}: {error}")

    def set(self, token: str, field_name: str, value: Any) -> None:
        if field_name in self.origin:
            raise self._error(
                token,
                f"sets {field_name} again (already set by {self.origin[field_name]!r}); "
                "give each setting once",
            )
        self.origin[field_name] = token
        self.changes[field_name] = value

    def set_layers(self, token: str, which: str, first: int, last: int, bits: int | None):
        if last < first:
            raise self._error(token, "empty layer range")
        if last > LIMITS["layer"]:
            raise self._error(token, f"layer {last} is out of range (at most {LIMITS['layer']})")
        table = self.layer_keys if which == "k" else self.layer_values
        for layer in range(first, last + 1):
            previous = self.layer_origin.get((which, layer))
            if previous is not None:
                kind = "key" if which == "k" else "value"
                raise self._error(
                    token,
                    f"sets the {kind} bits of layer {layer} again (already set by {previous!r})",
                )
            self.layer_origin[(which, layer)] = token
            table[layer] = bits

    def apply(self, token: str) -> None:
        """Fold one token into the changes (or the per-layer bit tables)."""
        spec = self.spec
        if not token:
            raise ValueError(f"spec {spec!r} has an empty token (two ':' in a row, or a last ':')")
        if token in _FLAGS:
            self.set(token, *_FLAGS[token])
            return
        match = _SHORT.match(token)
        if match:
            name, number = match.group(1), int(match.group(2))
            if name == "b":
                self.set(token, "key_bits", number)
                self.set(token, "value_bits", number)
            elif name == "out":
                self.set(token, "key_outliers", number)
                self.set(token, "value_outliers", number)
            else:
                self.set(token, _KEYED[name], number)
            return
        match = _GROUP_BITS.match(token)
        if match:
            which, first, last, digits = match.groups()
            last = last if last is not None else first
            if int(last) < int(first):
                raise self._error(token, "empty layer range")
            if int(last) > LIMITS["layer"]:
                raise self._error(token, f"layer {last} is out of range")
            for layer in range(int(first), int(last) + 1):
                if (which + "g", layer) in self.layer_origin:
                    raise self._error(token, f"sets the groups of layer {layer} again")
                self.layer_origin[(which + "g", layer)] = token
                self.groups[which][layer] = tuple(int(d) for d in digits)
            self.origin.setdefault(f"{'key' if which == 'k' else 'value'}_group_bits", token)
            return
        match = _LAYER_BITS.match(token)
        if match:
            which, first, last, bits_text = match.groups()
            last = last if last is not None else first
            bits = None if bits_text == "fp" else int(bits_text)
            if which == "k" and bits is None:
                raise self._error(token, "keys cannot be 'fp' (use exact=)")
            self.set_layers(token, which, int(first), int(last), bits)
            return
        if "=" in token:
            name, text = token.split("=", 1)
            if name == "exact":
                items = [] if text == "none" else text.split(",")
                layers = tuple(_int(token, item, spec) for item in items)
                self.set(token, "exact_layers", layers)
                return
            if name == "v" and text == "fp":
                self.set(token, "value_bits", None)
                return
            if name == "alloc":
                try:
                    budget = float(text)
                except ValueError:
                    raise self._error(token, f"needs a number of bits, got {text!r}") from None
                self.set(token, "budget", budget)
                return
            if name in _KEYED:
                key = _KEYED[name]
                value = _int(token, text, spec) if key in _INT_FIELDS | {"value_bits"} else text
                self.set(token, key, value)
                return
        raise ValueError(
            f"unknown token {token!r} in spec {spec!r}; "
            "see `python -m rqlib eval --help` for the syntax"
        )


def get_preset(name: str) -> CompressionConfig:
    """The config of preset ``name`` (:data:`rqlib.spec.presets.PRESETS`); ``ValueError``
    listing the known names otherwise."""
    if name not in PRESETS:
        known = ", ".join(sorted(PRESETS)) or "none defined yet"
        raise ValueError(f"unknown preset {name!r}; known presets: {known}")
    spec = PRESETS[name]
    if spec.startswith("preset:"):
        raise ValueError(f"preset {name!r} must be a method spec, not another preset")
    return CompressionConfig.parse(spec).replace(name=f"preset:{name}")
