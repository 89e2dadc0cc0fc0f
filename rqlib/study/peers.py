"""Peers: the quantized caches a transformers user would pick instead, as evaluation methods.

A peer is named like a method (``rqlib eval --method hf-quanto:int4``):

  hf-quanto:int4 | hf-quanto:int2      transformers ``QuantizedCache(backend="quanto")``
  hf-hqq:int2 | hf-hqq:int3 | hf-hqq:int4   ``QuantizedCache(backend="hqq")``
  hf-fp8                               ``QuantizedCache(backend="fp8")``
  hf-dynamic                           ``DynamicCache``: exact, the control of the decode harness
  optional tokens  group=N  res=N      group size and residual length (defaults 64 and 128,
                                       what a user gets; the label omits them at the defaults)

What the group-wise backends (quanto, HQQ) store, KIVI-style: every token's keys and values as
integer codes in groups of ``group`` coordinates (min-max per group for quanto, HQQ's
half-quadratic fit for HQQ), with a scale and a zero point per group; the latest tokens in a
residual of at most ``res - 1`` exact tokens; when the residual fills, everything is dequantized
and quantized again. Their ``update`` returns the chunk it is given *exact*: one forward over a
window (prefill) sees no quantization error at all, so these caches must be compared in decode
mode (:mod:`rqlib.study.eval`). The fp8 backend stores 8-bit floats with one scale per layer
and tensor, fixed by the first chunk; it returns the first chunk exact.

Bit accounting (:meth:`Peer.bits`), per key or value coordinate, in the units of
:mod:`rqlib.spec.bits`:

- codes at their stored width (HQQ packs ten 3-bit codes into 32 bits, and a group of 64 into
  seven such words: 3.5 bits);
- a scale and a zero point per group at 16 bits each, as a deployed fp16 cache stores them;
- the exact residual at 16 bits: it holds between 0 and ``res - 1`` tokens, counted at its
  mean ``(res - 1) / 2`` (at a context shorter than ``res``, fed token by token from an empty
  cache, every token but the first is exact: ``context - 1``), amortized over ``context``;
- fp8: 8 bits, plus one 32-bit scale per layer and tensor amortized over the context.

quanto packs codes along the groups, so a tensor with an odd number of groups pads half a row
of bytes; :func:`stored_bits` counts that padding, :meth:`Peer.bits` (amortized) does not.

``QuantizedCache`` refuses models with sliding-window layers (Gemma 3). For them the same
quantized layer is built for every layer with ``Cache(layers=...)``: every layer keeps every
token and the mask applies the window, as the cache of :mod:`rqlib.hf` does
(:meth:`Peer.note` says so, and the evaluation records it).

optimum-quanto compiles a small C++ extension on first use on CPU (``ninja`` and a C++
compiler; a few minutes once), guarded by a lock file that torch waits on without a time limit;
a process stopped while building leaves the file behind, and every later run would wait
forever, so a lock older than :data:`STALE_BUILD_LOCK_SECONDS` is an error naming the file.
HQQ ships as an sdist (``hqq``, installed with ``--no-deps``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from rqlib.spec.bits import EXACT_BITS
from rqlib.spec.geometry import model_geometry

__all__ = ["PEER_NAMES", "Peer", "is_peer", "stored_bits"]

PREFIX = "hf-"
#: backend -> the bit widths a user can ask for (None: no bit width)
BACKENDS = {"quanto": (2, 4), "hqq": (2, 3, 4), "fp8": None, "dynamic": None}
DEFAULT_GROUP = 64  # transformers' QuantizedLayer defaults
DEFAULT_RESIDUAL = 128
META_BITS = 16  # a scale or a zero point, as a deployed fp16 cache stores it
FP8_SCALE_BITS = 32  # transformers keeps the fp8 scale in float32
PEER_NAMES = (
    "hf-quanto:int4",
    "hf-quanto:int2",
    "hf-hqq:int4",
    "hf-hqq:int3",
    "hf-hqq:int2",
    "hf-fp8",
    "hf-dynamic",
)


def is_peer(spec: str) -> bool:
    """Whether ``spec`` names a peer (``hf-...``) rather than a compression config."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def _positive_int(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{spec}: {what} must be a positive integer, got {text!r}")
    return value


