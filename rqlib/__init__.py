"""rqlib: KV-cache compression with TurboQuant, QJL and RotorQuant.

Modules (import them directly; nothing heavy is imported here):

- :mod:`rqlib.clifford`   Cl(3,0) multivectors, rotors and the sandwich product
- :mod:`rqlib.codebooks`  Lloyd-Max codebooks for one coordinate of a random unit vector
- :mod:`rqlib.rotations`  dense Haar, randomized Hadamard and rotor-block rotations
- :mod:`rqlib.packing`    b-bit codes and sign bits packed into uint8
- :mod:`rqlib.quantizers` TurboQuant / RotorQuant quantizers and their inner-product estimators
- :mod:`rqlib.kernels`    Triton kernels with torch references and a dispatcher
- :mod:`rqlib.hf`         the transformers integration (compressed cache, attention function)
- :mod:`rqlib.models`, :mod:`rqlib.data`, :mod:`rqlib.eval`  models, corpora, evaluation
- :mod:`rqlib.capture`    record the queries, keys and values every attention layer sees
- :mod:`rqlib.theory`     closed forms the book checks the library against
- :mod:`rqlib.provenance`, :mod:`rqlib.results`, :mod:`rqlib.sweep`  what chapters record,
  where results go, and papermill sweeps over a chapter
"""

__version__ = "0.1.0"
