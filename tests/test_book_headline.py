"""The side-by-side on held-out text: tables, targets and the Pareto front of chapter 4.

The frames are built by hand (the columns :func:`rqlib.book.loaders.load_headline` returns) with
random numbers, so each test knows the answer; the committed files are read by chapter 4 and
by ``tests/test_book_loaders.py``. The answers hold for any numbers drawn (``rng``), so no test
here fails by chance.
"""

import math

import matplotlib
import pandas as pd
import pytest
import torch

from rqlib.book import loaders
from rqlib.book.figures.perplexity import headline_figure, pareto_front
from rqlib.spec.presets import PEER_TARGETS, TARGETS

matplotlib.use("Agg")

PEERS = ("hf-quanto:int4", "hf-quanto:int2")


def row(method, kind, mode, bits, kl, windows, file, window=1024):
    return {
        "method": method,
        "kind": kind,
        "mode": mode,
        "bits_mean": bits,
        "kl": kl,
        "delta_ppl_pct": 100 * math.expm1(kl),  # any number that moves with the KL
        "perplexity": 20 * math.exp(kl),
        "top1": 1 - kl,
        "windows": windows,
        "window": window,
        "seconds_per_token": 0.01 if mode == "prefill" else 0.2,
        "short": "smollm2",
        "file": file,
    }


def frame_for(rng, ours_kl: dict, peers_kl: dict, windows=8, window=1024):
    """A frame like ``headline_frame()``: ours and the peers in one forward (the peers at KL 0),
    the peers token by token in another file."""
    prefill = f"headline/smollm2-prefill-w{window}.json"
    decode = f"headline/smollm2-decode-w{window}.json"
    rows = [row("fp", "fp", "prefill", 16.0, 0.0, windows, prefill, window)]
    rows.append(row("fp", "fp", "decode", 16.0, 0.0, windows, decode, window))
    for name, kl in ours_kl.items():
        bits = float(name.removeprefix("preset:rq-")) - float(torch.rand(1, generator=rng)) / 10
        rows.append(row(name, "rqlib", "prefill", bits, kl, windows, prefill, window))
    for name, kl in peers_kl.items():
        bits = {"hf-quanto:int4": 5.2, "hf-quanto:int2": 3.3}[name]
        rows.append(row(name, "peer", "prefill", bits, 0.0, windows, prefill, window))
        rows.append(row(name, "peer", "decode", bits, kl, windows, decode, window))
    return pd.DataFrame(rows)


def passing_kls(rng):
    """KLs that meet every target: the peers' KLs random, ours well inside every bound."""
    int4 = 0.01 + 0.01 * float(torch.rand(1, generator=rng))
    int2 = 1.0 + float(torch.rand(1, generator=rng))
    # rq-3's ΔPPL bound of 1.5 % allows a KL up to log(1.015) = 0.0149 in these frames
    ours = {"preset:rq-3.5": 0.3 * int4 / 1.0, "preset:rq-3": 0.5 * min(int4, 0.03)}
    ours["preset:rq-2.5"] = min(0.05, int2 / 4)
    ours["preset:rq-2"] = min(0.05, int2 / 20)
    return ours, {"hf-quanto:int4": int4, "hf-quanto:int2": int2}


def test_the_table_takes_the_peers_from_decode_and_ours_from_one_forward(rng):
    ours, peers = passing_kls(rng)
    table = loaders.headline_table(frame_for(rng, ours, peers), "smollm2", 1024)
    by_method = table.set_index("method")
    for name, kl in peers.items():
        assert by_method.loc[name, "kl"] == kl  # the decode number, not the one-forward zero
        assert by_method.loc[name, "prefill_kl"] == 0.0
        assert by_method.loc[name, "decode_run"] == "token by token"
    for name, kl in ours.items():
        assert by_method.loc[name, "kl"] == by_method.loc[name, "prefill_kl"] == kl
        assert by_method.loc[name, "decode_run"] == "one forward"


