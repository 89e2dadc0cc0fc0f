"""The command line: ``python -m rqlib COMMAND ...`` (or ``rqlib COMMAND ...``).

Commands:

  eval        perplexity, KL and top-1 of compressed caches against the uncompressed model
  experiment  the presets, their one-lever ablations and baselines in one evaluation
  allocate    measure a model's sensitivity table (what per-layer bits are allocated from)
  sweep       run a chapter with papermill once per combination of parameters
  bench       kernel benchmarks on a GPU, or the byte-count model without one
  render      an executed chapter (papermill output) as one HTML page, numbers and figures in place

Each command is a thin layer over a library function; this module holds every argument
definition, so ``python -m rqlib COMMAND --help`` is the reference.

Errors: every input is checked before any long work (the model, the corpus and its token
count, the device, the output path, the specs against the model, the budgets). A user error
is one line on stderr and exit status 2; a traceback means a bug. Output files are written
atomically and an existing one is replaced only with ``--force``.

Method specs (eval, experiment): METHOD[:TOKEN]... or preset:NAME[:TOKEN]...; the legend of
every token, preset and ablation lever is generated from their definitions
(:mod:`rqlib.book.legend`) and printed by ``python -m rqlib eval --help``.

Peers (eval): the caches a transformers user would pick instead, counted the same way:
  hf-quanto:int4 | hf-quanto:int2 | hf-hqq:int2 | hf-hqq:int3 | hf-hqq:int4 | hf-fp8
  hf-dynamic      the exact DynamicCache (the decode harness's control)
  group=N res=N   their group size and exact residual (defaults 64 and 128)
They return the chunk they are given exact, so compare them with --mode decode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rqlib.spec.presets import PRESETS

__all__ = ["UsageError", "format_table", "main"]

PROG = "python -m rqlib"


class UsageError(Exception):
    """A user error: printed as one line on stderr, exit status 2, no traceback."""


#: What the input checks of a command may raise when the input is wrong (not a bug).
_INPUT_ERRORS = (ValueError, TypeError, KeyError, OSError, ModuleNotFoundError)


@contextlib.contextmanager
def _user_input(what: str | None = None) -> Iterator[None]:
    """Turn the errors raised while checking the user's input into :class:`UsageError`.

    Only the checking phase of a command runs inside this block; the long work after it does
    not, so that a bug there still shows its traceback.
    """
    try:
        yield
    except UsageError:
        raise
    except _INPUT_ERRORS as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        prefix = f"{what}: " if what else ""
        raise UsageError(f"{prefix}{message}") from error


def _check_output(path: Path | None, force: bool) -> None:
    """Refuse an output path that cannot be written, or an existing file without --force."""
    if path is None:
        return
    from rqlib.base.files import check_writable

    with _user_input():
        check_writable(path, overwrite=force)


def _write_json(path: Path, payload: dict, force: bool, indent: int = 2) -> None:
    """Write the command's JSON output atomically (replacing a file only with --force)."""
    from rqlib.base.files import atomic_write_text

    with _user_input():
        atomic_write_text(path, json.dumps(payload, indent=indent) + "\n", overwrite=force)


