"""Evaluation: perplexity, KL and top-1 agreement of compressed caches, and honest bit counts.

:func:`evaluate` runs every method on the same windows of the same tokens in one pass: for
each window the uncompressed model's logits are computed once, in one forward over the window
with the model's own attention and no cache, and every method is compared with them:

- perplexity ``exp(mean NLL)`` of the scored tokens;
- mean KL divergence ``KL(p_fp || p_method)`` of the next-token distributions (nats);
- top-1 agreement: the fraction of scored positions where both argmaxes agree.

That one-shot forward is the reference in every mode: it is the model's exact distribution,
and the decode harness reproduces it with an exact cache (``hf-dynamic`` in decode mode: KL at
the level of float rounding), so any KL a method shows is its own.

In decode and chunked mode on CPU, the caches of :mod:`rqlib.hf` keep a decoded copy of their
codes (:meth:`rqlib.hf.cache.CompressedCache.keep_decoded`): the numbers are the same bit for bit,
the steps faster, and the memory of the cache is not what the bit counts say (they count what is
stored compressed).

Methods are :class:`rqlib.spec.config.CompressionConfig` objects (the caches of
:mod:`rqlib.hf`; a bit budget, ``alloc=``, is resolved by the caller first with
:func:`rqlib.study.allocation.resolve`) or :class:`rqlib.study.peers.Peer` objects (the
caches a transformers user would pick instead). How a window goes through a method's cache
(``mode``):

- ``"prefill"`` (default): one forward over the whole window.
- ``"decode"``: the window fed one token per forward, as ``generate()`` feeds it; the logits
  of each step are scored. This is the mode to compare caches in: a cache that returns the
  chunk it is given exact and only stores it quantized (transformers' ``QuantizedCache``)
  shows no error at all in prefill mode.
- ``"chunked"``: the window fed ``chunk`` tokens per forward. For the caches of
  :mod:`rqlib.hf` every query reads the same exact and compressed tokens whatever the chunking
  (the recent band is relative to each query), so chunked and decode mode differ only where a
  code flips because float sums ran in another order: they agree in distribution, not element
  by element (:func:`compare_modes` tests it). Peers that return their chunk exact are not
  chunk-invariant and are refused in this mode.

Windows: non-overlapping windows of ``window`` tokens (every token but the first of each
window is scored), or with ``stride`` the Hugging Face sliding-window protocol (windows of
``window`` tokens starting every ``stride`` tokens; only the tokens not scored by the previous
window are scored). No BOS is added. :func:`select_tokens` takes the tokens from an offset
into the corpus (the held-out protocol). With ``batch`` > 1, consecutive windows of equal length
go through the model together as a batch of sequences (the fp forward and rqlib's caches; peers
are fed one window at a time): a decode step then costs little more than one window's, since
on CPU it is mostly per-operation overhead. Each sequence of a batch is compressed on its own
(per-vector codes and norms, a centering mean calibrated beforehand), so the scores are those of
one window at a time up to float rounding: a code can flip where a batched product rounds
differently, so they agree in distribution, not bit for bit.

Every result carries its bits (:func:`rqlib.spec.bits.average_bits`, or
:meth:`rqlib.study.peers.Peer.bits`) and its wall time: the seconds spent building its cache
and running its forwards, and seconds per token fed. The methods of a window run one after
the other, so their times are measured side by side. The ``fp`` row's time is that of its
one-shot forward; in decode mode the exact cache's time per token is ``hf-dynamic``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import dataclass, field, fields

import torch

from rqlib.hf import compress
from rqlib.spec.bits import average_bits, bytes_per_token
from rqlib.spec.config import CompressionConfig
from rqlib.study.peers import Peer, stored_bits

__all__ = [
    "FP_LABEL",
    "MODES",
    "MethodResult",
    "MIN_SCORED_TOKENS",
    "check_scored_tokens",
    "check_methods",
    "compare_modes",
    "evaluate",
    "evaluation_tokens",
    "select_tokens",
    "tokens_sha256",
    "window_batches",
    "windows",
]

FP_LABEL = "fp"
MODES = ("prefill", "decode", "chunked")


# ---- windows ---------------------------------------------------------------------------------
def windows(n_tokens: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` for each window; tokens ``first_scored..end-1`` are scored.

    ``first_scored`` is absolute and always ``> begin`` (the first token of a window has no
    context inside it). Without ``stride``: non-overlapping windows (a last window shorter than 2
    tokens is dropped). With ``stride``: the Hugging Face sliding-window protocol.
    """
    for name, value in (("n_tokens", n_tokens), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"{name} must be an int >= 2, got {value!r}")
    out = []
    if stride is None:
        for begin in range(0, n_tokens, window):
            end = min(begin + window, n_tokens)
            if end - begin >= 2:
                out.append((begin, end, begin + 1))
        return out
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
        raise ValueError(f"stride must be an int in 1..window={window}, got {stride!r}")
    previous_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        first = max(previous_end, begin + 1)
        if end > first:
            out.append((begin, end, first))
        previous_end = end
        if end == n_tokens:
            break
    return out


