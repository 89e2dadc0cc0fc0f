"""Shared test set-up: the Triton interpreter, the ``rng`` fixture and the flakiness audit.

Triton kernels run under the interpreter on CPU: TRITON_INTERPRET must be set before any
``@triton.jit`` function is defined, so it is set here, before any test module imports
``rqlib.kernels``. The interpreter multiplies the fp16 inputs of a ``tl.dot`` exactly and sums
in float32, as a GPU's tensor cores do, so the kernels' tensor-core products are checked at the
precision a GPU computes them.

Randomized tests draw everything from the ``rng`` fixture (a fresh random seed per test,
replayed with ``RQLIB_TEST_SEED=<seed>``). Each states the probability that it fails on
correct code (at most 1e-6 per run) and how that probability was derived. The fast ones carry
``@pytest.mark.randomized`` and assert their statistics through ``record_statistic``, so the
audit can show how close to its bound each statistic comes:

    make test-seeds N=200
    # = pytest -m "randomized and not model" --seeds 200 --audit-out tests/audit/randomized-200.txt

(randomized tests that run a packaged model take seconds each; they are audited on their own,
over fewer seeds: ``pytest -m "randomized and model" --seeds 40 --audit-out ...``).

``--seeds N`` runs every marked test once per random seed (N fresh seeds, one pytest process);
the summary lists each test's failures, with their seeds, and each statistic's spread over
the seeds next to its bound. From 1,000 seeds up, it also extrapolates the probability that
one run lands beyond the bound, from a generalized Pareto law fitted to the worst tenth of the
values (the standard peaks-over-threshold estimate of a tail): that is how a bound set from a
measured spread gets a stated false-failure rate.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from rqlib.base.files import atomic_write_text, check_writable  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rqlib flakiness audit")
    group.addoption(
        "--seeds",
        type=int,
        default=0,
        metavar="N",
        help="run every @pytest.mark.randomized test with N fresh random seeds and summarize",
    )
    group.addoption(
        "--audit-out",
        default=None,
        metavar="PATH",
        help="write the --seeds summary to PATH (refused if PATH exists, unless --audit-force)",
    )
    group.addoption(
        "--audit-values",
        default=None,
        metavar="PATH",
        help="also write every statistic's values over the seeds to PATH (JSON), to refit them",
    )
    group.addoption(
        "--audit-force",
        action="store_true",
        help="let --audit-out and --audit-values replace existing files",
    )


def fresh_seed() -> int:
    """A 32-bit seed from the operating system's entropy."""
    return int.from_bytes(os.urandom(4), "little")


@dataclass
class Statistic:
    """One asserted statistic of one test over the audit's seeds."""

    bound: float
    at_least: bool
    values: list[float] = field(default_factory=list)


TAIL_FIT_MIN_RUNS = 1_000  # fewer values leave the fitted tail's shape too uncertain
TAIL_SHARE = 0.1  # the fit uses the values beyond the 90th percentile


def tail_rate(values: list[float], bound: float, at_least: bool) -> tuple[float, float, float]:
    """P(one run's value lies beyond ``bound``) from a generalized Pareto law fitted (maximum
    likelihood) to the excesses over the 90th percentile: the fitted rate, the rate with the
    shape at its upper 2-standard-error value (a heavier tail, same scale: the fit's
    uncertainty), and the fitted shape ξ (ξ > 0 a power-law tail, 0 exponential, < 0 a tail
    with an end point). A bound among the fitted tenth gets the empirical share beyond it."""
    from scipy.stats import genpareto

    worse = torch.tensor(values, dtype=torch.float64) * (-1 if at_least else 1)
    limit = -bound if at_least else bound
    threshold = torch.quantile(worse, 1 - TAIL_SHARE).item()
    excess = (worse[worse > threshold] - threshold).numpy()
    shape, _, scale = genpareto.fit(excess, floc=0)
    shape = float(shape)
    if limit <= threshold:
        share = (worse > limit).double().mean().item()
        return share, share, shape
    share = len(excess) / len(values)
    heavier = shape + 2 * (1 + shape) / math.sqrt(len(excess))  # MLE: SE(ξ) ≈ (1 + ξ)/√k
    rate, rate_heavier = (
        share * float(genpareto.sf(limit - threshold, xi, 0, scale)) for xi in (shape, heavier)
    )
    return rate, rate_heavier, shape


@dataclass
class Audit:
    """What the audit collects: outcomes per test, statistics per test and name."""

    seeds: list[int]
    runs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed_seeds: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    statistics: dict[str, dict[str, Statistic]] = field(default_factory=lambda: defaultdict(dict))


AUDIT = pytest.StashKey[Audit]()
SEED_ID = re.compile(r"seed(\d+)")


def test_key(nodeid: str) -> str:
    """The test's id without its audit seed: the same key for all the seeds of one test."""
    key = SEED_ID.sub("", nodeid)
    return key.replace("[-", "[").replace("--", "-").replace("-]", "]").replace("[]", "")