def _check_device(name: str):
    """The torch device ``name``; :class:`UsageError` when it is not a device or not here."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as error:
        raise UsageError(f"--device {name}: not a torch device ({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available on this machine")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {name}: use cpu or cuda")
    return device


def _at_least(name: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"--{name} must be >= {minimum}, got {value}")


def _bench_presets(values: list[str]) -> tuple[str, ...]:
    """``bench --presets``: preset names, each optionally followed by spec tokens
    (``rq-3:tcq:tb``), checked here so that a typo fails before any timing."""
    from rqlib.spec.config import CompressionConfig

    with _user_input("--presets"):
        for value in values:
            CompressionConfig.parse(f"preset:{value}")  # names an unknown preset or token
    return tuple(values)


def _command_line(argv: list[str]) -> str:
    return "python -m rqlib " + shlex.join(argv)


def _force_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="replace the --json file if it exists")


# ---- eval ------------------------------------------------------------------------------------
def _with_legend(parser: argparse.ArgumentParser) -> None:
    """End ``parser``'s help with the legend of the spec language, the presets and the levers
    (:func:`rqlib.book.legend.legend_text`), built only when the help is shown: it imports the
    library's definitions, which a command that does not print its help need not pay for."""
    plain = parser.format_help

    def format_help() -> str:
        from rqlib.book.legend import legend_text

        parser.epilog = legend_text()
        return plain()

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.format_help = format_help  # type: ignore[method-assign]


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    _with_legend(parser)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m, gemma3-270m (offline), or a hub id / local path",
    )
    parser.add_argument("--corpus", default="wikitext-2", help="wikitext-2 or pydoc")
    parser.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="number of tokens evaluated (no BOS); 0: the whole corpus from --offset on; their "
        "windows must score at least 16 tokens (the first token of a window is not scored)",
    )
    parser.add_argument(
        "--offset",
        type=int,
        default=0,
        help="token offset into the corpus where the evaluated tokens start (default 0; the "
        "book's held-out text is wikitext-2 from token 100000 on)",
    )
    parser.add_argument(
        "--mode",
        choices=["prefill", "decode", "chunked"],
        default="prefill",
        help="how a window goes through each cache: one forward (prefill, default), one token "
        "per forward as generate() feeds it (decode), or --chunk tokens per forward (chunked); "
        "on CPU, decode and chunked steps of rqlib's caches read a decoded copy of the codes "
        "(the same numbers, faster, more memory)",
    )
    parser.add_argument(
        "--chunk", type=int, default=None, help="tokens per forward in --mode chunked"
    )
    parser.add_argument("--window", type=int, default=1024, help="tokens per window")
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="windows fed together as a batch of sequences (default 1): the fp forward and "
        "rqlib's caches take consecutive windows of equal length at once, peers one at a time; "
        "in decode mode on CPU a step of 8 windows costs little more than a step of one",
    )
    parser.add_argument(
        "--stride",
        type=int,
        default=None,
        help="sliding-window protocol with this stride (default: non-overlapping)",
    )
    parser.add_argument(
        "--method",
        action="append",
        default=[],
        metavar="SPEC",
        help="a compression spec or a peer (hf-quanto:int4, ...; repeatable); 'fp' is always "
        "included",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=4096,
        help="context length at which exact tokens are amortized in the bits",
    )
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="also write results as JSON"
    )
    _force_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _parse_methods(specs: list[str]):
    from rqlib.spec.config import CompressionConfig
    from rqlib.study.peers import Peer, is_peer

    configs, seen = [], set()
    for spec in specs:
        if spec == "fp":
            continue
        config = Peer.parse(spec) if is_peer(spec) else CompressionConfig.parse(spec)
        if spec in seen:
            raise ValueError(f"method {spec!r} given twice")
        seen.add(spec)
        configs.append(config)
    return configs


