"""Readers of the committed results (rqlib.book.loaders) and chapter 4's bookkeeping
(rqlib.book.perplexity): every file the book reads exists and records a command the command
line accepts; tables and verdicts are computed from the files."""

import argparse
import json
import shlex

import pandas as pd
import pytest

from rqlib.book import loaders, perplexity
from rqlib.book.labels import READ_BY_SPEC
from rqlib.cli import COMMANDS
from rqlib.spec.presets import PRESETS


def assert_command_writes(path, name):
    """``path`` records a ``python -m rqlib`` command that the command line accepts and that
    writes ``results/<name>``."""
    words = shlex.split(loaders.recorded_command(path))
    assert words[:3] == ["python", "-m", "rqlib"], words[:3]
    command, argv = words[3], words[4:]
    parser = argparse.ArgumentParser(exit_on_error=False)
    COMMANDS[command][0](parser)
    args = parser.parse_args(argv)
    assert str(args.json) == f"results/{name}", "the command writes another file than this one"


@pytest.mark.parametrize("name", list(loaders.COMMITTED))
def test_each_committed_file_records_a_command_the_cli_accepts(name):
    assert_command_writes(loaders.committed_file(name), name)


def test_a_missing_committed_file_says_how_to_restore_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="git checkout -- results/presets-smollm2.json"):
        loaders.committed_file("presets-smollm2.json", tmp_path)
    with pytest.raises(KeyError, match="not a committed results file"):
        loaders.committed_file("elsewhere.json")


def test_eval_table_has_integer_key_bits_and_the_run_fields():
    frame = loaders.load_eval_table(loaders.committed_file("eval-quantizers-smollm2.json"))
    assert frame["key_bits"].dtype.kind == "i" and frame.loc[0, "method"] == "fp"
    assert set(frame["key_bits"]) == {2, 3, 4, 16}
    pivot = loaders.keys_only_pivot({"smollm2": frame})
    assert list(pivot.columns) == ["2 bits", "3 bits", "4 bits"]


def test_preset_verdict_names_what_misses():
    assert loaders.preset_verdict("rq-3.5", 3.4, 0.5, 0.005) == "meets its target"
    verdict = loaders.preset_verdict("rq-3.5", 3.6, 1.5, 0.005)
    assert verdict == "misses its target: ΔPPL by 0.50 points, bits by 0.100"


def test_committed_numbers_and_levers_from_synthetic_files(tmp_path):
    rows = [
        {"role": "fp", "preset": None, "perplexity": 10.0, "delta_ppl_pct": 0.0, "kl": 0.0},
        {
            "role": "preset",
            "preset": "rq-3",
            "perplexity": 10.1,
            "delta_ppl_pct": 1.0,
            "kl": 0.01,
            "bits_mean": 2.9,
            "change": None,
            "lever": None,
        },
        {
            "role": "ablation",
            "preset": "rq-3",
            "change": "removed",
            "lever": "sink",
            "delta_ppl_pct": 5.0,
            "kl": 0.05,
        },
        {
            "role": "ablation",
            "preset": "rq-3",
            "change": "removed",
            "lever": "centering",
            "delta_ppl_pct": 2.0,
            "kl": 0.02,
        },
        {"role": "baseline", "preset": None, "delta_ppl_pct": 1.2, "kl": 0.011},
        {"role": "baseline", "preset": None, "delta_ppl_pct": 0.8, "kl": 0.009},
    ]
    path = tmp_path / "file.json"
    corpus = {"sha256": "0" * 64}
    path.write_text(
        json.dumps({"rows": rows, "model": "m", "tokens": 64, "window": 32, "corpus": corpus})
    )
    frame = loaders.load_ablation(path)
    levers = loaders.top_levers(frame)
    assert levers.to_dict("records") == [
        {"preset": "rq-3", "delta_ppl_pct": 1.0, "lever": "sink", "lever_delta_ppl_pct": 5.0}
    ]
    spread = loaders.draw_spread(frame)
    assert spread == {
        "n": 2,
        "tokens": 64,
        "delta_ppl_pct_min": 0.8,
        "delta_ppl_pct_max": 1.2,
        "kl_min": 0.009,
        "kl_max": 0.011,
    }
    numbers = loaders.committed_numbers({}, {"smollm2": frame}, frame)
    assert numbers["presets_smollm2_rq_3_delta_ppl_pct"] == 1.0
    assert numbers["presets_smollm2_rq_3_verdict"] == "meets its target"
    assert numbers["presets_smollm2_fp_ppl"] == 10.0