def pytest_configure(config: pytest.Config) -> None:
    n = config.getoption("seeds")
    if n < 0:
        raise pytest.UsageError(f"--seeds must be a positive count, got {n}")
    for option in ("audit_out", "audit_values"):
        out = config.getoption(option)
        if out is None:
            continue
        flag = "--" + option.replace("_", "-")
        if n == 0:
            raise pytest.UsageError(f"{flag} needs --seeds N")
        try:
            check_writable(out, overwrite=config.getoption("audit_force"))
        except (FileExistsError, OSError, ValueError) as error:
            message = str(error).replace("--force", "--audit-force")  # pytest's option name
            raise pytest.UsageError(f"{flag}: {message}") from None
    if n:
        config.stash[AUDIT] = Audit(seeds=[fresh_seed() for _ in range(n)])
        # one thread: on a small shared machine, torch's threads contending with other
        # processes made the audit's many small tensor operations ~15x slower
        torch.set_num_threads(1)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    audit = metafunc.config.stash.get(AUDIT, None)
    if audit is None or "rng_seed" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("randomized") is None:
        return
    metafunc.parametrize("rng_seed", audit.seeds, ids=[f"seed{s}" for s in audit.seeds])


@pytest.fixture
def rng_seed() -> int:
    """The seed of ``rng``: ``RQLIB_TEST_SEED`` when set, else fresh (the audit overrides it)."""
    replay = os.environ.get("RQLIB_TEST_SEED")
    return int(replay) if replay else fresh_seed()


@pytest.fixture
def rng(rng_seed: int) -> torch.Generator:
    """A generator with a fresh random seed for each test; the seed is printed on failure.

    ``RQLIB_TEST_SEED=<seed> pytest <test>`` replays a failure with the seed it printed.
    """
    print(f"random seed: {rng_seed}")
    return torch.Generator().manual_seed(rng_seed)


@pytest.fixture
def record_statistic(request: pytest.FixtureRequest):
    """``record_statistic(name, value, bound, at_least=False)`` asserts ``value <= bound``
    (``value >= bound`` with ``at_least``) and, under ``--seeds``, records the value for the
    audit's summary. ``name`` is one statistic of the test (a test may assert several)."""
    audit = request.config.stash.get(AUDIT, None)

    def record(name: str, value: float, bound: float, *, at_least: bool = False) -> None:
        value, bound = float(value), float(bound)
        if audit is not None:
            per_test = audit.statistics[test_key(request.node.nodeid)]
            per_test.setdefault(name, Statistic(bound, at_least)).values.append(value)
        holds = value >= bound if at_least else value <= bound
        relation = ">=" if at_least else "<="
        assert holds, f"{name} = {value:.6g}, expected {relation} {bound:.6g}"

    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under ``--seeds``, count each marked test's runs and the seeds it failed with."""
    outcome = yield
    audit = item.config.stash.get(AUDIT, None)
    if audit is None or item.get_closest_marker("randomized") is None:
        return
    report = outcome.get_result()
    key = test_key(item.nodeid)
    if report.when == "call":
        audit.runs[key] += 1
    if report.failed:
        seed = SEED_ID.search(item.nodeid)
        audit.failed_seeds[key].append(seed.group(1) if seed else "?")


def summary(audit: Audit, command: str) -> str:
    """The audit's text: one block per test, its failures and each statistic's spread."""
    tests = sorted(set(audit.runs) | set(audit.failed_seeds))
    failures = sum(len(s) for s in audit.failed_seeds.values())
    lines = [
        "# Flakiness audit of the randomized tests (generated; do not edit)",
        f"# command: {command}",
        f"# {len(tests)} tests x {len(audit.seeds)} fresh random seeds, {failures} failures",
        "# per statistic: min / median / max over the seeds, the bound the test asserts, and",
        "# how close the worst seed came to it (worst/bound for <= bounds, bound/worst for >=)",
        f"# from {TAIL_FIT_MIN_RUNS} seeds up, the false-failure rate extrapolated by a tail fit",
        "# (a generalized Pareto law fitted to the worst tenth of the values)",
        "",
    ]
    for key in tests:
        failed = audit.failed_seeds.get(key, [])
        lines.append(f"{key}  runs {audit.runs.get(key, 0)}  failures {len(failed)}")
        if failed:
            lines.append(f"    failed with RQLIB_TEST_SEED in {', '.join(failed)}")
        for name, stat in sorted(audit.statistics.get(key, {}).items()):
            values = stat.values
            worst = min(values) if stat.at_least else max(values)
            relation = ">=" if stat.at_least else "<="
            if stat.at_least:
                closeness = stat.bound / worst if worst else float("inf")
            else:
                closeness = worst / stat.bound if stat.bound else float("inf")
            lines.append(
                f"    {name}: {min(values):.4g} / {statistics.median(values):.4g} / "
                f"{max(values):.4g}  {relation} {stat.bound:.4g}  closest {closeness:.3f}"
            )
            if len(values) >= TAIL_FIT_MIN_RUNS:
                rate, rate_heavier, shape = tail_rate(values, stat.bound, stat.at_least)
                lines.append(
                    f"      tail fit (shape {shape:+.2f}): P(beyond the bound) per run = "
                    f"{rate:.2g}, {rate_heavier:.2g} with the shape 2 SE heavier"
                )
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    audit = config.stash.get(AUDIT, None)
    if audit is None:
        return
    text = summary(audit, "python -m pytest " + " ".join(config.invocation_params.args))
    terminalreporter.write_sep("=", "flakiness audit")
    terminalreporter.write(text)
    out = config.getoption("audit_out")
    if out is not None:
        atomic_write_text(Path(out), text)
        terminalreporter.write_line(f"audit summary written to {out}")
    values_out = config.getoption("audit_values")
    if values_out is not None:
        values = {
            key: {name: stat.values for name, stat in per_test.items()}
            for key, per_test in audit.statistics.items()
        }
        atomic_write_text(Path(values_out), json.dumps(values, indent=1) + "\n")
        terminalreporter.write_line(f"statistics' values written to {values_out}")