def test_a_peer_measured_only_in_one_forward_is_left_out(rng):
    ours, peers = passing_kls(rng)
    frame = frame_for(rng, ours, peers)
    frame = frame[~((frame["method"] == "hf-quanto:int2") & (frame["mode"] == "decode"))]
    table = loaders.headline_table(frame, "smollm2", 1024)
    assert "hf-quanto:int2" not in set(table["method"])
    # on the first window it stays, with its one-forward numbers and no decode numbers
    first = frame.assign(file=frame["file"].str.replace("-w1024", "-check-w1024"))
    kept = loaders.headline_table(first, "smollm2", 1024, first_window=True).set_index("method")
    assert kept.loc["hf-quanto:int2", "decode_run"] == "not run"
    assert (
        math.isnan(kept.loc["hf-quanto:int2", "kl"])
        and kept.loc["hf-quanto:int2", "prefill_kl"] == 0
    )


def test_every_target_is_met_by_a_run_inside_every_bound(rng):
    ours, peers = passing_kls(rng)
    targets = loaders.headline_targets(
        {1024: loaders.headline_table(frame_for(rng, ours, peers), "smollm2", 1024)}
    )
    assert targets["met"].all(), targets
    # each preset: its ΔPPL, its KL where it has a bound, the bits and the KL ratio to its peer
    assert len(targets) == 3 * len(TARGETS) + sum(t.max_kl is not None for t in TARGETS.values())


@pytest.mark.parametrize("preset", sorted(PEER_TARGETS))
def test_the_peer_target_fails_a_kl_just_above_its_ratio(rng, preset):
    ours, peers = passing_kls(rng)
    versus = PEER_TARGETS[preset]
    ours[f"preset:{preset}"] = 1.01 * versus.max_kl_ratio * peers[versus.peer]
    targets = loaders.headline_targets(
        {1024: loaders.headline_table(frame_for(rng, ours, peers), "smollm2", 1024)}
    )
    failed = targets[~targets["met"]]
    assert f"KL / KL of {versus.peer}" in set(failed[failed["preset"] == preset]["target"])


def test_too_few_windows_meet_nothing(rng):
    ours, peers = passing_kls(rng)
    few = loaders.HEADLINE_MIN_WINDOWS[4096] - 1
    tables = {4096: loaders.headline_table(frame_for(rng, ours, peers, few, 4096), "smollm2", 4096)}
    assert not loaders.headline_targets(tables)["met"].any()


def test_numbers_name_the_missed_targets(rng):
    ours, peers = passing_kls(rng)
    ours["preset:rq-3.5"] = 0.02  # above the preset's own KL bound of 0.01
    tables = {1024: loaders.headline_table(frame_for(rng, ours, peers), "smollm2", 1024)}
    targets = loaders.headline_targets(tables)
    first = tables[1024].assign(decode_run="token by token")
    numbers = loaders.headline_numbers(tables, targets, first, tables[1024])
    assert numbers["held_1024_preset_rq_3_5_kl"] == 0.02
    assert numbers["held_targets_met"] < numbers["held_targets_total"]
    assert "rq-3.5 at 1024 tokens, KL: 0.02 against 0.01" in numbers["held_targets_missed"]
    assert numbers["agree_kl_ratio_min"] == numbers["agree_kl_ratio_max"] == 1.0
    assert numbers["agree_cost_ratio_min"] == numbers["agree_cost_ratio_max"] == 1.0
    # what the token-by-token steps read: said from the files, not assumed
    assert numbers["agree_decode_reads"].startswith("the packed codes")
    copied = first.assign(decoded_copy=True)
    numbers = loaders.headline_numbers(tables, targets, copied, tables[1024])
    assert numbers["agree_decode_reads"].startswith("a decoded copy")


def test_numbers_name_the_target_met_by_the_least_margin(rng):
    """Every target is met with room (20 % of its bound or more); rq-3's ΔPPL is then set
    0.25 % inside its bound, and that target is named; with no target met the sentence says
    so. In these frames ΔPPL is exp(KL) - 1, so rq-3's KL sits just below log(1.015), and
    quanto int4's KL is raised to 0.03 so that rq-3's KL ratio keeps its room."""
    ours, peers = passing_kls(rng)
    ours["preset:rq-3"] = 0.999 * math.log(1 + TARGETS["rq-3"].max_delta_ppl_pct / 100)
    peers["hf-quanto:int4"] = 0.03
    tables = {1024: loaders.headline_table(frame_for(rng, ours, peers), "smollm2", 1024)}
    targets = loaders.headline_targets(tables)
    margins = 1 - targets["measured"] / targets["bound"]
    assert targets["met"].all() and (margins.drop(margins.idxmin()) > 0.2).all(), targets
    first = tables[1024].assign(decode_run="token by token")
    numbers = loaders.headline_numbers(tables, targets, first, tables[1024])
    assert numbers["held_closest_met"].startswith("rq-3 at 1024 tokens, ΔPPL %")
    none_met = targets.assign(met=False)
    numbers = loaders.headline_numbers(tables, none_met, first, tables[1024])
    assert numbers["held_closest_met"] == "none"


