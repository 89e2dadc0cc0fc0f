"""Perplexity, KL and top-1 agreement of compressed KV caches on a real model.

Example (the closing-note table of issue 4):

  python -m rqlib eval --model smollm2-135m --corpus wikitext-2 --tokens 4096 --window 1024 \\
      --method turboquant-mse:k3 --method turboquant-prod:k3 --method preset:rq-3.5

The uncompressed model ("fp") is always evaluated, once per window, and every method is
compared with it on the same tokens. Columns: PPL, change of PPL vs fp in %, mean KL(fp || method)
in nats, top-1 agreement with fp, average bits per K / V coordinate and their mean (codes,
norms, QJL bits, exact sink/recent tokens and exact layers amortized at --context tokens),
and the cache bytes per token those bits imply.

Method specs: METHOD[:TOKEN]... with METHOD one of turboquant-mse, turboquant-prod,
rotorquant-mse, rotorquant-prod, or preset:NAME[:TOKEN]...; TOKENs:
  k3 | k=3        key bits (1..8; -prod needs >= 2)         default 3
  v4 | v=4 | v=fp value bits; fp (default) = values in full precision
  b3              key and value bits
  k0-1=4, v29=5   bits of one layer or an inclusive range of layers (v..=fp allowed)
  sink1           first N tokens exact          win32   W most recent tokens exact (per query)
  exact=0,-1      layers kept exact (negative: from the end)
  ctr             per-head key centering, mean calibrated on pydoc (never the eval text)
  ks / vs         key / value channel scaling by calibrated query / o_proj energies
  alloc=3.5       per-layer K and V bits chosen from measured sensitivity (rqlib.allocation)
                  so that the average bits are at most 3.5; the presets use it
  ko32 / vo32 / out32   K / V / both outlier channels (calibrated) at +1 bit; obits=2
  nc              norm correction (least-squares scale; -mse methods)
  rot=dense|hadamard|rotor|none   qjl=gaussian|orthogonal   m=128 (QJL rows)
  law=beta|gaussian (codebook)    seed=0    calib=pydoc    ctok=2048 (calibration tokens)
Values always use the -mse quantizer of the method's family.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["add_arguments", "format_table", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m rqlib eval``."""
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
    from rqlib.hf.config import CompressionConfig

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


def run(args: argparse.Namespace) -> int:
    """Run the evaluation, print the table, optionally write JSON."""
    import torch

    from rqlib.data import load_corpus, tokenize_corpus
    from rqlib.eval import evaluate
    from rqlib.models import load_model

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
        payload = {
            "command": "python -m rqlib eval " + " ".join(sys.argv[2:])
            if sys.argv[1:2] == ["eval"]
            else None,
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
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