def format_table(rows: list[dict]) -> str:
    """A Markdown table of result rows (``MethodResult.to_dict`` outputs)."""
    header = [
        "method",
        "PPL",
        "ΔPPL %",
        "KL",
        "top-1",
        "K bits",
        "V bits",
        "bits/coord",
        "bytes/token",
        "s/token",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in rows:
        delta = row.get("delta_ppl_pct", 0.0)
        cells = [
            row["label"],
            f"{row['perplexity']:.3f}",
            "—" if row["label"] == "fp" else f"{delta:+.2f}",
            f"{row['kl']:.4f}",
            f"{row['top1']:.4f}",
            f"{row['bits']['key']:.3f}",
            f"{row['bits']['value']:.3f}",
            f"{row['bits']['mean']:.3f}",
            f"{row['bytes_per_token']:.0f}",
            f"{row['seconds_per_token']:.4f}" if "seconds_per_token" in row else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _prepare_eval(args: argparse.Namespace):
    """Check every input of ``eval`` (nothing long runs before this returns)."""
    from rqlib.base.corpora import load_corpus, tokenize_corpus
    from rqlib.hf.integration import check_config
    from rqlib.hf.models import load_model
    from rqlib.spec.config import CompressionConfig
    from rqlib.study.allocation import check_budget
    from rqlib.study.eval import check_methods, check_scored_tokens, evaluation_tokens, windows

    with _user_input():
        configs = _parse_methods(args.method)
    for name in ("window", "context"):
        _at_least(name, getattr(args, name), 2)
    _at_least("tokens", args.tokens, 0)
    _at_least("offset", args.offset, 0)
    _at_least("batch", args.batch, 1)
    if (args.mode == "chunked") != (args.chunk is not None):
        raise UsageError("--chunk N goes with --mode chunked (and only with it)")
    with _user_input("--method"):
        check_methods(configs, args.mode, args.chunk, resolved=False)
    with _user_input("--stride"):
        windows(args.window, args.window, args.stride)
    if args.tokens:  # 0 (the whole corpus) is checked once the corpus is tokenized
        with _user_input("--tokens"):
            check_scored_tokens(args.tokens, args.window, args.stride)
    device = _check_device(args.device)
    _check_output(args.json, args.force)
    with _user_input():
        corpus = load_corpus(args.corpus)
    with _user_input(f"--model {args.model}"):
        model, tokenizer = load_model(args.model)
    with _user_input(f"--tokens ({args.corpus})"):
        ids = evaluation_tokens(
            tokenize_corpus(corpus, tokenizer), args.offset, args.tokens, args.window, args.stride
        )
    with _user_input("--method"):
        for config in configs:
            if isinstance(config, CompressionConfig):
                check_config(model, config)
                check_budget(config, model.config, args.context)
    return configs, corpus, model.to(device), tokenizer, ids


def _run_eval(args: argparse.Namespace) -> int:
    import torch

    from rqlib.spec.config import CompressionConfig
    from rqlib.study.allocation import resolve
    from rqlib.study.eval import evaluate, tokens_sha256, windows

    started = time.time()
    configs, corpus, model, tokenizer, ids = _prepare_eval(args)
    configs = [
        resolve(config, model, tokenizer, context=args.context, progress=not args.no_progress)
        if isinstance(config, CompressionConfig)
        else config
        for config in configs
    ]
    results = evaluate(
        model,
        ids,
        configs,
        window=args.window,
        stride=args.stride,
        tokenizer=tokenizer,
        context=args.context,
        mode=args.mode,
        chunk=args.chunk,
        batch=args.batch,
        progress=not args.no_progress,
    )
    fp_perplexity = results[0].perplexity
    rows = [result.to_dict(fp_perplexity) for result in results]
    n_tokens = int(ids.numel())
    print(
        f"{args.model} on {args.corpus}: {n_tokens} tokens from offset {args.offset}, "
        f"windows of {args.window}"
        + (f", stride {args.stride}" if args.stride else " (non-overlapping)")
        + f", {args.mode} mode"
        + (f" ({args.chunk} tokens per forward)" if args.chunk else "")
        + (f", {args.batch} windows per batch" if args.batch > 1 else "")
        + f", bits amortized at {args.context} tokens"
    )
    print(format_table(rows))
    if args.json is not None:
        payload = {
            "kind": "eval",
            "command": _command_line(args.argv),
            "model": args.model,
            "corpus": corpus.provenance(),
            "offset": args.offset,
            "tokens": n_tokens,
            "tokens_sha256": tokens_sha256(ids),
            "window": args.window,
            "stride": args.stride,
            "windows": len(windows(n_tokens, args.window, args.stride)),
            "mode": args.mode,
            "chunk": args.chunk,
            "batch": args.batch,
            "reference": "the uncompressed model, one forward per window (fp)",
            "context": args.context,
            "device": args.device,
            "torch_threads": torch.get_num_threads(),
            "seconds": round(time.time() - started, 1),
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": rows,
        }
        _write_json(args.json, payload, args.force)
        print(f"wrote {args.json}")
    return 0


# ---- experiment ------------------------------------------------------------------------------
def _experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="wikitext-2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument(
        "--presets", nargs="*", default=list(PRESETS), help="presets to run (default: all)"
    )
    parser.add_argument(
        "--levers",
        nargs="*",
        default=None,
        help="lever names, 'none' for presets only (default: all)",
    )
    parser.add_argument(
        "--preset-levers",
        action="append",
        default=[],
        metavar="PRESET=LEVER,LEVER",
        help="levers for one preset (repeatable); overrides --levers for the presets it names",
    )
    parser.add_argument("--baseline", action="append", default=[], metavar="SPEC")
    parser.add_argument("--json", type=Path, required=True)
    _force_argument(parser)
    parser.add_argument("--no-progress", action="store_true")


def _prepare_experiment(args: argparse.Namespace):
    """Check every input of ``experiment``; return the levers argument of run_experiment."""
    from rqlib.base.corpora import load_corpus, tokenize_corpus
    from rqlib.hf.models import load_tokenizer
    from rqlib.spec.config import CompressionConfig, get_preset
    from rqlib.study.experiments import LEVERS

    for name in ("tokens", "window", "context"):
        _at_least(name, getattr(args, name), 2)
    _check_output(args.json, args.force)
    if not args.presets and not args.baseline:
        raise UsageError("give at least one preset (--presets) or --baseline")
    with _user_input("--presets"):
        for name in args.presets:
            get_preset(name)
    with _user_input("--baseline"):
        for spec in args.baseline:
            CompressionConfig.parse(spec)
    levers = [] if args.levers == ["none"] else args.levers
    if args.preset_levers:
        per_preset = {name: (list(LEVERS) if levers is None else levers) for name in args.presets}
        for item in args.preset_levers:
            name, equals, names = item.partition("=")
            if not equals:
                raise UsageError(f"--preset-levers {item!r}: use PRESET=LEVER,LEVER")
            if name not in args.presets:
                raise UsageError(f"--preset-levers names {name!r}, not in --presets")
            per_preset[name] = [lever for lever in names.split(",") if lever]
        levers = per_preset
    chosen = [*levers.values()] if isinstance(levers, dict) else [levers or []]
    unknown = sorted({lever for names in chosen for lever in names} - set(LEVERS))
    if unknown:
        raise UsageError(f"unknown levers {unknown}; known: {', '.join(LEVERS)}")
    with _user_input():
        corpus = load_corpus(args.corpus)
    with _user_input(f"--model {args.model}"):
        tokenizer = load_tokenizer(args.model)
    with _user_input("--tokens"):
        tokenize_corpus(corpus, tokenizer, args.tokens)
    return levers


def _run_experiment(args: argparse.Namespace) -> int:
    from rqlib.study.experiments import run_experiment

    levers = _prepare_experiment(args)
    payload = run_experiment(
        args.model,
        args.presets,
        levers=levers,
        baselines=args.baseline,
        corpus=args.corpus,
        tokens=args.tokens,
        window=args.window,
        context=args.context,
        progress=not args.no_progress,
        command=_command_line(args.argv),
    )
    for row in payload["rows"]:
        print(
            f"{row['label']:<44} K {row['bits_key']:.3f} V {row['bits_value']:.3f} "
            f"mean {row['bits_mean']:.3f}  PPL {row['perplexity']:.3f} "
            f"({row['delta_ppl_pct']:+.2f}%)  KL {row['kl']:.4f}  top1 {row['top1']:.4f}"
        )
    _write_json(args.json, payload, args.force)
    print(f"wrote {args.json}")
    return 0


# ---- allocate --------------------------------------------------------------------------------
def _allocate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--base",
        default=None,
        help="the config whose storage format the table is for (default: the presets')",
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--json", required=True, type=Path)
    _force_argument(parser)
    parser.add_argument(
        "--budget",
        type=float,
        nargs="*",
        default=[],
        help="also print the allocation for these budgets",
    )
    parser.add_argument("--no-progress", action="store_true")


def _run_allocate(args: argparse.Namespace) -> int:
    from rqlib.base.corpora import load_corpus, tokenize_corpus
    from rqlib.hf.models import load_model
    from rqlib.spec.config import CompressionConfig
    from rqlib.study.allocation import (
        allocate,
        check_budget,
        measure_table,
        presets_base,
        with_budget,
    )

    _at_least("tokens", args.tokens, 2)
    _check_output(args.json, args.force)
    with _user_input("--base"):
        base = presets_base() if args.base is None else CompressionConfig.parse(args.base)
        budgets = [with_budget(base, budget) for budget in args.budget]
    with _user_input(f"--model {args.model}"):
        model, tokenizer = load_model(args.model)
    with _user_input("--budget"):
        for config in budgets:
            check_budget(config, model.config)
    with _user_input("--tokens"):  # the table reads the calibration corpus after its tokens
        needed = base.calibration_tokens + args.tokens
        tokenize_corpus(load_corpus(base.calibration_corpus), tokenizer, needed)
    sensitivity, payload = measure_table(
        args.model,
        base,
        tokens=args.tokens,
        command=_command_line(args.argv),
        progress=not args.no_progress,
        loaded=(model, tokenizer),
    )
    _write_json(args.json, payload, args.force, indent=1)
    for config in budgets:
        resolved = allocate(sensitivity, config, model.config)
        print(f"alloc={config.budget:g}: {resolved.spec()}")
    print(f"wrote {args.json}")
    return 0


# ---- sweep -----------------------------------------------------------------------------------
def _sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "notebook",
        type=Path,
        nargs="?",
        help="the chapter to run, e.g. notebooks/04_perplexity.ipynb",
    )
    parser.add_argument(
        "-p",
        "--parameter",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a parameter and the values to sweep it over (repeat for a grid)",
    )
    parser.add_argument(
        "-f", "--parameters-file", type=Path, help="YAML file of fixed parameters for every run"
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        help="where the runs' results go (default $RQLIB_RESULTS_DIR, else <repo>/sweeps); "
        "chapter 5 draws from it with -p results_dir DIR",
    )
    parser.add_argument(
        "--into-committed-results",
        action="store_true",
        help="write into the committed results/ the book reads (never without this option)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="where executed notebooks go (default <results-dir>/runs/<chapter>)",
    )
    parser.add_argument("--kernel", help="Jupyter kernel name (default: the notebook's)")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the parameters and list the runs only"
    )
    parser.add_argument(
        "--resume", action="store_true", help="run only the runs that have no results file yet"
    )
    parser.add_argument(
        "--status",
        type=Path,
        metavar="DIR",
        help="report every run of the sweep in results folder DIR (queued, running, done, "
        "failed; job id, wall time, error) and exit",
    )
    parser.add_argument(
        "--save-status",
        type=Path,
        metavar="FILE",
        help="with --status: also write the table to FILE (refused if it exists, unless --force)",
    )
    parser.add_argument("--force", action="store_true", help="with --save-status: replace FILE")
    parser.add_argument(
        "--executor",
        choices=["local", "slurm"],
        default="local",
        help="local: a process pool on this machine (default); slurm: one Slurm job per run",
    )
    parser.add_argument("--jobs", type=int, default=1, help="local: runs in parallel (default 1)")
    slurm = parser.add_argument_group("--executor slurm")
    slurm.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    slurm.add_argument("--gpus-per-run", type=int, default=0, help="GPUs per run (default 0)")
    slurm.add_argument("--time-limit", type=int, metavar="MINUTES", help="time limit per run")
    slurm.add_argument("--mem", help="memory per run, as sbatch reads it (e.g. 16G)")
    slurm.add_argument("--cpus-per-run", type=int, help="CPUs per run")
    slurm.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra sbatch option, name=value or name (e.g. qos=high; repeat for more)",
    )
    slurm.add_argument(
        "--slurm-config",
        type=Path,
        metavar="YAML",
        help="a YAML file of submitit SlurmExecutor parameters (the options above override it)",
    )
    slurm.add_argument(
        "--detach", action="store_true", help="submit and return; follow with --status DIR"
    )


