"""A decode step does no torch work that grows with the context (Triton path, interpreted).

Every aten operation issued by the cache's ``update`` and ``attend`` during one decode step is
recorded with a ``TorchDispatchMode``, at two context lengths, for every layer of a tiny Llama
in the presets' format with a left-padded batch of two. Between the two contexts the stored
buffers have different capacities, so an operation that read or wrote a whole buffer (or the
whole padding mask) would show different tensor sizes; the test asserts that every operation
sees the same sizes at both contexts.

Scope: the cache's update and attend. Out of scope: what transformers does around them (mask
building, the model's projections), the Triton kernels themselves (their launches are not
recorded: they are the part allowed to read the whole cache), view operations (slicing a buffer
reads nothing) and allocations (``empty``: the kernels' partial results, one row of floats per
512 keys, are allocated uninitialized).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ByteTokenizer, preset_config, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from rqlib.hf import compress
from rqlib.hf.cache import CompressedCache
from rqlib.kernels import launch

pytestmark = pytest.mark.interpreter

ALLOCATIONS = {"empty", "empty_strided", "empty_like"}


class Recorder(TorchDispatchMode):
    """Records (operation, sizes of its tensor arguments and results) while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.on and not func.is_view and name not in ALLOCATIONS:
            tensors = [
                t
                for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor)
            ]
            self.ops.append((str(func), tuple(t.numel() for t in tensors)))
        return out


class Paused:
    """A Triton kernel whose launches are not recorded."""

    def __init__(self, kernel, recorder: Recorder) -> None:
        self.kernel, self.recorder = kernel, recorder

    def __getitem__(self, grid):
        def launch_kernel(*args, **kwargs):
            was, self.recorder.on = self.recorder.on, False
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.recorder.on = was

        return launch_kernel

    def warmup(self, *args, **kwargs):  # compiles, reads nothing (launch.attention_config)
        was, self.recorder.on = self.recorder.on, False
        try:
            return self.kernel.warmup(*args, **kwargs)
        finally:
            self.recorder.on = was


WARM_STEPS = 8


def one_decode_step(model, config, context: int, rng, monkeypatch) -> list:
    """The operations of the cache during one decode step after ``context`` tokens."""
    recorder = Recorder()
    for name in ("attention_kernel", "reduce_kernel", "quantize_kernel"):
        monkeypatch.setattr(launch, name, Paused(getattr(launch, name), recorder))
    for method in ("update", "attend"):
        original = getattr(CompressedCache, method)

        def recorded(self, *args, _original=original, **kwargs):
            recorder.on = True
            try:
                return _original(self, *args, **kwargs)
            finally:
                recorder.on = False

        monkeypatch.setattr(CompressedCache, method, recorded)
    ids = torch.randint(1, 256, (2, context), generator=rng)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, attention_mask=mask, cache=cache)  # the prompt on the torch path (faster)
        # the small constant tables of the norm writer are cached per bit offset in a byte (8
        # offsets) and built on first use: WARM_STEPS torch-path steps build them all; then the
        # first Triton step grows the buffers and the second is measured
        for step in range(WARM_STEPS + 2):
            cache.set_backend("torch" if step < WARM_STEPS else "triton")
            recorder.ops = []
            capacities = [layer.reserved_nbytes() for layer in cache.layers]
            next_id = torch.randint(1, 256, (2, 1), generator=rng)
            mask = torch.cat([mask, torch.ones_like(next_id)], 1)
            with recorder:
                model(next_id, attention_mask=mask, cache=cache)
        assert capacities == [layer.reserved_nbytes() for layer in cache.layers]
    monkeypatch.undo()
    return recorder.ops


def test_a_decode_step_does_no_torch_work_that_grows_with_the_context(rng, monkeypatch):
    model = tiny_model("llama", int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    config = preset_config("rq-3.5", model)
    short = one_decode_step(model, config, 40, rng, monkeypatch)
    long = one_decode_step(model, config, 200, rng, monkeypatch)
    assert short, "nothing was recorded"
    assert [op for op, _ in short] == [op for op, _ in long]
    grown = [(op, a, b) for (op, a), (_, b) in zip(short, long) if a != b]
    print(
        f"{len(short)} operations per decode step; largest tensor {max(max(s) for _, s in short)}"
    )
    assert not grown, grown[:5]
