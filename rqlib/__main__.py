"""``python -m rqlib COMMAND ...``: see :mod:`rqlib.cli`."""

from rqlib.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