@dataclass(frozen=True)
class Peer:
    """One peer cache: ``backend`` (``quanto``, ``hqq``, ``fp8``, ``dynamic``), its bits,
    group size and residual length."""

    backend: str
    nbits: int | None = None
    group_size: int = DEFAULT_GROUP
    residual_length: int = DEFAULT_RESIDUAL

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown peer backend {self.backend!r}; known: {list(BACKENDS)}")
        widths = BACKENDS[self.backend]
        if widths is None and self.nbits is not None:
            raise ValueError(f"hf-{self.backend} takes no bit width, got int{self.nbits}")
        if widths is not None and self.nbits not in widths:
            raise ValueError(
                f"hf-{self.backend} needs a bit width among "
                f"{', '.join(f'int{b}' for b in widths)}, got {self.nbits!r}"
            )
        if not self.group_wise and (
            self.group_size != DEFAULT_GROUP or self.residual_length != DEFAULT_RESIDUAL
        ):
            raise ValueError(f"hf-{self.backend} has no group size or residual length")
        for name in ("group_size", "residual_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    # ---- names -----------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str) -> Peer:
        """The peer named ``spec`` (see the module docstring for the names)."""
        if not is_peer(spec):
            raise ValueError(f"{spec!r} is not a peer name (they start with {PREFIX!r})")
        backend, *tokens = spec[len(PREFIX) :].split(":")
        if backend not in BACKENDS:
            raise ValueError(
                f"{spec}: unknown peer {PREFIX}{backend!r}; known: {', '.join(PEER_NAMES)}"
            )
        kwargs: dict = {}
        for token in tokens:
            if token.startswith("int") and token[3:].isdigit() and "nbits" not in kwargs:
                kwargs["nbits"] = int(token[3:])
            elif token.startswith("group=") and "group_size" not in kwargs:
                kwargs["group_size"] = _positive_int(token[6:], "group", spec)
            elif token.startswith("res=") and "residual_length" not in kwargs:
                kwargs["residual_length"] = _positive_int(token[4:], "res", spec)
            else:
                raise ValueError(
                    f"{spec}: unknown or repeated token {token!r} (intN, group=N, res=N)"
                )
        try:
            return cls(backend, **kwargs)
        except ValueError as error:
            raise ValueError(f"{spec}: {error}") from None

    @property
    def label(self) -> str:
        """The canonical name (defaults omitted): ``parse(label)`` gives this peer back."""
        parts = [f"{PREFIX}{self.backend}"]
        if self.nbits is not None:
            parts.append(f"int{self.nbits}")
        if self.group_size != DEFAULT_GROUP:
            parts.append(f"group={self.group_size}")
        if self.residual_length != DEFAULT_RESIDUAL:
            parts.append(f"res={self.residual_length}")
        return ":".join(parts)

    def to_dict(self) -> dict:
        """What the evaluation records as this method's config."""
        return {
            "peer": self.label,
            "backend": self.backend,
            "nbits": self.nbits,
            "q_group_size": self.group_size if self.group_wise else None,
            "residual_length": self.residual_length if self.group_wise else None,
        }

    @property
    def group_wise(self) -> bool:
        """Integer codes per group with an exact residual (quanto, HQQ)."""
        return self.backend in ("quanto", "hqq")

    @property
    def chunk_invariant(self) -> bool:
        """Whether feeding a window in chunks gives what feeding it token by token gives.

        False for every quantizing peer: they return the chunk they are given exact (fp8: the
        first one), so larger chunks see more exact tokens.
        """
        return self.backend == "dynamic"

    # ---- bits ------------------------------------------------------------------------------
    def code_bits(self) -> float:
        """Stored bits per coordinate of the codes alone (quantizing backends)."""
        if self.backend == "fp8":
            return 8.0
        if self.backend == "hqq" and self.nbits == 3:  # ten 3-bit codes per 32-bit word
            return 32 * math.ceil(self.group_size / 10) / self.group_size
        if self.backend == "hqq":  # 8 // nbits codes per byte, along the group
            per_byte = 8 // self.nbits
            return 8 * math.ceil(self.group_size / per_byte) / self.group_size
        if self.backend == "quanto":
            return float(self.nbits)
        raise ValueError(f"{self.label} stores no codes")

    def bits_of_state(self, model_config, quantized: float, exact: float) -> float:
        """Bits per key (or value) coordinate of a cache holding ``quantized`` quantized and
        ``exact`` exact tokens (no padding; fp8: ``exact`` must be 0)."""
        if quantized < 0 or exact < 0 or quantized + exact <= 0:
            raise ValueError(f"need a non-empty state, got {quantized} + {exact} tokens")
        if self.backend == "dynamic":
            return float(EXACT_BITS)
        tokens = quantized + exact
        if self.backend == "fp8":
            if exact:
                raise ValueError("hf-fp8 keeps no exact tokens")
            geometry = model_geometry(model_config)
            return self.code_bits() + FP8_SCALE_BITS / (
                tokens * geometry.kv_heads * geometry.head_dim
            )
        per_quantized = self.code_bits() + 2 * META_BITS / self.group_size
        return (quantized * per_quantized + exact * EXACT_BITS) / tokens

    def exact_tokens(self, context: int) -> float:
        """Exact residual tokens counted at ``context`` (see the module docstring)."""
        if not self.group_wise:
            return 0.0
        if context <= self.residual_length:
            return float(context - 1)
        return (self.residual_length - 1) / 2

    def bits(self, model_config, context: int = 4096) -> dict:
        """Average stored bits per key coordinate, per value coordinate and their mean, at
        ``context`` tokens; the same keys as :func:`rqlib.spec.bits.average_bits`, plus
        ``exact_tokens`` (the residual counted)."""
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context must be an int >= 1, got {context!r}")
        exact = self.exact_tokens(context)
        per_coordinate = self.bits_of_state(model_config, context - exact, exact)
        return {
            "key": per_coordinate,
            "value": per_coordinate,
            "mean": per_coordinate,
            "context": context,
            "exact_tokens": exact,
        }

    def bytes_per_token(self, model_config, context: int = 4096) -> float:
        """Cache bytes per token (all layers, K and V) implied by :meth:`bits`."""
        geometry = model_geometry(model_config)
        bits = self.bits(model_config, context)
        return (
            (bits["key"] + bits["value"])
            * geometry.layers
            * geometry.kv_heads
            * geometry.head_dim
            / 8
        )

    # ---- the cache -------------------------------------------------------------------------
    def check_available(self) -> None:
        """``ModuleNotFoundError`` saying what to install when the backend's package is
        missing; ``RuntimeError`` when a stale build lock would make it wait forever."""
        _check_backend(self)

    def note(self, model_config) -> str | None:
        """What differs from ``QuantizedCache`` for this model, if anything."""
        if self.group_wise or self.backend == "fp8":
            if not _all_full_attention(model_config):
                return (
                    "transformers' QuantizedCache refuses models with sliding-window layers; "
                    "the same quantized layer is used in every layer (every layer keeps every "
                    "token, the mask applies the window)"
                )
        return None

    def make_cache(self, model):
        """A fresh, empty cache of this peer for ``model`` (pass it as ``cache=``)."""
        from transformers.cache_utils import Cache, DynamicCache, QuantizedCache

        config = getattr(model, "config", model)
        if self.backend == "dynamic":
            return DynamicCache()  # every layer keeps every token; exact
        self.check_available()
        geometry = model_geometry(config)
        if self.group_wise and geometry.head_dim % self.group_size:
            raise ValueError(
                f"{self.label}: head_dim {geometry.head_dim} is not a multiple of the group size "
                f"{self.group_size} (a group is {self.group_size} coordinates of one token's head "
                "vector); choose group=N dividing the head dimension"
            )
        kwargs = {}
        if self.group_wise:
            kwargs = dict(
                nbits=self.nbits,
                q_group_size=self.group_size,
                residual_length=self.residual_length,
            )
        if _all_full_attention(config):
            return QuantizedCache(backend=self.backend, config=config, **kwargs)
        from transformers.cache_utils import (
            Fp8QuantizedLayer,
            HQQQuantizedLayer,
            QuantoQuantizedLayer,
        )

        layer = {"quanto": QuantoQuantizedLayer, "hqq": HQQQuantizedLayer}.get(
            self.backend, Fp8QuantizedLayer
        )
        return Cache(layers=[layer(**kwargs) for _ in range(geometry.layers)])


def _all_full_attention(model_config) -> bool:
    config = getattr(model_config, "config", model_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None)
    return types is None or set(types) <= {"full_attention"}


def _check_backend(peer: Peer) -> None:
    import importlib.util

    package, install = {
        "quanto": ("optimum.quanto", "pip install --no-deps optimum-quanto==0.2.7 ninja"),
        "hqq": ("hqq", "pip install --no-deps hqq==0.2.8.post1 termcolor einops"),
    }.get(peer.backend, (None, None))
    if package is None:
        return
    try:
        found = importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ModuleNotFoundError(
            f"{peer.label} needs the {package.split('.')[-1]} package, which is not installed: "
            f"{install} (the 'peers' group of pyproject.toml)"
        )
    if peer.backend == "quanto":
        check_build_lock(_quanto_build_lock())


#: A build of quanto's extension takes minutes; a lock file older than this was left behind.
STALE_BUILD_LOCK_SECONDS = 15 * 60


def _quanto_build_lock() -> Path:
    import importlib.util

    (root,) = importlib.util.find_spec("optimum.quanto").submodule_search_locations
    return Path(root) / "library" / "extensions" / "cpp" / "build" / "lock"


def check_build_lock(lock: Path, now: float | None = None) -> None:
    """Raise if the build lock ``lock`` of a C++ extension is older than
    :data:`STALE_BUILD_LOCK_SECONDS` (torch would wait on it forever)."""
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_BUILD_LOCK_SECONDS:
        raise RuntimeError(
            f"{lock} is {age / 60:.0f} minutes old: a build of optimum-quanto's C++ extension "
            "stopped without removing its lock, and torch would wait for it forever. If no "
            "other process is building it now, delete that file and run again"
        )


# ---- what a live cache stores --------------------------------------------------------------
def _quantized_bits(peer: Peer, stored) -> int:
    """Bits of one quantized tensor as the backend stores it (codes with their padding; scales
    and zero points at :data:`META_BITS`)."""
    if peer.backend == "quanto":  # a WeightQBitsTensor: packed uint8 codes, scale, shift
        codes = stored._data._data
        return (
            codes.numel() * codes.element_size() * 8
            + (stored._scale.numel() + stored._shift.numel()) * META_BITS
        )
    if peer.backend == "hqq":  # (packed codes, meta with a scale and a zero per group)
        codes, meta = stored
        return (
            codes.numel() * codes.element_size() * 8
            + (meta["scale"].numel() + meta["zero"].numel()) * META_BITS
        )
    if peer.backend == "fp8":  # (fp8 codes, one float32 scale)
        codes, scale = stored
        return codes.numel() * 8 + scale.numel() * FP8_SCALE_BITS
    raise ValueError(f"{peer.label} stores nothing quantized")


def stored_bits(peer: Peer, cache, model_config) -> dict:
    """Bits per key and per value coordinate that a one-sequence ``cache`` (made by
    ``peer.make_cache``) holds now, counted from its tensors: codes as packed (with padding),
    scales and zero points at 16 bits, exact tokens at 16 bits (whatever dtype they are kept in
    here)."""
    geometry = model_geometry(model_config)
    key_bits = value_bits = coordinates = 0
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            raise ValueError("the cache is empty: stored_bits needs at least one token")
        exact_keys, exact_values = layer.keys, layer.values
        if exact_keys.dim() == 4 and exact_keys.shape[0] != 1:
            raise ValueError(
                f"stored_bits counts one-sequence caches, got batch {exact_keys.shape[0]}"
            )
        if peer.backend == "dynamic":
            tokens = exact_keys.shape[-2]
        else:
            tokens = layer.cumulative_length
            key_bits += _quantized_bits(peer, layer._quantized_keys)
            value_bits += _quantized_bits(peer, layer._quantized_values)
        if exact_keys.dim() == 4:  # the exact residual (all tokens for hf-dynamic)
            key_bits += exact_keys.numel() * EXACT_BITS
            value_bits += exact_values.numel() * EXACT_BITS
        coordinates += tokens * geometry.kv_heads * geometry.head_dim
    key, value = key_bits / coordinates, value_bits / coordinates
    return {"key": key, "value": value, "mean": (key + value) / 2}
