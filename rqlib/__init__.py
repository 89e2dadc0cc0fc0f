"""rqlib: KV-cache compression with TurboQuant, QJL and RotorQuant.

The package is layered; a module imports only its own layer and the layers above it in this
list (``tests/test_architecture.py`` checks it), so it reads from the bottom up:

- :mod:`rqlib.base`     paths, atomic file writes and locks, text corpora
- :mod:`rqlib.core`     the mathematics: Cl(3,0) algebra, Lloyd-Max codebooks, rotations,
  bit-packing, quantizers, the inner-product estimator, GQA helpers, closed forms
- :mod:`rqlib.spec`     what a compressed cache is: the config and its spec language, presets,
  model geometry, the codec plan of each layer and the bit accounting
- :mod:`rqlib.kernels`  Triton kernels with torch references and a dispatcher
- :mod:`rqlib.hf`       the transformers integration: cache, attention, codecs, calibration
- :mod:`rqlib.study`    evaluation, bit allocation, ablations, depth measurements, benchmarks
- :mod:`rqlib.book`     what the chapters need: provenance, results files, sweeps, loaders
- :mod:`rqlib.cli`      the command line, ``python -m rqlib COMMAND``

Importing ``rqlib`` itself imports nothing heavy. Its one function, :func:`compress`
(:func:`rqlib.study.api.compress`, imported when first used), is the one call that installs
a compressed cache, presets and bit budgets included::

    import rqlib

    with rqlib.compress(model, "preset:rq-3.5", tokenizer=tokenizer) as cache:
        logits = model(input_ids, cache=cache).logits
"""

__version__ = "0.1.0"
__all__ = ["compress"]


def __getattr__(name: str):
    """``rqlib.compress``, imported on first use so that ``import rqlib`` stays light."""
    if name == "compress":
        from rqlib.study.api import compress

        return compress
    raise AttributeError(f"module 'rqlib' has no attribute {name!r}")
