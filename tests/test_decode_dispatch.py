"""One decode step of a compressed model, counted op by op (Triton path, interpreted).

Every aten operation issued by the cache's ``update`` and ``attend`` during one decode step is
recorded with a ``TorchDispatchMode``, and every Triton launch is counted, at two context
lengths, for every layer of a tiny Llama in the presets' format with a left-padded batch of
two. What a CUDA graph cannot capture, or what makes a step's cost grow with the context, must
not be there:

- an operation that reads a device value back to the host (``.item()``, ``bool(tensor)``,
  ``.tolist()``: ``_local_scalar_dense``; ``nonzero``), or a tensor built from host data
  (``torch.tensor(list)``: ``lift_fresh``), which on a GPU is a host-to-device copy;
- an operation, allocations included, whose tensors differ in size between the two contexts:
  between them the stored buffers have different capacities, so one that read, wrote or
  allocated something the size of the cache would show it.

Launches per layer (Triton kernels and torch operations that compute, which on a GPU are kernel
launches too) are printed; the Triton launches per layer are bounded by what the step needs
today (quantize per stored stream, attention and reduce). Out of scope: what transformers does
around the cache (mask building, the model's projections) and view operations (slicing a
buffer reads nothing). Layer constants are copied to the device once
(``numerics.stream_constants``; checked below) and not per step.
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

#: operations that read a device value back to the host (a synchronization on a GPU) or build
#: a tensor from host data (a host-to-device copy on a GPU)
SYNCHRONIZING = {"_local_scalar_dense", "nonzero", "item", "is_nonzero", "lift_fresh"}
#: what one layer's decode step may launch in Triton: a quantize per stored stream (keys,
#: values, the recent band's keys and values), the attention and its reduce
TRITON_LAUNCHES_PER_LAYER = 6


class Recorder(TorchDispatchMode):
    """Records (operation, sizes of its tensor arguments and results) while ``on``, and counts
    Triton launches by kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops: list[tuple[str, tuple[int, ...]]] = []
        self.launches: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and not func.is_view:
            tensors = [
                t
                for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor)
            ]
            self.ops.append((str(func), tuple(t.numel() for t in tensors)))
        return out


class Paused:
    """A Triton kernel whose launches are counted, not recorded op by op."""

    def __init__(self, kernel, name: str, recorder: Recorder) -> None:
        self.kernel, self.name, self.recorder = kernel, name, recorder

    def __getitem__(self, grid):
        def launch_kernel(*args, **kwargs):
            was, self.recorder.on = self.recorder.on, False
            if was:
                launches = self.recorder.launches
                launches[self.name] = launches.get(self.name, 0) + 1
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.recorder.on = was

        return launch_kernel


WARM_STEPS = 8


def one_decode_step(model, config, context: int, rng, monkeypatch) -> list:
    """The operations of the cache during one decode step after ``context`` tokens."""
    recorder = Recorder()
    for name in ("attention_kernel", "reduce_kernel", "quantize_kernel"):
        monkeypatch.setattr(launch, name, Paused(getattr(launch, name), name, recorder))
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
            recorder.ops, recorder.launches = [], {}
            capacities = [layer.reserved_nbytes() for layer in cache.layers]
            next_id = torch.randint(1, 256, (2, 1), generator=rng)
            mask = torch.cat([mask, torch.ones_like(next_id)], 1)
            with recorder:
                model(next_id, attention_mask=mask, cache=cache)
        assert capacities == [layer.reserved_nbytes() for layer in cache.layers]
    monkeypatch.undo()
    return recorder


def test_a_decode_step_synchronizes_nothing_and_does_no_work_that_grows_with_the_context(
    rng, monkeypatch
):
    model = tiny_model("llama", int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    config = preset_config("rq-3.5", model)
    # both contexts longer than the recent band: with the band stored once, a context inside it
    # has no token in the main codes yet, and its steps code none
    assert config.recent_window < 100
    short = one_decode_step(model, config, 100, rng, monkeypatch)
    long = one_decode_step(model, config, 260, rng, monkeypatch)
    assert short.ops, "nothing was recorded"
    layers = model.config.num_hidden_layers
    computing = [op for op, _ in short.ops if not op.startswith("aten.empty")]
    print(
        f"per layer and decode step: {sum(short.launches.values()) / layers:g} Triton launches "
        f"({short.launches}), {len(computing) / layers:g} torch operations; largest tensor "
        f"{max(max(s, default=0) for _, s in short.ops)}"
    )
    synchronizing = [op for op, _ in short.ops + long.ops if op.split(".")[1] in SYNCHRONIZING]
    assert not synchronizing, synchronizing
    assert [op for op, _ in short.ops] == [op for op, _ in long.ops]
    grown = [(op, a, b) for (op, a), (_, b) in zip(short.ops, long.ops) if a != b]
    assert not grown, grown[:5]
    assert short.launches == long.launches
    assert sum(short.launches.values()) <= TRITON_LAUNCHES_PER_LAYER * layers


def test_the_checks_can_fail(rng, monkeypatch):
    """The recorder sees a synchronizing read and an allocation the size of the cache: a launch
    that reads a device value back and allocates by the context shows both."""
    model = tiny_model("llama", int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    config = preset_config("rq-3.5", model)
    original = launch.attention
    ends = []

    def careless(state, q, *args):
        ends.append(state.end)
        torch.zeros(state.end, device=q.device).sum().item()  # grows, and synchronizes
        return original(state, q, *args)

    monkeypatch.setattr(launch, "attention", careless)
    recorded = one_decode_step(model, config, 40, rng, monkeypatch)
    assert any(op.split(".")[1] in SYNCHRONIZING for op, _ in recorded.ops)
    assert ("aten.zeros.default", (ends[-1],)) in recorded.ops


def test_layer_constants_are_copied_to_the_device_once(rng):
    """``numerics.stream_constants`` returns the same tensors at every call (one copy per
    tensor and device, kept while the tensor lives), so a launch copies nothing."""
    from rqlib.kernels import numerics

    model = tiny_model("llama", int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    config = preset_config("rq-3.5", model)
    ids = torch.randint(1, 256, (1, 8), generator=rng)
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        stream = cache.layers[0].streams["keys"]
        first = numerics.stream_constants(stream, "cpu")
        again = numerics.stream_constants(stream, "cpu")
    assert first.rotation is again.rotation
    assert all(
        (a is b) for a, b in zip(vars(first).values(), vars(again).values()) if a is not None
    )
