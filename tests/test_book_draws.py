"""Repeated draws of a sweep's settings (rqlib.book.draws): the median and range of each
setting, and which pairs of settings the ranges tell apart, on frames whose answers are known.

The random draws (``rng``) fill frames whose answers hold for any values drawn, so no test here
fails by chance (false-failure rate 0).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from rqlib.book.draws import noise_numbers, repeated_draws, told_apart

KEYS = ["key_bits", "method", "exact_window"]


def sweep(values: dict[tuple, list[float]]) -> pd.DataFrame:
    """Runs of a sweep: for each setting (bits, method, window), one run per value, seeds 0..."""
    rows = []
    for (bits, method, window), draws in values.items():
        for seed, value in enumerate(draws):
            rows.append(dict(key_bits=bits, method=method, exact_window=window, draw=seed, d=value))
    return pd.DataFrame(rows)


def test_each_setting_is_the_median_and_range_of_its_draws(rng):
    draws = torch.rand(4, 3, generator=rng).tolist()
    runs = sweep({(b, "mse", 0): draws[b] for b in range(4)}).sample(frac=1, random_state=0)
    summary = repeated_draws(runs, "d", KEYS, "draw")
    assert list(summary["key_bits"]) == [0, 1, 2, 3] and set(summary["n_draws"]) == {3}
    for b, values in enumerate(draws):
        row = summary[summary["key_bits"] == b].iloc[0]
        assert row["median"] == sorted(values)[1]
        assert (row["low"], row["high"]) == (min(values), max(values))


def test_without_draws_every_run_is_a_setting_of_one():
    runs = sweep({(3, "mse", 0): [2.0], (3, "prod", 0): [5.0]})
    for draws in (None, "draw", "not a column"):
        summary = repeated_draws(runs, "d", KEYS, draws)
        assert list(summary["median"]) == list(summary["low"]) == [2.0, 5.0]
        assert set(summary["n_draws"]) == {1}
    numbers = noise_numbers(summary, "d", *KEYS)
    assert numbers["n_draws"] == 1 and "drawn once" in numbers["spread_phrase"]


def test_a_draw_twice_or_settings_with_unequal_draws_are_refused():
    runs = sweep({(3, "mse", 0): [1.0, 2.0], (3, "prod", 0): [1.0, 2.0]})
    twice = pd.concat([runs, runs.iloc[:1]])
    with pytest.raises(ValueError, match="has a value of 'draw' twice"):
        repeated_draws(twice, "d", KEYS, "draw")
    with pytest.raises(ValueError, match="different numbers of 'draw' draws"):
        repeated_draws(runs.iloc[:-1], "d", KEYS, "draw")
    with pytest.raises(ValueError, match="no 'draw' tells them apart"):
        repeated_draws(twice.drop(columns="draw"), "d", KEYS, "draw")
    with pytest.raises(ValueError, match="no column"):
        repeated_draws(runs, "kl", KEYS, "draw")


def test_only_pairs_whose_ranges_do_not_overlap_are_told_apart():
    # at 2 bits: mse [1, 3] and prod [2, 4] overlap, rotor [5, 6] is apart from both;
    # at 3 bits: mse [1, 2] and prod [2.5, 3] are apart; different bits are never compared
    runs = sweep(
        {
            (2, "mse", 0): [1.0, 3.0, 2.0],
            (2, "prod", 0): [2.0, 4.0, 3.0],
            (2, "rotor", 0): [5.0, 6.0, 5.5],
            (3, "mse", 0): [1.0, 2.0, 1.5],
            (3, "prod", 0): [2.5, 3.0, 2.75],
        }
    )
    summary = repeated_draws(runs, "d", KEYS, "draw")
    assert told_apart(summary, "method", ["key_bits", "exact_window"]) == (3, 4)
    # the check can fail: widen 3-bit mse to reach 2.5 and that pair is no longer apart
    runs.loc[(runs["key_bits"] == 3) & (runs["method"] == "mse") & (runs["draw"] == 1), "d"] = 2.5
    summary = repeated_draws(runs, "d", KEYS, "draw")
    assert told_apart(summary, "method", ["key_bits", "exact_window"]) == (2, 4)
    numbers = noise_numbers(summary, "d", *KEYS)
    assert numbers["n_draws"] == 3
    assert (
        "of the 4 pairs of method values at the same key_bits and exact_window, 2 do"
        in (numbers["apart_phrase"])
    )
    assert "at the widest (key_bits = 2, method = mse, exact_window = 0" in numbers["spread_phrase"]


def test_the_spread_is_told_in_the_metric_s_own_name(rng):
    """The page names a metric as its tables do (``results.metric_label``), not by its column:
    ΔPPL % for ``delta_ppl_pct``, and a column with no label by itself."""
    draws = (torch.rand(2, 3, generator=rng) + 1).tolist()
    runs = sweep({(b, "mse", 0): draws[b] for b in range(2)})
    for column, name in (("delta_ppl_pct", "ΔPPL %"), ("kl", "KL (nats)"), ("d", "d")):
        summary = repeated_draws(runs.rename(columns={"d": column}), column, KEYS, "draw")
        phrase = noise_numbers(summary, column, *KEYS)["spread_phrase"]
        assert phrase.startswith(f"Their range, in {name}, is "), phrase
