"""Calibration on a corpus that is not the evaluation text: key means and outlier channels.

The model runs (uncompressed) over ``n_tokens`` of the calibration corpus (``pydoc`` by
default) in chunks of at most ``chunk`` tokens (1024 by default, spec token ``clen``), so the
statistics see positions below ``chunk`` only; a plain ``DynamicCache`` collects every layer's
keys and values after RoPE, exactly what the compressed cache will see, and the queries are
recorded by :func:`rqlib.hf.capture.capture_attention` (stock sdpa attention). From them:

- ``key_means[l]``: the mean key of each KV head, ``[KV, d]`` (used for centering);
- ``key_energy[l]`` / ``value_energy[l]``: the mean square of each channel of each KV head,
  ``[KV, d]``, keys taken after centering (used to pick outlier channels and to scale keys);
- ``query_energy[l]``: the mean square of each query channel, averaged over the query heads
  that share a KV head, ``[KV, d]``, after RoPE (used to scale keys, see
  :func:`rqlib.hf.codec.key_channel_scale`);
- ``key_covariance[l]`` (centred keys), ``query_moment[l]`` (``E[q q^T]`` over the heads of a
  group), ``value_means[l]`` and ``value_covariance[l]``: the full ``[KV, d, d]`` matrices the
  calibrated transforms are fitted to (:mod:`rqlib.hf.transform`); the energies above are their
  diagonals.

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
    key_covariance: tuple[torch.Tensor, ...]
    query_moment: tuple[torch.Tensor, ...]
    value_means: tuple[torch.Tensor, ...]
    value_covariance: tuple[torch.Tensor, ...]
    corpus: dict
    n_tokens: int


def top_channels(energy: torch.Tensor, count: int) -> torch.Tensor:
    """Indices ``[KV, count]`` (sorted) of the ``count`` channels of largest energy per head."""
    if not 0 < count < energy.shape[-1]:
        raise ValueError(f"outlier channel count must be in 1..{energy.shape[-1] - 1}, got {count}")
    return torch.topk(energy, count, dim=-1).indices.sort(dim=-1).values


def calibrate(model, tokenizer, corpus_name: str, n_tokens: int, chunk: int = CHUNK) -> Calibration:
    """Run ``model`` on ``n_tokens`` of ``corpus_name`` in chunks of ``chunk`` tokens and
    collect the statistics."""
    from transformers import DynamicCache

    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2:
        raise ValueError(f"chunk must be an int >= 2 tokens, got {chunk!r}")
    key = (corpus_name, n_tokens, chunk, getattr(tokenizer, "name_or_path", id(tokenizer)))
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
    sums: dict[int, tuple] = {}  # per layer: the sums over tokens of k, v, k k^T, v v^T, q q^T
    count = 0
    device = next(model.parameters()).device
    with torch.no_grad(), capture_attention(model) as captured:
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            if len(piece) < 2:
                break
            cache = DynamicCache()
            captured.calls.clear()
            model(piece[None].to(device), cache=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                k = layer.keys[0, :, 1:].double()  # [KV, S-1, d]
                v = layer.values[0, :, 1:].double()
                q = captured.calls[i][-1].query[0, :, 1:].double()  # [H, S-1, d]
                # per KV head: q q^T summed over tokens, averaged over the heads of its group
                q = q.reshape(k.shape[0], -1, k.shape[-1])
                moments = (
                    k.sum(1),
                    v.sum(1),
                    k.transpose(1, 2) @ k,
                    v.transpose(1, 2) @ v,
                    q.transpose(1, 2) @ q / (q.shape[1] // k.shape[1]),
                )
                sums[i] = tuple(map(torch.add, sums[i], moments)) if i in sums else moments
            count += piece.numel() - 1
    key_means, value_means, key_cov, value_cov, query_moment, value_energy = ([] for _ in range(6))
    for k_sum, v_sum, kk, vv, qq in (sums[i] for i in sorted(sums)):
        mu, nu = k_sum / count, v_sum / count
        value_energy.append(vv.diagonal(dim1=-2, dim2=-1) / count)
        key_means.append(mu)
        value_means.append(nu)
        # E[(x - mu)(x - mu)^T] = E[x x^T] - mu mu^T per head
        key_cov.append(kk / count - mu[:, :, None] * mu[:, None, :])
        value_cov.append(vv / count - nu[:, :, None] * nu[:, None, :])
        query_moment.append(qq / count)

    def stored(matrices):
        return tuple(m.float().cpu() for m in matrices)

    result = Calibration(
        key_means=stored(key_means),
        key_energy=stored(c.diagonal(dim1=-2, dim2=-1) for c in key_cov),
        value_energy=stored(value_energy),  # E[v^2], not centred
        query_energy=stored(m.diagonal(dim1=-2, dim2=-1) for m in query_moment),
        key_covariance=stored(key_cov),
        query_moment=stored(query_moment),
        value_means=stored(value_means),
        value_covariance=stored(value_cov),
        corpus=corpus.provenance(),
        n_tokens=int(ids.numel()),
    )
    memo[key] = result
    return result