def test_pareto_front_keeps_exactly_the_undominated_points(rng):
    bits = torch.rand(40, generator=rng).tolist()
    kl = torch.rand(40, generator=rng).tolist()
    front = set(pareto_front(bits, kl))
    for i in range(40):
        dominated = any(
            bits[j] <= bits[i] and kl[j] <= kl[i] and (bits[j], kl[j]) != (bits[i], kl[i])
            for j in range(40)
        )
        assert (i in front) == (not dominated), i


def test_headline_figure_draws_both_modes(rng):
    ours, peers = passing_kls(rng)
    tables = {1024: loaders.headline_table(frame_for(rng, ours, peers), "smollm2", 1024)}
    fig = headline_figure(tables, "SmolLM2-135M")
    titles = [ax.get_title() for ax in fig.axes]
    assert any("decode mode" in t for t in titles) and any("one forward" in t for t in titles)


def test_held_out_tables_has_every_window_of_the_many_window_runs(rng):
    ours, peers = passing_kls(rng)
    frame = pd.concat([frame_for(rng, ours, peers, 8, 1024), frame_for(rng, ours, peers, 2, 4096)])
    tables = loaders.held_out_tables(frame, "smollm2")
    assert list(tables) == [1024, 4096]
    assert (tables[4096]["windows"] == 2).all()


def test_decode_runs_split_over_two_files_make_one_table(rng):
    """Each peer in its own token-by-token file: one row per method, the reference once."""
    ours, peers = passing_kls(rng)
    frame = frame_for(rng, ours, peers)
    decode = frame["mode"] == "decode"
    int2 = frame["method"].isin(["fp", "hf-quanto:int2"]) & decode
    second = frame[int2].assign(file="headline/smollm2-decode-int2-w1024.json")
    frame = pd.concat([frame[~(decode & (frame["method"] == "hf-quanto:int2"))], second])
    table = loaders.headline_table(frame, "smollm2", 1024)
    assert table["method"].is_unique and table.iloc[0]["method"] == "fp"
    assert table.set_index("method").loc["hf-quanto:int2", "kl"] == peers["hf-quanto:int2"]


def test_a_peer_not_run_at_a_window_fails_its_targets_as_not_measured(rng):
    ours, peers = passing_kls(rng)
    frame = frame_for(rng, ours, peers)
    frame = frame[frame["method"] != "hf-quanto:int2"]
    tables = {1024: loaders.headline_table(frame, "smollm2", 1024)}
    targets = loaders.headline_targets(tables)
    row = targets[targets["target"] == "KL / KL of hf-quanto:int2"].iloc[0]
    assert row["preset"] == "rq-2.5" and not row["met"] and math.isnan(row["measured"])
    first = tables[1024].assign(decode_run="token by token")
    numbers = loaders.headline_numbers(tables, targets, first, tables[1024])
    assert "KL / KL of hf-quanto:int2: not measured" in numbers["held_targets_missed"]


def test_the_table_lists_fp_then_the_presets_in_their_order_then_the_peers(rng):
    """Whatever order the files hold the rows in (a random permutation here)."""
    ours, peers = passing_kls(rng)
    frame = frame_for(rng, ours, peers)
    frame = frame.iloc[torch.randperm(len(frame), generator=rng).tolist()]
    table = loaders.headline_table(frame, "smollm2", 1024)
    presets = [f"preset:{name}" for name in TARGETS]
    methods = list(table["method"])
    assert methods[: 1 + len(presets)] == ["fp", *presets]
    assert sorted(methods[1 + len(presets) :]) == sorted(PEERS)  # in the order of the files
