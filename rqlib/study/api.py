"""The one call a user reaches for first: ``rqlib.compress(model, "preset:rq-3.5", tokenizer=tok)``.

:func:`rqlib.hf.compress` installs a cache whose bits are already chosen for every layer; a
bit budget (``alloc=``, every preset) is chosen per layer by
:func:`rqlib.study.allocation.resolve`, which may have to measure the model's sensitivity (an
evaluation, so it lives in this layer, above ``hf``). :func:`compress` does both steps: it
resolves the budget against the model, then installs the cache for the block.

::

    import rqlib

    with rqlib.compress(model, "preset:rq-3.5", tokenizer=tokenizer) as cache:
        logits = model(input_ids, cache=cache).logits
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rqlib.hf.cache import CompressedCache
from rqlib.hf.integration import compress as install_cache
from rqlib.spec.config import CompressionConfig
from rqlib.study.allocation import resolve

__all__ = ["compress"]


@contextlib.contextmanager
def compress(
    model: torch.nn.Module,
    config: CompressionConfig | str,
    *,
    tokenizer=None,
    context: int = 4096,
    progress: bool = True,
) -> Iterator[CompressedCache]:
    """Install a compressed cache on ``model`` for the block and yield it, whatever ``config``
    is: a spec string, a preset (``"preset:rq-3.5"``) or a :class:`CompressionConfig`, with or
    without a bit budget.

    A budget is first turned into per-layer bits for this model by
    :func:`rqlib.study.allocation.resolve` (a shipped or cached sensitivity table, or one
    measured on the config's calibration corpus with ``tokenizer``, never on the evaluation
    text; ``context`` is the length over which exactly-kept tokens are amortized). Then
    :func:`rqlib.hf.compress` installs the cache (calibrating with ``tokenizer`` where the
    config needs it); everything it says about the block holds here.
    """
    resolved = resolve(config, model, tokenizer, context=context, progress=progress)
    with install_cache(model, resolved, tokenizer=tokenizer) as cache:
        yield cache
