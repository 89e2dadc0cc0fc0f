"""The path a user runs: ``generate()`` through the fused attention, on tiny random models.

The presets' storage format (TurboQuant-MSE keys and values, per-head key centering on pydoc,
norm correction, 11-bit norms, first token exact, the recent band as 8-bit codes) with per-layer
bits chosen by the presets' own allocation (:func:`rqlib.study.allocation.allocate`) from a
synthetic sensitivity table (a tiny random model has no measured one), on Llama (GQA 2:1),
Gemma 3 (sliding-window layers, which evict) and Qwen2 (GQA 7:1), with a left-padded batch of
two. The Triton kernels run in the interpreter (``cache.set_backend("triton")``: the attention
kernel and the quantize kernel) and must give the same tokens as the torch path.

Which presets. The prompt and the tokens generated fit in the recent band, so attention reads
the sink and the band, and what a preset's bits change is the codes the quantize kernel writes
for each stream (compared byte by byte below). The presets at the two ends of the bit range,
:data:`ENDS`, write between them every bit width of keys and of values and every recent window
that any preset writes on these models (checked by
``test_the_end_presets_store_every_format_of_the_others``), so the presets in between run no
code that the two ends do not; each end runs on every architecture.

Codebooks. The attention kernel reads the codebook rounded to fp16 (rqlib.kernels.numerics),
the torch path the float32 one; here both read the rounded one (every quantizer the presets
build is replaced by ``numerics.kernel_quantizer`` of itself), so that they compute the same
sums. tests/test_kernels_attention.py checks the kernel on the float32 codebooks against the
reference read with the kernel's.

Logit tolerance. Both paths compute the same sums in fp32 in different orders: attention outputs
agree to ~1e-6 relative (tests/test_kernels_attention.py measures ~4e-7), which a few layers of a
random model with logits of magnitude ~1 amplify to well under 1e-4; a code that flips at a
decision boundary between the two paths (a key within ~1e-7 of a boundary) would move a logit
by up to ~1e-2 instead (measured: one flipped byte, 3e-4). So the logits must agree within
1e-4 when every stored byte is identical, and within 1e-2 when a code flipped; the tokens must
be identical either way, up to a step where the torch path's best two logits are within twice
that tolerance (a near tie, ``tests/greedy.py``), and the logits agree up to that step.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from greedy import assert_same_greedy_generation
from tiny_models import KINDS, VOCAB, ByteTokenizer, preset_config, tiny_model

from rqlib.hf import compress
from rqlib.kernels import launch, numerics
from rqlib.kernels.limits import StreamFormat, attention_formats
from rqlib.spec import codecs
from rqlib.spec.presets import PRESETS

pytestmark = pytest.mark.interpreter

LOGIT_TOL = 1e-4
FLIPPED_CODE_TOL = 1e-2

#: tokens generated after the prompt
NEW_TOKENS = 4
#: the presets at the two ends of the bit range (fewest and most bits)
ENDS = ("rq-2", "rq-3.5")


@pytest.fixture(autouse=True)
def kernel_codebooks(monkeypatch):
    """Every quantizer a config builds decodes with the kernel's codebook, in both paths."""
    original = codecs._quantizer
    monkeypatch.setattr(
        codecs, "_quantizer", functools.cache(lambda *a: numerics.kernel_quantizer(original(*a)))
    )


#: the compile-time arguments that describe a layer's storage format
FORMAT_KEYS = {
    *attention_formats(64, StreamFormat(exact=True), StreamFormat(exact=True)),
    "SOFTCAP",
}


def stored_codes(cache) -> list[torch.Tensor]:
    """Every stored code and norm byte of every layer (to see whether a code flipped)."""
    out = []
    for layer in cache.layers:
        for stream in layer.streams.values():
            for ring in stream.rings:
                out.extend(t.clone() for name, t in sorted(ring.buffers.items()) if name != "exact")
    return out


class Specializations:
    """Stands in for ``launch.attention_kernel`` and records, per launch, the layer format it
    serves (the format's compile-time arguments, the dtype of its exact vectors) and what it
    would compile: every compile-time argument and option."""

    def __init__(self, kernel) -> None:
        self.kernel, self.compiled, self.formats = kernel, set(), set()

    def __getitem__(self, grid):
        def launch_(**kwargs):
            names = set(inspect.signature(self.kernel.fn).parameters)
            run_time = {k for k in kwargs if k in names and not _is_constexpr(self.kernel, k)}
            compile_time = tuple(sorted((k, v) for k, v in kwargs.items() if k not in run_time))
            dtype = kwargs["sink_k_ptr"].dtype
            self.compiled.add((compile_time, dtype))
            self.formats.add((tuple((k, v) for k, v in compile_time if k in FORMAT_KEYS), dtype))
            return self.kernel[grid](**kwargs)

        return launch_