def test_config_grid_and_the_qjl_comparison():
    grid = perplexity.config_grid(
        ["turboquant-mse", "turboquant-prod"], [3, 2], ["gaussian", "orthogonal"]
    )
    assert [key[0] for key in grid] == ["turboquant-mse"] * 2 + [
        "turboquant-prod, gaussian S"
    ] * 2 + ["turboquant-prod, orthogonal S"] * 2
    assert [key[3] for key in grid][:2] == [2, 3]
    with pytest.raises(ValueError, match="exact_window"):
        perplexity.config_grid(["turboquant-mse"], [3], ["gaussian"], exact_window=-1)
    table = pd.DataFrame(
        {
            "method": ["turboquant-mse", "turboquant-prod", "turboquant-prod", "rotorquant-prod"],
            "qjl_sketch": [None, "gaussian", "orthogonal", "gaussian"],
            "key_bits": [3, 3, 3, 3],
            "kl": [0.1, 0.5, 0.05, 0.9],
        }
    )
    # the rotor variant has no MSE sibling at 3 bits: it is not a pair
    assert perplexity.qjl_against_mse(table) == (2, 1)


def test_storage_savings_are_the_bit_accounting_differences():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2
    )
    savings = perplexity.storage_savings("turboquant-mse:b3:sink1:win64:wb=8:nm=6", config)
    # head_dim 64: 16 - 11 = 5 norm bits per vector of 64 coordinates, for every stored vector
    # and for the coded band's copies of the 64 most recent of 4096 tokens
    assert savings["norm_bits"] == 11
    assert savings["norm_saving"] == pytest.approx(5 / 64 * (1 + 64 / 4096))
    # 64 of 4096 tokens as 8-bit codes (+ an 11-bit norm) instead of 16-bit copies
    band = 64 / 4096 * (16 - (8 + 11 / 64))
    assert savings["band_saving"] == pytest.approx(band)
    # stored once, the band's 64 tokens hold no main codes (3 bits and an 11-bit norm each),
    # whichever way the spec itself stores the band
    once = 64 / 4096 * (3 + 11 / 64)
    assert savings["once_saving"] == pytest.approx(once)
    spec_once = "turboquant-mse:b3:sink1:win64:wb=8:nm=6:once"
    assert perplexity.storage_savings(spec_once, config)["once_saving"] == pytest.approx(once)
    with pytest.raises(ValueError, match="nm="):
        perplexity.storage_savings("turboquant-mse:b3", config)


WINDOW_FILES = (
    "eval-window-smollm2-w1024.json",
    "eval-window-smollm2-w4096.json",
    "eval-window-smollm2-more-w1024.json",
    "eval-window-smollm2-more-w4096.json",
    "eval-window-gemma3-w1024.json",
    "eval-window-smollm2-held-out-w1024.json",
    "eval-window-smollm2-held-out-w4096.json",
    "eval-window-smollm2-held-out-more-w1024.json",
    "eval-window-smollm2-held-out-more-w4096.json",
    "eval-window-gemma3-held-out-w1024.json",
    "eval-trellis-window-smollm2-w1024.json",
    "eval-trellis-window-smollm2-w4096.json",
    "eval-trellis-window-gemma3-w1024.json",
)


@pytest.mark.parametrize("name", WINDOW_FILES)
def test_every_recent_window_run_is_its_budgets_allocation(name):
    """Chapter 6 reads these files; each run's per-layer bits must be what the allocation gives
    at its budget and context (an exact comparison of specs), and the command must be one the
    command line accepts and that writes this file."""
    from rqlib.book.results import results_dir

    path = results_dir() / name
    frame = loaders.window_study(path)
    assert len(frame) >= 1 and frame.budget.notna().all()
    # the trellis runs say so (tcq), the others hold the Lloyd-Max code
    assert (frame.trellis.notna() == name.startswith("eval-trellis-")).all()
    assert_command_writes(path, name)


def test_a_run_whose_bits_were_chosen_otherwise_is_refused(tmp_path):
    """One layer's key bits raised by one in one run of a committed file: no budget's allocation
    gives those bits, so the loader must refuse the file, naming it."""
    from rqlib.book.results import results_dir
    from rqlib.spec.config import CompressionConfig

    payload = json.loads((results_dir() / WINDOW_FILES[0]).read_text())
    run = next(r for r in payload["results"] if r["config"] is not None)
    config = CompressionConfig.parse(run["label"])
    layer, bits = config.layer_key_bits[0]
    changed = config.replace(layer_key_bits=((layer, bits + 1), *config.layer_key_bits[1:]))
    run["label"] = changed.spec()
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=f"{path}: the bits of .* are no allocation"):
        loaders.window_study(path)