#: The options that only --executor slurm reads, with their defaults.
_SLURM_ONLY = {
    "partition": None,
    "gpus_per_run": 0,
    "time_limit": None,
    "mem": None,
    "cpus_per_run": None,
    "sbatch": [],
    "slurm_config": None,
    "detach": False,
}


def _run_sweep(args: argparse.Namespace) -> int:
    from rqlib.book.sweep import (
        fixed_from_file,
        format_status,
        grid_from_pairs,
        plan_sweep,
        result_path,
        results_written,
        run_sweep,
        sweep_results_dir,
        sweep_status,
    )

    if args.status is not None:
        if args.notebook is not None:
            raise UsageError("--status DIR reports a sweep; give it without a notebook")
        _check_output(args.save_status, args.force)
        with _user_input():
            rows = sweep_status(args.status)
        table = format_status(rows)
        print(table)
        if args.save_status is not None:
            from rqlib.base.files import atomic_write_text

            atomic_write_text(args.save_status, table + "\n")
            print(f"wrote {args.save_status}")
        return 0
    if args.save_status is not None or args.force:
        raise UsageError("--save-status and --force go with --status DIR")
    if args.notebook is None:
        raise UsageError("give the chapter to sweep (or --status DIR)")
    _at_least("jobs", args.jobs, 1)
    _at_least("gpus-per-run", args.gpus_per_run, 0)
    _at_least("time-limit", args.time_limit, 1)
    _at_least("cpus-per-run", args.cpus_per_run, 1)
    if args.executor == "local":
        given = [
            f"--{n.replace('_', '-')}" for n, d in _SLURM_ONLY.items() if getattr(args, n) != d
        ]
        if given:
            raise UsageError(f"{', '.join(given)} only apply with --executor slurm")
    elif args.jobs != 1:
        raise UsageError("--jobs applies to --executor local; Slurm runs each run as a job")
    chapter = Path(args.notebook).stem
    with _user_input():
        results = sweep_results_dir(args.results_dir, into_committed=args.into_committed_results)
        grid = grid_from_pairs(args.parameter)
        fixed = fixed_from_file(args.parameters_file)
        runs = plan_sweep(args.notebook, grid, fixed, args.output_dir, results)
        if args.executor == "slurm":
            from rqlib.book.slurm import SlurmOptions, make_executor

            options = SlurmOptions(
                partition=args.partition,
                gpus_per_run=args.gpus_per_run,
                time_minutes=args.time_limit,
                mem=args.mem,
                cpus_per_run=args.cpus_per_run,
                sbatch_flags=tuple(args.sbatch),
                config=args.slurm_config,
            )
            make_executor(results / "runs" / chapter / "slurm", options)  # checks the options
    if args.resume:
        kept = [run for run in runs if result_path(results, chapter, run.run_id) is None]
        print(f"--resume: {len(runs) - len(kept)} of {len(runs)} runs have results already")
        runs = kept
    if args.dry_run:
        for planned in runs:
            print(planned.run_id, planned.parameters)
        return 0
    if not runs:
        print(f"nothing to run; results: {results / chapter}")
        return 0
    if args.executor == "slurm":
        return _run_slurm_sweep(args, runs, results, options)
    started = time.time()
    failures = run_sweep(
        args.notebook, runs, jobs=args.jobs, kernel_name=args.kernel, results=results
    )
    failed = {run.run_id for run, _ in failures}
    for run in runs:  # a run that executed but saved nothing did not succeed either
        if run.run_id not in failed and not results_written(chapter, run, started, results):
            failures.append((run, RuntimeError(f"wrote no results file in {results / chapter}")))
    succeeded = len(runs) - len(failures)
    print(f"{succeeded}/{len(runs)} runs succeeded; results: {results / chapter}")
    print(f"progress and errors of every run: {PROG} sweep --status {results}")
    for run, error in failures:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        print(f"FAILED {run.run_id}: {first_line} (see {run.output_notebook})", file=sys.stderr)
    return 1 if failures else 0


