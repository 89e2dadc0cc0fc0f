"""Evaluation: perplexity, KL and top-1 agreement of compressed caches, and honest bit counts.

:func:`evaluate` runs every method on the same windows of the same tokens in one pass: for
each window the uncompressed model's logits are computed once (with the model's own attention)
and every compressed method is compared with them:

- perplexity ``exp(mean NLL)`` of the scored tokens;
- mean KL divergence ``KL(p_fp || p_method)`` of the next-token distributions (nats);
- top-1 agreement: the fraction of scored positions where both argmaxes agree.

Windows: non-overlapping windows of ``window`` tokens (every token but the first of each
window is scored), or with ``stride`` the Hugging Face sliding-window protocol (windows of
``window`` tokens starting every ``stride`` tokens; only the tokens not scored by the previous
window are scored). No BOS is added.

Every result carries its bits (:func:`rqlib.spec.bits.average_bits`). Configs with a bit
budget (``alloc=``) are resolved by the caller first (:func:`rqlib.study.allocation.resolve`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from rqlib.hf import compress
from rqlib.spec.bits import average_bits, bytes_per_token
from rqlib.spec.config import CompressionConfig

__all__ = ["FP_LABEL", "MethodResult", "evaluate", "windows"]

FP_LABEL = "fp"


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


# ---- evaluation ------------------------------------------------------------------------------
@dataclass
class MethodResult:
    """Accumulated scores of one method over the evaluated windows."""

    label: str
    config: dict | None
    bits: dict
    bytes_per_token: float
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    top1_matches: int = 0
    n_scored: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.n_scored)

    @property
    def kl(self) -> float:
        return self.kl_sum / self.n_scored

    @property
    def top1(self) -> float:
        return self.top1_matches / self.n_scored

    def to_dict(self, fp_perplexity: float | None = None) -> dict:
        out = asdict(self)
        out.update(perplexity=self.perplexity, kl=self.kl, top1=self.top1)
        if fp_perplexity is not None:
            out["delta_ppl_pct"] = 100 * (self.perplexity / fp_perplexity - 1)
        return out


def _score(
    result: MethodResult, log_probs: torch.Tensor, fp_log_probs: torch.Tensor, targets: torch.Tensor
) -> None:
    result.nll_sum += float(-log_probs.gather(-1, targets[:, None]).sum())
    result.kl_sum += float((fp_log_probs.exp() * (fp_log_probs - log_probs)).sum())
    result.top1_matches += int((log_probs.argmax(-1) == fp_log_probs.argmax(-1)).sum())
    result.n_scored += targets.numel()


def evaluate(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    methods: list[CompressionConfig],
    *,
    window: int = 1024,
    stride: int | None = None,
    tokenizer=None,
    context: int = 4096,
    progress: bool = True,
) -> list[MethodResult]:
    """Evaluate the uncompressed model and every config in ``methods`` on the same windows.

    Returns one :class:`MethodResult` per method, the uncompressed model first (label
    ``"fp"``). ``tokenizer`` is passed to :func:`rqlib.hf.compress` for calibration.
    """
    from tqdm.auto import tqdm

    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        raise ValueError("token_ids must be a 1-d tensor of token ids")
    for config in methods:
        if not isinstance(config, CompressionConfig):
            raise TypeError(
                f"methods must be CompressionConfig objects, got {type(config).__name__}"
            )
        if config.budget is not None:
            raise ValueError(
                f"{config.label}: resolve its bit budget (alloc=) against the model first: "
                "rqlib.study.allocation.resolve(config, model, tokenizer)"
            )
    model_config = model.config
    results = [
        MethodResult(
            FP_LABEL,
            None,
            average_bits(None, model_config, context),
            bytes_per_token(None, model_config, context),
        )
    ]
    for config in methods:
        results.append(
            MethodResult(
                config.label,
                config.to_dict(),
                average_bits(config, model_config, context),
                bytes_per_token(config, model_config, context),
            )
        )
    spans = windows(int(token_ids.numel()), window, stride)
    device = next(model.parameters()).device
    steps = tqdm(
        total=len(spans) * (1 + len(methods)), desc="evaluating", unit="pass", disable=not progress
    )
    with torch.no_grad():
        for begin, end, first in spans:
            ids = token_ids[begin:end][None].to(device)
            targets = token_ids[first:end].to(device)
            rows = slice(first - begin - 1, end - begin - 1)  # logits at j-1 predict token j
            steps.set_postfix_str(f"tokens {begin}..{end} fp")
            fp_log_probs = torch.log_softmax(
                model(ids, use_cache=False).logits[0, rows].float(), -1
            )
            _score(results[0], fp_log_probs, fp_log_probs, targets)
            steps.update()
            for result, config in zip(results[1:], methods):
                steps.set_postfix_str(f"tokens {begin}..{end} {config.label}")
                with compress(model, config, tokenizer=tokenizer) as cache:
                    logits = model(ids, cache=cache, use_cache=True).logits
                    if "cache_bytes_per_token" not in result.extra:
                        result.extra["cache_bytes_per_token"] = cache.bytes_per_token()
                log_probs = torch.log_softmax(logits[0, rows].float(), -1)
                _score(result, log_probs, fp_log_probs, targets)
                del logits, log_probs
                steps.update()
    steps.close()
    return results
