"""The tiny random models of the fused-path tests: :mod:`rqlib.study.tiny` (the library keeps
them, so that ``python -m rqlib bench gpu`` runs the same models on a GPU)."""

from rqlib.study.tiny import KINDS, VOCAB, ByteTokenizer, preset_config, tiny_model

__all__ = ["KINDS", "VOCAB", "ByteTokenizer", "preset_config", "tiny_model"]