def _run_slurm_sweep(args: argparse.Namespace, runs: list, results: Path, options) -> int:
    from rqlib.book.slurm import submit_sweep, wait_for_sweep

    chapter = Path(args.notebook).stem
    with _user_input():
        jobs = submit_sweep(args.notebook, runs, results, options, kernel_name=args.kernel)
    print(f"submitted {len(jobs)} Slurm jobs: {' '.join(jobs.values())}")
    print(f"progress and errors of every run: {PROG} sweep --status {results}")
    if args.detach:
        return 0
    failures = wait_for_sweep(results, chapter, list(jobs))
    print(f"{len(runs) - len(failures)}/{len(runs)} runs succeeded; results: {results / chapter}")
    for row in failures:
        print(
            f"FAILED {row['run_id']} (Slurm job {row['job_id']}): {row['error']} "
            f"(log: {row['log'] or 'none recorded'})",
            file=sys.stderr,
        )
    return 1 if failures else 0


# ---- render ----------------------------------------------------------------------------------
def _render_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("notebook", type=Path, help="a chapter executed by papermill (out.ipynb)")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        metavar="PATH",
        help="the HTML page to write (default: the notebook's name with .html)",
    )
    parser.add_argument("--force", action="store_true", help="replace the HTML file if it exists")


def _run_render(args: argparse.Namespace) -> int:
    from rqlib.book.render import render_notebook

    with _user_input():
        written = render_notebook(args.notebook, args.output, force=args.force)
    print(f"wrote {written}")
    return 0