def select_tokens(token_ids: torch.Tensor, offset: int, n_tokens: int) -> torch.Tensor:
    """Tokens ``offset .. offset + n_tokens - 1`` of a tokenized corpus (1-d ``token_ids``).

    ``ValueError`` says how many tokens the corpus has when it is too short.
    """
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        raise ValueError("token_ids must be a 1-d tensor of token ids")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 2:
        raise ValueError(f"n_tokens must be an int >= 2, got {n_tokens!r}")
    available = int(token_ids.numel())
    if offset + n_tokens > available:
        raise ValueError(
            f"the corpus has {available} tokens: offset {offset} + {n_tokens} tokens runs past "
            f"its end (at most {max(available - offset, 0)} tokens from that offset)"
        )
    return token_ids[offset : offset + n_tokens]


#: The fewest tokens an evaluation a user asks for must score: fewer say nothing (``--tokens 2``
#: scores one token, and its ΔPPL of a few hundredths of a percent is noise, not a result).
MIN_SCORED_TOKENS = 16


def check_scored_tokens(n_tokens: int, window: int, stride: int | None = None) -> int:
    """The number of tokens that ``n_tokens`` tokens in these windows score (the first token
    of a window is not); ``ValueError`` naming the minimum when it is below
    :data:`MIN_SCORED_TOKENS`. The one rule of ``python -m rqlib eval --tokens`` and of
    chapter 4's ``tokens``, where 0 means the whole corpus (see :func:`evaluation_tokens`)."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"the token count must be an int >= 0 (0: the whole corpus): {n_tokens!r}")
    spans = windows(n_tokens, window, stride) if n_tokens >= 2 else []
    scored = sum(end - first for _, end, first in spans)
    if scored < MIN_SCORED_TOKENS:
        raise ValueError(
            f"{n_tokens} tokens in windows of {window} score {scored}; at least "
            f"{MIN_SCORED_TOKENS} must be scored (ask for more tokens, or 0 for the whole corpus)"
        )
    return scored


def evaluation_tokens(
    token_ids: torch.Tensor, offset: int, n_tokens: int, window: int, stride: int | None = None
) -> torch.Tensor:
    """The tokens an evaluation reads: ``n_tokens`` from ``offset`` of a tokenized corpus
    (:func:`select_tokens`), or every token from ``offset`` on when ``n_tokens`` is 0; refused
    by :func:`check_scored_tokens` when their windows would score too few."""
    if n_tokens == 0 and not isinstance(n_tokens, bool) and isinstance(token_ids, torch.Tensor):
        n_tokens = max(int(token_ids.numel()) - offset, 0)
    check_scored_tokens(n_tokens, window, stride)
    return select_tokens(token_ids, offset, n_tokens)


def tokens_sha256(token_ids: torch.Tensor) -> str:
    """sha256 of the token ids written as comma-separated decimals (which tokens were used)."""
    text = ",".join(str(int(t)) for t in token_ids.tolist())
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# ---- evaluation ------------------------------------------------------------------------------
@dataclass
class MethodResult:
    """Accumulated scores of one method over the evaluated windows.

    ``token_nll``, ``token_kl`` and ``token_top1`` hold the per-token scores in order, one
    tensor per window (:meth:`per_token` concatenates them, :meth:`per_window` averages each);
    they are not part of :meth:`to_dict`. ``seconds`` is the wall time of this method's cache
    and forwards, ``tokens_fed`` the tokens it fed.
    """

    label: str
    config: dict | None
    bits: dict
    bytes_per_token: float
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    top1_matches: int = 0
    n_scored: int = 0
    seconds: float = 0.0
    tokens_fed: int = 0
    extra: dict = field(default_factory=dict)
    token_nll: list = field(default_factory=list, repr=False, metadata={"json": False})
    token_kl: list = field(default_factory=list, repr=False, metadata={"json": False})
    token_top1: list = field(default_factory=list, repr=False, metadata={"json": False})

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.n_scored)

    @property
    def kl(self) -> float:
        return self.kl_sum / self.n_scored

    @property
    def top1(self) -> float:
        return self.top1_matches / self.n_scored

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens_fed

    def per_token(self, name: str) -> torch.Tensor:
        """Per-token ``"nll"``, ``"kl"`` or ``"top1"`` of every scored token, in order."""
        return torch.cat(self._scores(name))

    def per_window(self, name: str) -> torch.Tensor:
        """The mean per-token ``"nll"``, ``"kl"`` or ``"top1"`` of each window, in order."""
        return torch.stack([scores.double().mean() for scores in self._scores(name)])

    def _scores(self, name: str) -> list[torch.Tensor]:
        if name not in ("nll", "kl", "top1"):
            raise ValueError(f"per-token scores are 'nll', 'kl' and 'top1', not {name!r}")
        return getattr(self, f"token_{name}")

    def add_window(self, nll: torch.Tensor, kl: torch.Tensor, top1: torch.Tensor) -> None:
        """Add the per-token scores of one window."""
        self.nll_sum += float(nll.sum())
        self.kl_sum += float(kl.sum())
        self.top1_matches += int(top1.sum())
        self.n_scored += nll.numel()
        self.token_nll.append(nll.double().cpu())
        self.token_kl.append(kl.double().cpu())
        self.token_top1.append(top1.cpu())

    def to_dict(self, fp_perplexity: float | None = None) -> dict:
        out = {
            f.name: _copy(getattr(self, f.name))
            for f in fields(self)
            if f.metadata.get("json", True)
        }
        out.update(
            perplexity=self.perplexity,
            kl=self.kl,
            top1=self.top1,
            seconds_per_token=self.seconds_per_token,
        )
        if fp_perplexity is not None:
            out["delta_ppl_pct"] = 100 * (self.perplexity / fp_perplexity - 1)
        return out


def _copy(value):
    return {key: _copy(item) for key, item in value.items()} if isinstance(value, dict) else value


def _score(
    log_probs: torch.Tensor, fp_log_probs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token NLL, KL(fp || method) and top-1 agreement of some scored positions."""
    nll = -log_probs.gather(-1, targets[:, None])[:, 0]
    kl = (fp_log_probs.exp() * (fp_log_probs - log_probs)).sum(-1)
    top1 = log_probs.argmax(-1) == fp_log_probs.argmax(-1)
    return nll.double().cpu(), kl.double().cpu(), top1.cpu()


