"""Files written whole or not at all, and locks where processes race.

:func:`atomic_write_text` writes into a temporary file in the target's folder and renames it
into place, so a reader sees the old file or the new one, never half of one; :func:`file_lock`
is an exclusive advisory lock (``fcntl.flock``) held for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_write_text", "file_lock"]


def atomic_write_text(path: Path | str, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temporary file + rename); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False, encoding="utf-8"
    )
    try:
        with handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)
        raise
    return path


@contextlib.contextmanager
def file_lock(path: Path | str) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if missing), held for the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