@pytest.mark.parametrize(("window", "table"), [(16, 32), (32, 32), (48, 64), (128, 64), (256, 64)])
def test_a_window_is_allocated_from_the_nearest_measured_window(window, table):
    from rqlib.spec.config import CompressionConfig

    config = CompressionConfig.parse(f"turboquant-mse:b3:sink1:win{window}:wb=8:ctr:nc:nm=6")
    chosen = CompressionConfig.parse(loaders.window_table("smollm2-135m", config).base)
    assert chosen.recent_window == table


def test_a_format_without_a_table_is_named():
    from rqlib.spec.config import CompressionConfig

    config = CompressionConfig.parse("rotorquant-mse:b3:sink1:win32:ctr:nc")
    with pytest.raises(FileNotFoundError, match="smollm2-135m and the format rotorquant-mse"):
        loaders.window_table("smollm2-135m", config)


#: every preset with its band stored twice and once, one command for each model and context
BAND_TWICE_ONCE_FILES = (
    "eval-band-twice-once-smollm2-w1024.json",
    "eval-band-twice-once-smollm2-w4096.json",
    "eval-band-twice-once-gemma3-w1024.json",
)


@pytest.mark.parametrize("name", BAND_TWICE_ONCE_FILES)
def test_each_band_twice_once_file_runs_every_preset_both_ways(name):
    """Chapter 6 reads these files as every preset with its band stored twice and once: every
    run must be a preset (so that the eval allocated it at its budget and context) with the
    token ``twice`` or ``once``, its recorded config must store the band as its label says, and
    the command must write this file."""
    from rqlib.book.results import results_dir
    from rqlib.spec.config import CompressionConfig

    path = results_dir() / name
    payload = json.loads(path.read_text())
    runs = [r for r in payload["results"] if r["config"] is not None]
    assert {r["label"] for r in runs} == {
        f"preset:{p}:{storage}" for p in PRESETS for storage in ("twice", "once")
    }
    for run in runs:
        config = CompressionConfig.from_dict(run["config"])
        assert config.band_once == run["label"].endswith(":once")
        assert config.budget is None and config.layer_key_bits  # resolved: per-layer bits
    assert_command_writes(path, name)


@pytest.mark.parametrize("name", READ_BY_SPEC)
def test_each_first_cpu_run_is_repeated_on_the_second(name):
    """Chapter 6 pairs each run of ``name`` (the first CPU) with the run of the same spec on the
    same tokens among the four-way files of its model and context (the second CPU), by the
    storage each run recorded, not by its label: every run must have such a pair, so that what
    differs between the two is the machine."""
    from rqlib.book.results import results_dir

    first = loaders.load_headline(results_dir() / name)
    ours = first[first.kind == "rqlib"]
    second = pd.concat(loaders.load_headline(results_dir() / n) for n in TRELLIS_ONCE_FILES)
    same_run = ["model", "window", "offset", "tokens", "mode", "spec"]
    paired = ours.merge(second[second.kind == "rqlib"][same_run], on=same_run)
    assert len(paired) == len(ours) > 0, f"{name}: runs without a pair on the second CPU"


#: file -> the preset it stores four ways
TRELLIS_ONCE_FILES = {
    "eval-trellis-once-smollm2-w1024.json": "rq-3",
    "eval-trellis-once-smollm2-w4096.json": "rq-3",
    "eval-trellis-once-gemma3-w1024.json": "rq-3",
    "eval-trellis-once-smollm2-rq2-w1024.json": "rq-2",
    "eval-trellis-once-smollm2-rq2-w4096.json": "rq-2",
    "eval-trellis-once-gemma3-rq2-w1024.json": "rq-2",
}


@pytest.mark.parametrize("name", TRELLIS_ONCE_FILES)
def test_each_trellis_once_run_stores_what_its_label_says(name):
    """Chapter 6 reads these files as one preset stored four ways: its band stored twice and
    once, each without and with the trellis, named by labels that keep their meaning whichever
    way the presets store their band. Every run must be the preset resolved at its budget and
    context, its recorded config must store the band and the codes as its label says, and the
    command must write this file."""
    from rqlib.book.results import results_dir
    from rqlib.spec.config import CompressionConfig

    path = results_dir() / name
    runs = [r for r in json.loads(path.read_text())["results"] if r["config"] is not None]
    preset = TRELLIS_ONCE_FILES[name]
    assert {r["label"] for r in runs} == {
        f"preset:{preset}{tcq}:{band}" for tcq in ("", ":tcq") for band in ("twice", "once")
    }
    for run in runs:
        tokens = run["label"].split(":")[2:]
        config = CompressionConfig.from_dict(run["config"])
        assert config.band_once == ("once" in tokens)
        assert (config.trellis_state_bits is not None) == ("tcq" in tokens)
        assert config.budget is None and config.layer_key_bits  # resolved: per-layer bits
    assert_command_writes(path, name)