# ---- bench -----------------------------------------------------------------------------------
def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from rqlib.study.bench import DEFAULT_KV_LENS

    parser.add_argument(
        "what",
        choices=["gpu", "kernels", "decode-cpu"],
        help="gpu: the GPU check (correctness, generate through the kernels, kernel and call "
        "timings against fp16 SDPA, generate timings, start-up), written to --out; kernels: "
        "kernel timings on a GPU (the byte model without one); decode-cpu: time per decode step "
        "on CPU, the fp cache and presets side by side",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="gpu: the report's folder (default <checkout>/results/bench); the file is "
        "gpu-<device>-<commit>.json",
    )
    parser.add_argument(
        "--only", nargs="+", default=None, metavar="STEP", help="gpu: run only these steps"
    )
    parser.add_argument(
        "--batches", type=_int_list, default=None, help="gpu: comma-separated batches (1,8)"
    )
    parser.add_argument(
        "--prompt", type=int, default=None, help="gpu: prompt tokens of the generate timings"
    )
    parser.add_argument("--model", default="smollm2-135m", help="decode-cpu: the model")
    parser.add_argument("--context", type=int, default=1024, help="decode-cpu: tokens before")
    parser.add_argument("--steps", type=int, default=32, help="decode-cpu: steps timed")
    parser.add_argument(
        "--presets",
        nargs="+",
        default=None,
        help="decode-cpu and gpu: presets to time, each optionally with spec tokens "
        "(rq-3:tcq:tb); decode-cpu's default rq-3.5, gpu's (its generate timings) rq-3",
    )
    parser.add_argument("--threads", type=int, default=None, help="decode-cpu: torch threads")
    parser.add_argument(
        "--json", type=Path, default=None, help="decode-cpu: also write the result here"
    )
    parser.add_argument("--force", action="store_true", help="replace the --json file if it exists")
    parser.add_argument(
        "--kv-lens",
        type=_int_list,
        default=DEFAULT_KV_LENS,
        help="comma-separated context lengths (default 1k..128k; gpu: 4k..128k)",
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument(
        "--batch", type=int, default=1, help="sequences per step (kernels and decode-cpu)"
    )
    parser.add_argument("--key-method", default="turboquant-prod")
    parser.add_argument("--key-bits", type=int, default=3)
    parser.add_argument("--value-method", default="turboquant-mse")
    parser.add_argument("--value-bits", type=int, default=4)
    parser.add_argument("--hbm-gbps", type=float, default=None, help="override the peak HBM GB/s")
    parser.add_argument("--cpu", action="store_true", help="print the byte model even on a GPU")


def _int_list(text: str) -> tuple[int, ...]:
    """``"1024,4096"`` -> ``(1024, 4096)`` (argparse reports a ValueError as invalid input)."""
    return tuple(int(item) for item in text.split(","))


_int_list.__name__ = "comma-separated int list"


def _run_bench(args: argparse.Namespace) -> int:
    import torch

    from rqlib.study.bench import decode_cpu, print_byte_model, print_decode_cpu, run_gpu

    if args.what == "gpu":
        return _run_bench_gpu(args)
    if args.what == "decode-cpu":
        for name, minimum in (("context", 1), ("steps", 1), ("batch", 1)):
            _at_least(name, getattr(args, name), minimum)
        if args.threads is not None:
            _at_least("threads", args.threads, 1)
        presets = _bench_presets(args.presets or ["rq-3.5"])
        _check_output(args.json, args.force)
        with _user_input(f"--model {args.model}"):
            result = decode_cpu(
                args.model,
                args.context,
                args.steps,
                presets,
                args.threads,
                batch=args.batch,
            )
        print_decode_cpu(result)
        if args.json:
            _write_json(args.json, result, args.force, indent=1)
        return 0
    from rqlib.core.quantizers import make_quantizer

    for name, minimum in (("head_dim", 2), ("kv_heads", 1), ("group", 1), ("batch", 1)):
        _at_least(name.replace("_", "-"), getattr(args, name), minimum)
    if not args.kv_lens or min(args.kv_lens) < 1:
        raise UsageError(f"--kv-lens must be positive context lengths, got {args.kv_lens}")
    if args.hbm_gbps is not None and not args.hbm_gbps > 0:
        raise UsageError(f"--hbm-gbps must be > 0, got {args.hbm_gbps}")
    with _user_input("--key-method/--key-bits"):
        make_quantizer(args.key_method, args.head_dim, args.key_bits)
    with _user_input("--value-method/--value-bits"):
        make_quantizer(args.value_method, args.head_dim, args.value_bits)
    if args.cpu or not torch.cuda.is_available():
        print_byte_model(args)
        print("\nTimings need a CUDA GPU: rerun `python -m rqlib bench kernels` on one.")
        return 0
    return run_gpu(args)


def _run_bench_gpu(args: argparse.Namespace) -> int:
    """``bench gpu``: refuse without CUDA, then run :func:`rqlib.study.gpu_bench.run` into a
    new report (or over one with ``--force``)."""
    import torch

    from rqlib.base.paths import repo_root
    from rqlib.book.provenance import git_commit, package_versions
    from rqlib.study import gpu_bench

    if args.only:
        unknown = sorted(set(args.only) - set(gpu_bench.STEPS))
        if unknown:
            raise UsageError(f"--only: unknown step {unknown[0]!r}; the steps are "
                             f"{', '.join(gpu_bench.STEPS)}")  # fmt: skip
    for name, values in (("kv-lens", args.kv_lens), ("batches", args.batches)):
        if values is not None and (not values or min(values) < 1):
            raise UsageError(f"--{name} must be positive integers, got {values}")
    if args.prompt is not None:
        _at_least("prompt", args.prompt, 1)
    presets = None if args.presets is None else _bench_presets(args.presets)
    if not torch.cuda.is_available():
        raise UsageError("bench gpu needs a CUDA device; torch sees none on this machine")
    device = torch.cuda.get_device_name()
    commit = git_commit()
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    folder = args.out if args.out is not None else repo_root() / "results" / "bench"
    path = Path(folder) / f"gpu-{slug}-{commit[:12]}.json"
    _check_output(path, args.force)
    header = {
        "device": device,
        "commit": commit,
        "versions": package_versions(),
        "cuda": torch.version.cuda,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    options = {}
    from rqlib.study.bench import DEFAULT_KV_LENS

    if args.kv_lens != DEFAULT_KV_LENS:
        options["kv_lens"] = args.kv_lens
    if args.batches is not None:
        options["batches"] = args.batches
    if args.prompt is not None:
        options["context"] = args.prompt
    if presets is not None:
        options["presets"] = presets
    print(f"bench gpu on {device} at {commit}; report: {path}", flush=True)
    report = gpu_bench.Report(path, header)
    ok = gpu_bench.run(report, steps=args.only or gpu_bench.STEPS, **options)
    print(f"wrote {path}")
    return 0 if ok else 1


# ---- routing ---------------------------------------------------------------------------------
COMMANDS = {
    "eval": (
        _eval_arguments,
        _run_eval,
        "perplexity / KL / top-1 of compressed caches on a model",
    ),
    "experiment": (
        _experiment_arguments,
        _run_experiment,
        "presets, their one-lever ablations and baselines in one evaluation",
    ),
    "allocate": (
        _allocate_arguments,
        _run_allocate,
        "measure a model's sensitivity table for per-layer bit allocation",
    ),
    "sweep": (
        _sweep_arguments,
        _run_sweep,
        "run a chapter with papermill over a grid of parameters",
    ),
    "render": (
        _render_arguments,
        _run_render,
        "an executed chapter (papermill output) as one HTML page, figures and numbers in place",
    ),
    "bench": (
        _bench_arguments,
        _run_bench,
        "kernel benchmarks (GPU) or the byte-count model (CPU)",
    ),
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command.

    Returns the exit status: 0, 1 (some sweep runs failed) or 2 (a user error, one line on
    stderr). Exceptions other than user errors propagate with their traceback (bugs).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _Parser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, run, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(_run=run)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return int(args._run(args) or 0)
    except UsageError as error:
        text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        print(f"{PROG} {args.command}: error: {text}", file=sys.stderr)
        return 2
