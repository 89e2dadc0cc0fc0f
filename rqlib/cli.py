"""The command line: ``python -m rqlib COMMAND ...`` (or ``rqlib COMMAND ...``).

Commands:

  eval        perplexity, KL and top-1 of compressed caches against the uncompressed model
  experiment  the presets, their one-lever ablations and baselines in one evaluation
  allocate    measure a model's sensitivity table (what per-layer bits are allocated from)
  sweep       run a chapter with papermill once per combination of parameters
  bench       kernel benchmarks on a GPU, or the byte-count model without one

Each command is a thin layer over a library function; this module holds every argument
definition, so ``python -m rqlib COMMAND --help`` is the reference.

Method specs (eval, experiment): METHOD[:TOKEN]... with METHOD one of turboquant-mse,
turboquant-prod, rotorquant-mse, rotorquant-prod, or preset:NAME[:TOKEN]...; TOKENs:
  k3 | k=3        key bits (1..8; -prod needs >= 2)         default 3
  v4 | v=4 | v=fp value bits; fp (default) = values in full precision
  b3              key and value bits
  k0-1=4, v29=5   bits of one layer or an inclusive range of layers (v..=fp allowed)
  sink1           first N tokens exact          win32   W most recent tokens exact (per query)
  wb=8            the recent band stored as 8-bit codes instead of exact copies
  exact=0,-1      layers kept exact (negative: from the end)
  ctr             per-head key centering, mean calibrated on pydoc (never the eval text)
  ks / vs         key / value channel scaling by calibrated query / o_proj energies
  alloc=3.5       per-layer K and V bits chosen from measured sensitivity so that the average
                  bits are at most 3.5; the presets use it
  ko32 / vo32 / out32   K / V / both outlier channels (calibrated) at +1 bit; obits=2
  nc              norm correction (least-squares scale; -mse methods)
  nm=6            norms rounded to 6 mantissa bits (11 bits each instead of 16)
  rot=dense|hadamard|rotor|none   qjl=gaussian|orthogonal   m=128 (QJL rows)
  law=beta|gaussian (codebook)    seed=0    calib=pydoc    ctok=2048 (calibration tokens)
Values always use the -mse quantizer of the method's family.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

__all__ = ["format_table", "main"]


def _command_line(argv: list[str]) -> str:
    return "python -m rqlib " + shlex.join(argv)


# ---- eval ------------------------------------------------------------------------------------
def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m, gemma3-270m (offline), or a hub id / local path",
    )
    parser.add_argument("--corpus", default="wikitext-2", help="wikitext-2 or pydoc")
    parser.add_argument(
        "--tokens", type=int, default=4096, help="number of leading tokens (no BOS)"
    )
    parser.add_argument("--window", type=int, default=1024, help="tokens per window")
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
        help="a compression spec (repeatable); 'fp' is always included",
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
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _parse_methods(specs: list[str]):
    from rqlib.spec.config import CompressionConfig

    configs, seen = [], set()
    for spec in specs:
        if spec == "fp":
            continue
        config = CompressionConfig.parse(spec)
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
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_eval(args: argparse.Namespace) -> int:
    import torch

    from rqlib.base.corpora import load_corpus, tokenize_corpus
    from rqlib.hf.models import load_model
    from rqlib.study.allocation import resolve
    from rqlib.study.eval import evaluate

    try:
        configs = _parse_methods(args.method)
        for name in ("tokens", "window", "context"):
            if getattr(args, name) < 2:
                raise ValueError(f"--{name} must be >= 2, got {getattr(args, name)}")
        corpus = load_corpus(args.corpus)
        started = time.time()
        model, tokenizer = load_model(args.model)
    except (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = model.to(torch.device(args.device))
    ids = tokenize_corpus(corpus, tokenizer, args.tokens)
    configs = [resolve(config, model, tokenizer, context=args.context) for config in configs]
    results = evaluate(
        model,
        ids,
        configs,
        window=args.window,
        stride=args.stride,
        tokenizer=tokenizer,
        context=args.context,
        progress=not args.no_progress,
    )
    fp_perplexity = results[0].perplexity
    rows = [result.to_dict(fp_perplexity) for result in results]
    print(
        f"{args.model} on {args.corpus}: {args.tokens} tokens, windows of {args.window}"
        + (f", stride {args.stride}" if args.stride else " (non-overlapping)")
        + f", bits amortized at {args.context} tokens"
    )
    print(format_table(rows))
    if args.json is not None:
        from rqlib.base.files import atomic_write_text

        payload = {
            "command": _command_line(args.argv),
            "model": args.model,
            "corpus": corpus.provenance(),
            "tokens": args.tokens,
            "window": args.window,
            "stride": args.stride,
            "context": args.context,
            "device": args.device,
            "seconds": round(time.time() - started, 1),
            "results": rows,
        }
        atomic_write_text(args.json, json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


# ---- experiment ------------------------------------------------------------------------------
def _experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="wikitext-2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--presets", nargs="*", default=["rq-3.5", "rq-3", "rq-2.5"])
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
    parser.add_argument("--no-progress", action="store_true")


def _run_experiment(args: argparse.Namespace) -> int:
    from rqlib.study.experiments import LEVERS, run_experiment

    levers = [] if args.levers == ["none"] else args.levers
    if args.preset_levers:
        per_preset = {name: (list(LEVERS) if levers is None else levers) for name in args.presets}
        for item in args.preset_levers:
            name, _, names = item.partition("=")
            if name not in args.presets:
                print(f"error: --preset-levers names {name!r}, not in --presets", file=sys.stderr)
                return 2
            per_preset[name] = [lever for lever in names.split(",") if lever]
        levers = per_preset
    payload = run_experiment(
        args.model,
        args.presets,
        levers=levers,
        baselines=args.baseline,
        corpus=args.corpus,
        tokens=args.tokens,
        window=args.window,
        context=args.context,
        json_path=args.json,
        progress=not args.no_progress,
        command=_command_line(args.argv),
    )
    for row in payload["rows"]:
        print(
            f"{row['label']:<44} K {row['bits_key']:.3f} V {row['bits_value']:.3f} "
            f"mean {row['bits_mean']:.3f}  PPL {row['perplexity']:.3f} "
            f"({row['delta_ppl_pct']:+.2f}%)  KL {row['kl']:.4f}  top1 {row['top1']:.4f}"
        )
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
    parser.add_argument(
        "--budget",
        type=float,
        nargs="*",
        default=[],
        help="also print the allocation for these budgets",
    )
    parser.add_argument("--no-progress", action="store_true")


def _run_allocate(args: argparse.Namespace) -> int:
    from rqlib.base.files import atomic_write_text
    from rqlib.hf.models import load_model
    from rqlib.spec.config import CompressionConfig
    from rqlib.study.allocation import allocate, measure_table, presets_base

    base = presets_base() if args.base is None else CompressionConfig.parse(args.base)
    sensitivity, payload = measure_table(
        args.model,
        base,
        tokens=args.tokens,
        command=_command_line(args.argv),
        progress=not args.no_progress,
    )
    atomic_write_text(args.json, json.dumps(payload, indent=1) + "\n")
    if args.budget:
        model_config = load_model(args.model)[0].config
        for budget in args.budget:
            resolved = allocate(
                sensitivity, base.replace(value_bits=3, budget=budget), model_config
            )
            print(f"alloc={budget:g}: {resolved.spec()}")
    print(f"wrote {args.json}")
    return 0


# ---- sweep -----------------------------------------------------------------------------------
def _sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "notebook", type=Path, help="the chapter to run, e.g. notebooks/04_perplexity.ipynb"
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
    parser.add_argument("--jobs", type=int, default=1, help="runs executed in parallel (default 1)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="where executed notebooks go (default <repo>/book/_generated/<chapter>)",
    )
    parser.add_argument("--kernel", help="Jupyter kernel name (default: the notebook's)")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the parameters and list the runs only"
    )


def _run_sweep(args: argparse.Namespace) -> int:
    from rqlib.book.results import results_dir
    from rqlib.book.sweep import fixed_from_file, grid_from_pairs, plan_sweep, run_sweep

    try:
        grid = grid_from_pairs(args.parameter)
        fixed = fixed_from_file(args.parameters_file)
        runs = plan_sweep(args.notebook, grid, fixed, args.output_dir)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    except (ValueError, FileNotFoundError) as error:
        print(f"sweep: error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        for planned in runs:
            print(planned.run_id, planned.parameters)
        return 0
    failures = run_sweep(args.notebook, runs, jobs=args.jobs, kernel_name=args.kernel)
    chapter = Path(args.notebook).stem
    succeeded = len(runs) - len(failures)
    print(f"{succeeded}/{len(runs)} runs succeeded; results: {results_dir() / chapter}")
    for failed, error in failures:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        where = failed.output_notebook
        print(f"FAILED {failed.run_id}: {first_line} (see {where})", file=sys.stderr)
    return 1 if failures else 0


# ---- bench -----------------------------------------------------------------------------------
def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from rqlib.study.bench import DEFAULT_KV_LENS

    parser.add_argument(
        "what",
        choices=["kernels", "decode-cpu"],
        help="kernels: kernel timings on a GPU (the byte model without one); decode-cpu: time "
        "per decode step on CPU, the fp cache and presets side by side",
    )
    parser.add_argument("--model", default="smollm2-135m", help="decode-cpu: the model")
    parser.add_argument("--context", type=int, default=1024, help="decode-cpu: tokens before")
    parser.add_argument("--steps", type=int, default=32, help="decode-cpu: steps timed")
    parser.add_argument(
        "--presets", nargs="+", default=["rq-3.5"], help="decode-cpu: presets to time"
    )
    parser.add_argument("--threads", type=int, default=None, help="decode-cpu: torch threads")
    parser.add_argument("--json", default=None, help="decode-cpu: also write the result here")
    parser.add_argument(
        "--kv-lens",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=DEFAULT_KV_LENS,
        help="comma-separated context lengths (default 1k..128k)",
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--key-method", default="turboquant-prod")
    parser.add_argument("--key-bits", type=int, default=3)
    parser.add_argument("--value-method", default="turboquant-mse")
    parser.add_argument("--value-bits", type=int, default=4)
    parser.add_argument("--hbm-gbps", type=float, default=None, help="override the peak HBM GB/s")
    parser.add_argument("--cpu", action="store_true", help="print the byte model even on a GPU")
    parser.add_argument(
        "--sweep-tiles",
        action="store_true",
        help="also time the fused attention (packed K and V) for other tile sizes / warp counts "
        "at the largest kv_len (tuning aid; the defaults live in rqlib.kernels.limits)",
    )


def _run_bench(args: argparse.Namespace) -> int:
    import torch

    from rqlib.study.bench import decode_cpu, print_byte_model, print_decode_cpu, run_gpu

    if args.what == "decode-cpu":
        import json

        from rqlib.base.files import atomic_write_text

        result = decode_cpu(args.model, args.context, args.steps, tuple(args.presets), args.threads)
        print_decode_cpu(result)
        if args.json:
            atomic_write_text(args.json, json.dumps(result, indent=1))
        return 0
    if args.cpu or not torch.cuda.is_available():
        print_byte_model(args)
        print("\nTimings need a CUDA GPU: rerun `python -m rqlib bench kernels` on one.")
        return 0
    return run_gpu(args)


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
    "bench": (
        _bench_arguments,
        _run_bench,
        "kernel benchmarks (GPU) or the byte-count model (CPU)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m rqlib",
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
    return int(args._run(args) or 0)