def _is_constexpr(kernel, name: str) -> bool:
    return "constexpr" in str(inspect.signature(kernel.fn).parameters[name].annotation)


def run(model, config, ids, mask, backend: str):
    options = dict(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        cache.set_backend(backend)
        out = model.generate(ids, attention_mask=mask, cache=cache, **options)
        codes = stored_codes(cache)
    return out.sequences, torch.stack(out.logits, 1), codes


def stored_formats(config) -> set[tuple[str, int]]:
    """What the quantize kernel writes for a config: each stream's bit widths, and the recent
    window."""
    return (
        {("keys", bits) for _, bits in config.layer_key_bits}
        | {("values", bits) for _, bits in config.layer_value_bits}
        | {("recent_window", config.recent_window)}
    )


@pytest.mark.parametrize("kind", KINDS)
def test_the_end_presets_store_every_format_of_the_others(kind):
    model = tiny_model(kind, 0)
    ends = set().union(*(stored_formats(preset_config(name, model)) for name in ENDS))
    for name in sorted(PRESETS):
        missing = stored_formats(preset_config(name, model)) - ends
        assert not missing, f"{name} on {kind} stores {sorted(missing)}, which {ENDS} do not"


@pytest.mark.parametrize("preset", ENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_generate_through_the_kernels_matches_the_torch_path(kind, preset, rng):
    model = tiny_model(kind, int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    config = preset_config(preset, model)
    assert len(set(config.layer_key_bits + config.layer_value_bits)) > 1
    ids = torch.randint(1, VOCAB, (2, 7), generator=rng)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row is left-padded by 3 tokens
    assert ids.shape[1] + NEW_TOKENS <= config.recent_window  # what ENDS relies on
    specializations = assert_kernels_generate_as_torch(model, config, ids, mask)
    # one specialization per layer format, for the prompt and every decode step alike: none
    # per context length or step kind
    compiled, formats = specializations.compiled, specializations.formats
    print(f"{len(compiled)} specializations for {len(formats)} layer formats")
    assert len(compiled) == len(formats) >= 1


def assert_kernels_generate_as_torch(model, config, ids, mask) -> Specializations:
    """Generate on the torch path and through the kernels: the same tokens and logits within
    the tolerances of the module doc. Returns the attention kernel's launches."""
    tokens, logits, codes = run(model, config, ids, mask, "torch")
    specializations = Specializations(launch.attention_kernel)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "attention_kernel", specializations)
        kernel_tokens, kernel_logits, kernel_codes = run(model, config, ids, mask, "triton")
    flipped = sum(int((a != b).sum()) for a, b in zip(codes, kernel_codes))
    tol = LOGIT_TOL if flipped == 0 else FLIPPED_CODE_TOL
    prompt = ids.shape[1]
    difference = assert_same_greedy_generation(
        kernel_tokens[:, prompt:], tokens[:, prompt:], kernel_logits, logits, tol
    )
    print(f"max logit difference {difference:.2e}; stored bytes that differ: {flipped}")
    return specializations


def test_a_config_the_kernel_cannot_serve_is_refused_when_built_on_cuda(rng, monkeypatch):
    # the model's device decides; on a CPU-only machine the check is reached by saying "cuda"
    from rqlib.hf import integration

    model = tiny_model("llama", int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    monkeypatch.setattr(integration, "_on_cuda", lambda model: True)
    with pytest.raises(ValueError, match="outlier channel split"):
        with compress(model, "turboquant-mse:k3:v3:ko8:ctok=256", tokenizer=ByteTokenizer()):
            pass
    assert model.config._attn_implementation == "sdpa"
    with compress(model, preset_config("rq-3", model), tokenizer=ByteTokenizer()):
        pass  # the presets' format is served


@pytest.mark.parametrize("kind", ("llama", "gemma3"))
def test_generate_with_trellis_codes_through_the_kernels_matches_the_torch_path(kind, rng):
    """The presets' format with tail-biting trellis codes (``tcq:tb``) and a recent band of 4
    tokens, so that the prompt and every generated token leave the band for the main streams,
    where the attention kernel reads the trellis's shift registers (the kernels' path searches
    the trellis with its encoder kernel, the torch path in torch). Tolerances as for the
    presets (module doc): a Viterbi path may also change where the two paths' hidden states
    differ by rounding."""
    model = tiny_model(kind, int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    config = preset_config("rq-3", model).replace(
        recent_window=4, trellis_state_bits=10, trellis_tail_biting=True
    )
    ids = torch.randint(1, VOCAB, (2, 7), generator=rng)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    specializations = assert_kernels_generate_as_torch(model, config, ids, mask)
    read = {dict(layout)["k_trellis_tail_biting"] for layout, _ in specializations.formats}
    assert read == {1}, "the attention kernel did not read tail-biting trellis keys"