def check_methods(methods: list, mode: str, chunk: int | None, *, resolved: bool = True) -> None:
    """Raise ``ValueError`` (``TypeError``, ``ModuleNotFoundError``) unless :func:`evaluate`
    can run ``methods`` in ``mode``: a known mode, ``chunk`` with chunked mode only, no peer
    that is not chunk-invariant in chunked mode, every peer's package installed and, with
    ``resolved``, no config with an unresolved bit budget."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "chunked":
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunked mode needs chunk, an int >= 1, got {chunk!r}")
    elif chunk is not None:
        raise ValueError(f"chunk is for mode='chunked' only (mode={mode!r})")
    for method in methods:
        if isinstance(method, Peer):
            if mode == "chunked" and not method.chunk_invariant:
                raise ValueError(
                    f"{method.label} returns the chunk it is given exact, so chunked mode would "
                    "flatter it (each query would see up to chunk-1 more exact tokens than in "
                    "generation): evaluate it with mode='decode'"
                )
            method.check_available()
            continue
        if not isinstance(method, CompressionConfig):
            raise TypeError(
                f"methods must be CompressionConfig or Peer objects, got {type(method).__name__}"
            )
        if resolved and method.budget is not None:
            raise ValueError(
                f"{method.label}: resolve its bit budget (alloc=) against the model first: "
                "rqlib.study.allocation.resolve(config, model, tokenizer)"
            )


def _result(method, model_config, context: int) -> MethodResult:
    """An empty result for ``method`` (``None``: the uncompressed model) with its bits."""
    if method is None:
        bits = average_bits(None, model_config, context)
        return MethodResult(FP_LABEL, None, bits, bytes_per_token(None, model_config, context))
    if isinstance(method, Peer):
        result = MethodResult(
            method.label,
            method.to_dict(),
            method.bits(model_config, context),
            method.bytes_per_token(model_config, context),
        )
        note = method.note(model_config)
        if note:
            result.extra["note"] = note
        return result
    return MethodResult(
        method.label,
        method.to_dict(),
        average_bits(method, model_config, context),
        bytes_per_token(method, model_config, context),
    )


@contextlib.contextmanager
def _cache_of(model, method, tokenizer, decoded_copy: bool):
    """A fresh cache of ``method`` for one window (ours installed with :func:`compress`, with a
    decoded copy of its codes when ``decoded_copy``)."""
    if isinstance(method, Peer):
        yield method.make_cache(model)
    else:
        with compress(model, method, tokenizer=tokenizer) as cache:
            cache.keep_decoded(decoded_copy)
            yield cache


def _record_storage(result: MethodResult, method, cache, model_config) -> None:
    """What the cache holds at the end of the first window, measured from its tensors."""
    if "stored_bits" in result.extra or "cache_bytes_per_token" in result.extra:
        return
    if isinstance(method, Peer):
        result.extra["stored_bits"] = stored_bits(method, cache, model_config)
    else:
        result.extra["cache_bytes_per_token"] = cache.bytes_per_token()


def evaluate(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    methods: list,
    *,
    window: int = 1024,
    stride: int | None = None,
    tokenizer=None,
    context: int = 4096,
    mode: str = "prefill",
    chunk: int | None = None,
    batch: int = 1,
    progress: bool = True,
) -> list[MethodResult]:
    """Evaluate the uncompressed model and every method on the same windows.

    ``methods`` are resolved :class:`~rqlib.spec.config.CompressionConfig` objects and
    :class:`~rqlib.study.peers.Peer` objects. ``mode`` is ``"prefill"``, ``"decode"`` or
    ``"chunked"`` (with ``chunk`` tokens per forward); see the module docstring. Returns one
    :class:`MethodResult` per method, the uncompressed model first (label ``"fp"``: the
    one-shot forward every method is compared with). ``tokenizer`` is passed to
    :func:`rqlib.hf.compress` for calibration. Up to ``batch`` consecutive windows of equal
    length go through the model together (:func:`window_batches`).
    """
    from tqdm.auto import tqdm

    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        raise ValueError("token_ids must be a 1-d tensor of token ids")
    check_methods(methods, mode, chunk)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    model_config = model.config
    results = [_result(None, model_config, context)]
    results += [_result(method, model_config, context) for method in methods]
    spans = windows(int(token_ids.numel()), window, stride)
    fed_per_window = [end - begin - (mode != "prefill") for begin, end, _ in spans]
    steps = tqdm(
        total=sum(fed_per_window) * (1 + len(methods)),
        desc=f"evaluating ({mode})",
        unit="token",
        disable=not progress,
    )
    with torch.no_grad():
        for group in window_batches(spans, batch):
            _evaluate_group(
                model, token_ids, group, methods, results, tokenizer, mode, chunk, steps
            )
    steps.close()
    return results


def window_batches(
    spans: list[tuple[int, int, int]], batch: int
) -> list[list[tuple[int, int, int]]]:
    """The windows of :func:`windows` in groups fed together as a batch of sequences: runs of
    up to ``batch`` consecutive windows of equal length, in order."""
    groups: list[list[tuple[int, int, int]]] = []
    for span in spans:
        last = groups[-1] if groups else None
        if last and len(last) < batch and last[0][1] - last[0][0] == span[1] - span[0]:
            last.append(span)
        else:
            groups.append([span])
    return groups


def _evaluate_group(model, token_ids, group, methods, results, tokenizer, mode, chunk, steps):
    """Score every method on one group of equal-length windows (see :func:`evaluate`).

    The fp forward and rqlib's caches take the group as one batch; peers are fed one window at
    a time (their bit counts read a one-sequence cache)."""
    device = next(model.parameters()).device
    length = group[0][1] - group[0][0]
    ids = torch.stack([token_ids[begin:end] for begin, end, _ in group]).to(device)
    first_rows = [first - begin - 1 for begin, _, first in group]  # logits at j predict j + 1
    targets = [token_ids[first:end].to(device) for _, end, first in group]
    fed = length - (mode != "prefill")
    labels = ", ".join(f"{begin}..{end}" for begin, end, _ in group)

    steps.set_postfix_str(f"tokens {labels} fp")
    started = time.perf_counter()
    logits = model(ids, use_cache=False).logits
    fp_log_probs = [
        torch.log_softmax(logits[i, row : length - 1].float(), -1)
        for i, row in enumerate(first_rows)
    ]
    results[0].seconds += time.perf_counter() - started
    results[0].tokens_fed += length * len(group)
    for log_probs, target in zip(fp_log_probs, targets):
        results[0].add_window(*_score(log_probs, log_probs, target))
    steps.update(fed * len(group))
    del logits

    step = {"prefill": fed, "decode": 1, "chunked": chunk}[mode]
    # short steps on CPU read a decoded copy of the codes (same numbers, bit for bit)
    decoded_copy = step < fed and device.type == "cpu"
    for result, method in zip(results[1:], methods):
        batches = (
            [[i] for i in range(len(group))]
            if isinstance(method, Peer)
            else [list(range(len(group)))]
        )
        for members in batches:
            steps.set_postfix_str(f"tokens {labels} {result.label}")
            started = time.perf_counter()
            scores: dict[int, list] = {i: [] for i in members}
            with _cache_of(model, method, tokenizer, decoded_copy) as cache:
                for start in range(0, fed, step):
                    stop = min(start + step, fed)
                    logits = model(ids[members, start:stop], cache=cache, use_cache=True).logits
                    for row, i in enumerate(members):
                        lo, hi = max(start, first_rows[i]), min(stop, length - 1)
                        if lo < hi:
                            log_probs = torch.log_softmax(
                                logits[row, lo - start : hi - start].float(), -1
                            )
                            scored = slice(lo - first_rows[i], hi - first_rows[i])
                            scores[i].append(
                                _score(log_probs, fp_log_probs[i][scored], targets[i][scored])
                            )
                    steps.update((stop - start) * len(members))
                    del logits
                result.seconds += time.perf_counter() - started
                result.tokens_fed += fed * len(members)
                _record_storage(result, method, cache, model.config)
                if decoded_copy and not isinstance(method, Peer):
                    result.extra["decoded_copy"] = True
            for i in members:
                result.add_window(*(torch.cat(parts) for parts in zip(*scores[i])))


# ---- do two modes agree? ---------------------------------------------------------------------
def compare_modes(a: MethodResult, b: MethodResult, *, confidence: float = 0.999) -> dict:
    """Do two runs over the same windows (the same method in two modes, say) agree in
    distribution? A paired t-test over windows.

    For the NLL and the KL, the difference ``a - b`` of each window's mean per-token score is
    taken, and their mean is tested for zero with a two-sided paired t-test over the windows
    (``windows - 1`` degrees of freedom). Windows, not tokens, are the independent units: a
    code that flips in one mode stays flipped for every later query of its window, so the
    per-token differences of a window move together. Returns ``{"windows": W, "tokens": n,
    "nll": {...}, "kl": {...}}`` with, for each score, ``mean_diff`` (per token), its standard
    error ``se``, ``t``, the p-value ``p`` and ``ci``, the ``confidence`` interval of the mean
    difference (identical scores: ``t = 0``, ``p = 1``). The runs are said to agree at
    significance ``1 - confidence`` when neither p-value is below it.
    """
    from scipy import stats

    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    sizes_a = [scores.numel() for scores in a.token_nll]
    sizes_b = [scores.numel() for scores in b.token_nll]
    if sizes_a != sizes_b:
        raise ValueError(
            f"{a.label} and {b.label} scored different windows ({len(sizes_a)} windows, "
            f"{sum(sizes_a)} tokens and {len(sizes_b)} windows, {sum(sizes_b)} tokens); compare "
            "runs over the same windows"
        )
    if len(sizes_a) < 2:
        raise ValueError(f"a paired test over windows needs at least 2 windows, got {len(sizes_a)}")
    out: dict = {"windows": len(sizes_a), "tokens": sum(sizes_a)}
    for name in ("nll", "kl"):
        diff = (a.per_window(name) - b.per_window(name)).numpy()
        n = diff.size
        mean = float(diff.mean())
        se = float(diff.std(ddof=1) / math.sqrt(n))
        if se > 0:
            t = mean / se
            p = float(2 * stats.t.sf(abs(t), n - 1))
        else:  # every difference the same: equal runs, or a constant shift
            t, p = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
        out[name] = {"mean_diff": mean, "se": se, "t": t, "p": p, "ci": (mean - half, mean + half)}
    return out
