"""Per-layer bit allocation: the knapsack is exact, budgets hold, resolution is cached.

Random inputs come from ``rng``; the knapsack and budget checks are exact for any draw. The one
statistic (the relative error of 8- and 6-bit codes) states its margin where it asserts it and
is audited over random seeds (``make test-seeds``).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_hf import ByteTokenizer, seed_of, tiny_model

from rqlib.core.quantizers import make_quantizer
from rqlib.hf import compress
from rqlib.spec.bits import average_bits
from rqlib.spec.config import CompressionConfig
from rqlib.study import allocation
from rqlib.study.allocation import Sensitivity, allocate, resolve


def test_knapsack_matches_brute_force(rng):
    generator = random.Random(seed_of(rng))
    for _ in range(30):
        groups = [
            [(generator.randint(1, 6), generator.random(), label) for label in range(3)]
            for _ in range(4)
        ]
        capacity = generator.randint(4, 20)
        feasible = [
            combo
            for combo in itertools.product(*groups)
            if sum(cost for cost, _, _ in combo) <= capacity
        ]
        if not feasible:
            with pytest.raises(ValueError, match="no allocation"):
                allocation._knapsack(groups, capacity)
            continue
        best = min(sum(value for _, value, _ in combo) for combo in feasible)
        labels = allocation._knapsack(groups, capacity)
        chosen = [next(o for o in group if o[2] == label) for group, label in zip(groups, labels)]
        assert sum(cost for cost, _, _ in chosen) <= capacity
        # float sums of 4 terms in different orders
        assert sum(value for _, value, _ in chosen) == pytest.approx(best, abs=1e-12)


def _table(n_layers: int, sensitive: int, rng: torch.Generator) -> Sensitivity:
    """KL = scale * 4^-bits per item; layer ``sensitive``'s keys 100x more than the rest."""
    kl = {}
    for layer in range(n_layers):
        for kind, options in (("key", allocation.KEY_BITS), ("value", allocation.VALUE_BITS)):
            scale = float(torch.rand(1, generator=rng)) + 0.5
            if kind == "key" and layer == sensitive:
                scale *= 100
            for bits in options:
                kl[(kind, layer, bits)] = scale * 4.0**-bits
    base = allocation._base_of(CompressionConfig.parse("turboquant-mse:sink1:win4")).spec()
    return Sensitivity(base, "0", n_layers, {}, 16, 0, kl)


@pytest.mark.parametrize("budget", [2.6, 3.0, 3.5])
def test_allocation_spends_at_most_the_budget_where_it_matters(budget, rng):
    model = tiny_model("llama", seed_of(rng))
    n_layers = model.config.num_hidden_layers
    sensitive = int(torch.randint(0, n_layers, (1,), generator=rng))
    table = _table(n_layers, sensitive, rng)
    config = CompressionConfig.parse(f"turboquant-mse:b3:sink1:win4:alloc={budget}")
    resolved = allocate(table, config, model.config)
    assert resolved.budget is None
    assert average_bits(resolved, model.config)["mean"] <= budget + 1e-9
    assert [layer for layer, _ in resolved.layer_key_bits] == list(range(n_layers))
    assert [layer for layer, _ in resolved.layer_value_bits] == list(range(n_layers))
    key_bits = [resolved.key_bits_of(layer) for layer in range(n_layers)]
    assert key_bits[sensitive] == max(key_bits)
    # every item's KL falls with its bits, so an optimal allocation leaves no room for even one
    # more bit on any item that could take one
    for field, options in (
        ("layer_key_bits", allocation.KEY_BITS),
        ("layer_value_bits", allocation.VALUE_BITS),
    ):
        for layer, bits in getattr(resolved, field):
            if bits < max(options):
                more = dict(getattr(resolved, field)) | {layer: bits + 1}
                bigger = resolved.replace(**{field: tuple(sorted(more.items()))})
                assert average_bits(bigger, model.config)["mean"] > budget
    # the objective it minimised is no larger than that of the cheapest uniform config,
    # which also fits the budget
    cheapest = config.replace(budget=None, key_bits=2, value_bits=1)
    assert average_bits(cheapest, model.config)["mean"] <= budget
    assert table.predicted_kl(resolved) <= table.predicted_kl(cheapest)
    with pytest.raises(ValueError, match="below the cheapest"):
        allocate(table, config.replace(budget=1.0), model.config)
    with pytest.raises(ValueError, match="layers"):
        allocate(_table(n_layers + 1, 0, rng), config, model.config)


