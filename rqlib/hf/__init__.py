"""The transformers integration: a compressed KV cache and the attention that reads it.

::

    import rqlib

    # one call: a budget (every preset) becomes per-layer bits, then the cache is installed
    with rqlib.compress(model, "preset:rq-3.5", tokenizer=tokenizer) as cache:
        logits = model(input_ids, cache=cache).logits
        cache.reset()                       # before an unrelated sequence
        model.generate(input_ids, cache=cache, max_new_tokens=20)

:func:`compress` of this package is the same block for a config whose bits are already chosen
(a spec without ``alloc=``); :func:`rqlib.compress` resolves a budget first, with
:func:`rqlib.study.allocation.resolve`, which may measure the model (an evaluation: a layer
above this one).

Integration is only through public extension points: an attention function and a mask
function registered with ``AttentionInterface`` / ``AttentionMaskInterface`` under the name
``"rqlib"`` (:mod:`rqlib.hf.attention`) and a ``transformers.Cache`` subclass
(:mod:`rqlib.hf.cache`). No model code is copied or patched: :func:`compress` only switches
the ``_attn_implementation`` of the model's configs to ``"rqlib"`` and back.

Modules: :mod:`~rqlib.hf.integration` (``compress``, ``build_cache``), :mod:`~rqlib.hf.cache`,
:mod:`~rqlib.hf.codec` (compress, decode and score one layer's keys or values),
:mod:`~rqlib.hf.attention`, :mod:`~rqlib.hf.calibration`, :mod:`~rqlib.hf.transform` (the
calibrated transforms of ``kxf``/``vxf``), :mod:`~rqlib.hf.capture` (record what every attention
layer sees) and :mod:`~rqlib.hf.models` (the packaged models).
"""

from rqlib.hf.cache import CompressedCache
from rqlib.hf.integration import attention_modules, build_cache, compress

__all__ = ["CompressedCache", "attention_modules", "build_cache", "compress"]
