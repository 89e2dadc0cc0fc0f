"""Command line: ``python -m rqlib <command> ...``.

Each command lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; this file only routes to them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "eval": ("rqlib.evalcli", "perplexity / KL / top-1 of compressed caches on a model"),
    "sweep": ("rqlib.sweep", "run a chapter with papermill over a grid of parameters"),
    "bench": ("rqlib.bench", "kernel benchmarks (GPU) or the byte-count model (CPU)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m rqlib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if name in argv[:1] or not argv or argv[0] in ("-h", "--help"):
            module = importlib.import_module(module_name)
            command = sub.add_parser(
                name,
                help=help_text,
                description=module.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
            module.add_arguments(command)
            command.set_defaults(_run=module.run)
        else:
            sub.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
