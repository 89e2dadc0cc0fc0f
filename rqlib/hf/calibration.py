"""Calibration on a corpus that is not the evaluation text: key means and outlier channels.

The model runs (uncompressed) over ``n_tokens`` of the calibration corpus (``pydoc`` by
default) in chunks of at most 1024 tokens; a plain ``DynamicCache`` collects every layer's keys
and values after RoPE, exactly what the compressed cache will see, and the queries are recorded
by :func:`rqlib.hf.capture.capture_attention` (stock sdpa attention). From them:

- ``key_means[l]``: the mean key of each KV head, ``[KV, d]`` (used for centering);
- ``key_energy[l]`` / ``value_energy[l]``: the mean square of each channel of each KV head,
  ``[KV, d]``, keys taken after centering (used to pick outlier channels and to scale keys);
- ``query_energy[l]``: the mean square of each query channel, averaged over the query heads
  that share a KV head, ``[KV, d]``, after RoPE (used to scale keys, see
  :func:`rqlib.hf.codec.key_channel_scale`).

The first token of each chunk is left out of the statistics: with no BOS it behaves as an
attention sink with atypical keys. Results are memoized per model and corpus settings.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from rqlib.base.corpora import load_corpus, tokenize_corpus
from rqlib.hf.capture import capture_attention

__all__ = ["Calibration", "calibrate", "top_channels"]

CHUNK = 1024
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Calibration:
    """Per-layer key means and channel energies, with the corpus they came from."""

    key_means: tuple[torch.Tensor, ...]
    key_energy: tuple[torch.Tensor, ...]
    value_energy: tuple[torch.Tensor, ...]
    query_energy: tuple[torch.Tensor, ...]
    corpus: dict
    n_tokens: int


def top_channels(energy: torch.Tensor, count: int) -> torch.Tensor:
    """Indices ``[KV, count]`` (sorted) of the ``count`` channels of largest energy per head."""
    if not 0 < count < energy.shape[-1]:
        raise ValueError(f"outlier channel count must be in 1..{energy.shape[-1] - 1}, got {count}")
    return torch.topk(energy, count, dim=-1).indices.sort(dim=-1).values


def calibrate(model, tokenizer, corpus_name: str, n_tokens: int) -> Calibration:
    """Run ``model`` on ``n_tokens`` of ``corpus_name`` and collect the statistics."""
    from transformers import DynamicCache

    key = (corpus_name, n_tokens, getattr(tokenizer, "name_or_path", id(tokenizer)))
    memo = _MEMO.setdefault(model, {})
    if key in memo:
        return memo[key]
    corpus = load_corpus(corpus_name)
    ids = tokenize_corpus(corpus, tokenizer, n_tokens)
    vocab = model.get_input_embeddings().num_embeddings
    if int(ids.max()) >= vocab:
        raise ValueError(
            f"the calibration tokenizer produced id {int(ids.max())} >= the model's vocabulary "
            f"({vocab}): pass the model's own tokenizer to compress(..., tokenizer=)"
        )
    sums = sq_keys = sq_values = sq_queries = None
    count = 0
    device = next(model.parameters()).device
    with torch.no_grad(), capture_attention(model) as captured:
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            if len(chunk) < 2:
                break
            cache = DynamicCache()
            captured.calls.clear()
            model(chunk[None].to(device), cache=cache, use_cache=True)
            keys = [layer.keys[0, :, 1:].double() for layer in cache.layers]  # [KV, S-1, d]
            values = [layer.values[0, :, 1:].double() for layer in cache.layers]
            # per KV head: the sum over tokens of q*q, averaged over the heads of its group
            sq_q = []
            for i, k in enumerate(keys):
                q = captured.calls[i][-1].query[0, :, 1:].double()  # [H, S-1, d]
                group = q.shape[0] // k.shape[0]
                sq_q.append((q * q).reshape(k.shape[0], -1, k.shape[-1]).sum(1) / group)
            if sums is None:
                sums = [k.sum(1) for k in keys]
                sq_keys = [(k * k).sum(1) for k in keys]
                sq_values = [(v * v).sum(1) for v in values]
                sq_queries = sq_q
            else:
                for i, (k, v) in enumerate(zip(keys, values)):
                    sums[i] += k.sum(1)
                    sq_keys[i] += (k * k).sum(1)
                    sq_values[i] += (v * v).sum(1)
                    sq_queries[i] += sq_q[i]
            count += chunk.numel() - 1
    means = [s / count for s in sums]
    # E[(k - mu)^2] = E[k^2] - mu^2 per channel
    key_energy = [sq / count - mu * mu for sq, mu in zip(sq_keys, means)]
    value_energy = [sq / count for sq in sq_values]
    query_energy = [sq / count for sq in sq_queries]
    result = Calibration(
        key_means=tuple(m.float().cpu() for m in means),
        key_energy=tuple(e.float().cpu() for e in key_energy),
        value_energy=tuple(e.float().cpu() for e in value_energy),
        query_energy=tuple(e.float().cpu() for e in query_energy),
        corpus=corpus.provenance(),
        n_tokens=int(ids.numel()),
    )
    memo[key] = result
    return result
