"""A decoded copy of the codes (``CompressedCache.keep_decoded``): the same numbers, bit for bit.

On CPU the attention can read each stored key's and value's codebook values and norm from a copy
written once per token, instead of decoding every stored code at every step. The copy must
change nothing but the time: decode steps give logits equal bit for bit to the cache without it
(tiny Llama, Gemma 3 with sliding windows that evict, Qwen2 with GQA; enough tokens that the
recent band and the windows wrap around their rings), whether the copy is kept from the first
token or turned on part-way. Equality alone could be vacuous (an attention that never reads the
copy passes it), so the copy is also corrupted and the logits must move.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ByteTokenizer, preset_config, tiny_model

from rqlib.hf import compress

# 96 positions: the band (64 tokens) and Gemma 3's windows (6) wrap around their rings
PREFILL, STEPS = 70, 26


def seed_of(rng) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


def decode(model, config, ids, *, copy_from: int | None, corrupt: bool = False):
    """Prefill ``PREFILL`` tokens, then feed the rest one at a time; the logits of every step.
    ``copy_from``: the step (0 = before the prefill) at which the decoded copy is turned on, or
    ``None``. ``corrupt``: add noise to every decoded copy after the prefill."""
    logits = []
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        cache.keep_decoded(copy_from == 0)
        model(ids[:, :PREFILL], cache=cache)
        for step in range(STEPS):
            if copy_from is not None and step == copy_from and step > 0:
                cache.keep_decoded(True)
            if corrupt and step == 0:
                for layer in cache.layers:
                    for stream in layer.streams.values():
                        for ring in stream.rings:
                            if ring.has_decoded:
                                ring.buffers["decoded"].add_(0.05)
            token = ids[:, PREFILL + step : PREFILL + step + 1]
            logits.append(model(token, cache=cache).logits)
    return torch.cat(logits, 1)


#: The corrupted copy must move some logit by more than this. Over 200 random seeds of each of
#: the three models (tests/audit/randomized-200-decoded-copy.txt, ``make test-seeds``) the
#: largest move was at least 0.21 and at the median 0.36-0.42: the bound lies 200 times below
#: the smallest draw seen, a margin no draw of a correct cache comes near (an attention that
#: ignored the copy would move nothing, 0).
MOVED = 1e-3


@pytest.mark.randomized
@pytest.mark.parametrize(
    ("kind", "preset"), [("llama", "rq-3.5"), ("gemma3", "rq-2.5"), ("qwen2", "rq-3")]
)
def test_decode_steps_read_the_copy_and_give_the_same_logits_bit_for_bit(
    kind, preset, rng, record_statistic
):
    model = tiny_model(kind, seed_of(rng))
    config = preset_config(preset, model)
    ids = torch.randint(1, 256, (1, PREFILL + STEPS), generator=rng)
    without = decode(model, config, ids, copy_from=None)
    assert torch.equal(decode(model, config, ids, copy_from=0), without)
    assert torch.equal(decode(model, config, ids, copy_from=STEPS // 2), without)
    corrupted = decode(model, config, ids, copy_from=0, corrupt=True)
    moved = (corrupted - without).abs().max().item()
    print(f"{kind} {preset}: largest logit change with a corrupted copy {moved:.3g}")
    # the attention reads the copy (the noise is 0.05 per coordinate)
    record_statistic("largest logit change with a corrupted copy", moved, MOVED, at_least=True)


def test_the_copy_is_not_counted_as_stored_and_is_reserved_at_its_size(rng):
    """``nbytes`` counts what is stored compressed, with or without the copy;
    ``reserved_nbytes`` grows by the copy's size: float32 codebook values and a float32 norm
    per slot, KV head and packed stream; dropping the copy frees it."""
    model = tiny_model("llama", seed_of(rng))
    config = preset_config("rq-3", model)
    ids = torch.randint(1, 256, (1, 40), generator=rng)
    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        stored, reserved = cache.nbytes(), cache.reserved_nbytes()
        cache.keep_decoded(True)
        expected = 0
        for layer in cache.layers:
            for stream in layer.streams.values():
                for ring in stream.rings:
                    if ring.packed:
                        slots = ring.batch * ring.heads * ring.capacity
                        expected += slots * 4 * (ring.quantizer.rotated_dim + 1)
        assert expected > 0
        assert cache.nbytes() == stored
        assert cache.reserved_nbytes() == reserved + expected
        cache.keep_decoded(False)
        assert cache.reserved_nbytes() == reserved
        with pytest.raises(TypeError, match="True or False"):
            cache.keep_decoded("yes")


def test_a_copy_that_fails_to_build_leaves_every_stream_as_it_was(rng, monkeypatch):
    """Turning the copy on decodes the stored tokens; if that fails part-way (at a random ring,
    after the rings and layers before it got their copies), no stream is left with a copy:
    neither a partial one, which attention would read as if it were whole, nor a whole one
    that the cache does not count as kept."""
    from rqlib.kernels import store

    model = tiny_model("llama", seed_of(rng))
    config = preset_config("rq-3", model)
    # inside and beyond the recent band: with the band stored once, a main stream holds
    # tokens only beyond it
    length = int(torch.randint(20, 2 * config.recent_window, (1,), generator=rng))
    ids = torch.randint(1, 256, (1, length), generator=rng)
    real_write = store.VectorRing._write
    written = []

    def failing_write(ring, start, fields):
        if "decoded" in fields:
            written.append(ring)
            if len(written) == fail_at:
                raise RuntimeError("out of memory (simulated)")
        return real_write(ring, start, fields)

    with torch.no_grad(), compress(model, config, tokenizer=ByteTokenizer()) as cache:
        model(ids, cache=cache)
        reserved = cache.reserved_nbytes()
        rings = [r for layer in cache.layers for s in layer.streams.values() for r in s.rings]
        holding = [r for r in rings if r.packed and r.end > 0]
        fail_at = int(torch.randint(1, len(holding) + 1, (1,), generator=rng))
        monkeypatch.setattr(store.VectorRing, "_write", failing_write)
        with pytest.raises(RuntimeError, match="simulated"):
            cache.keep_decoded(True)
        assert len(written) == fail_at
        assert not any(r.has_decoded or "decoded" in r.buffers for r in rings)
        assert cache.reserved_nbytes() == reserved
        assert not any(layer.decoded_copy for layer in cache.layers)