def test_unresolved_budgets_are_refused():
    config = CompressionConfig.parse("turboquant-mse:b3:alloc=3")
    assert config.budget == 3.0 and CompressionConfig.parse(config.spec()) == config
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="resolved"):
        average_bits(config, LlamaConfig(num_hidden_layers=2))
    for spec, message in [
        ("turboquant-prod:k3:v3:alloc=3", "-mse methods"),
        ("turboquant-mse:v=fp:alloc=3", "compress values"),
        ("turboquant-mse:b3:alloc=x", "number of bits"),
        ("turboquant-mse:b3:alloc=20", "budget"),
    ]:
        with pytest.raises(ValueError, match=message):
            CompressionConfig.parse(spec)
    with pytest.raises(ValueError, match="exact="):
        allocation._base_of(CompressionConfig.parse("turboquant-mse:b3:exact=0:alloc=3"))


@pytest.mark.randomized
def test_a_table_ignores_only_near_exact_formats(rng, record_statistic):
    # A sensitivity table serves configs that differ from its base only by formats too fine to
    # move it: 11-bit norms and a band of 8-bit codes. Anything else is a different base.
    spec = "turboquant-mse:b3:sink1:win64:ctr:nc:alloc=3"
    base = allocation._base_of(CompressionConfig.parse(spec))
    for extra, same in [("nm=6", True), ("wb=8", True), ("wb=6", False), ("ks", False)]:
        assert (allocation._base_of(CompressionConfig.parse(f"{spec}:{extra}")) == base) == same
    # ...because 8-bit codes are that fine: the relative error of a vector (rms over 2000
    # Gaussian vectors, d = 64) is ~0.6 % at 8 bits (bound 1 %) and ~2.6 % at 6 bits. Each is
    # the rms of 2000 independent per-vector errors whose relative sd is about 0.2 (d = 64
    # coordinates' errors averaged), so the rms has relative sd ~0.2 / sqrt(2000) = 0.5 %:
    # both margins (0.6 vs 1, 2.6 vs 2) exceed 20 sd, no false failure (the audit measures them)
    x = torch.randn(2000, 64, generator=rng)

    def relative_error(bits: int) -> float:
        quantizer = make_quantizer("turboquant-mse", 64, bits, draw=seed_of(rng))
        x_hat = quantizer.dequantize(quantizer.quantize(x))
        return ((x_hat - x).norm(dim=-1) / x.norm(dim=-1)).pow(2).mean().sqrt().item()

    record_statistic(
        "8-bit rms relative error", relative_error(allocation.NEAR_EXACT_BAND_BITS), 0.01
    )
    record_statistic("6-bit rms relative error", relative_error(6), 0.02, at_least=True)


def test_the_command_measures_for_the_presets_by_default(monkeypatch, tmp_path):
    # `python -m rqlib allocate --model M` must measure the table the presets will look up
    from rqlib.cli import main
    from rqlib.spec.config import get_preset

    class Measured(Exception):
        pass

    def capture(model, tokenizer, config, **kwargs):
        raise Measured(config)

    monkeypatch.setattr(allocation, "load_model", lambda name: (None, None))
    monkeypatch.setattr(allocation, "measure_sensitivity", capture)
    for argv, expected in [
        ([], get_preset("rq-3.5")),
        (["--base", "turboquant-mse:win8"], CompressionConfig.parse("turboquant-mse:win8")),
    ]:
        with pytest.raises(Measured) as measured:
            main(["allocate", "--json", str(tmp_path / "t.json"), *argv])
        config = measured.value.args[0]
        assert allocation._base_of(config) == allocation._base_of(expected)


def test_resolve_measures_once_then_reads_the_cache(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("RQLIB_CACHE", str(tmp_path))
    model = tiny_model("llama", seed_of(rng))
    tokenizer = ByteTokenizer()
    config = CompressionConfig.parse("turboquant-mse:ctr:ctok=64:alloc=2.9").replace(name="mine")
    calls = []
    measure = allocation.measure_sensitivity

    def counting(*args, **kwargs):
        calls.append(1)
        return measure(
            *args,
            tokens=32,
            progress=False,
            **{k: v for k, v in kwargs.items() if k not in ("tokens", "progress")},
        )

    monkeypatch.setattr(allocation, "measure_sensitivity", counting)
    first = resolve(config, model, tokenizer, progress=False)
    second = resolve(config, model, tokenizer, progress=False)
    assert len(calls) == 1 and first == second and first.name == "mine"
    assert list((tmp_path / "allocations").glob("sensitivity-*.json"))
    table = allocation.find_sensitivity(model, config)
    n_layers = model.config.num_hidden_layers
    assert set(table.kl) == {
        (kind, layer, bits)
        for layer in range(n_layers)
        for kind, options in (("key", allocation.KEY_BITS), ("value", allocation.VALUE_BITS))
        for bits in options
    }
    # a KL is >= 0; fp32 log-probabilities of nearly equal distributions give ~1e-7 either side
    assert all(value > -1e-5 for value in table.kl.values())
    # compress() takes resolved configs only: a budget is refused with the step to take
    with pytest.raises(ValueError, match="rqlib.study.allocation.resolve"):
        with compress(model, config, tokenizer=tokenizer):
            pass
