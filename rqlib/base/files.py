"""Files written whole or not at all, never over a file by accident, and locks where processes race.

- :func:`atomic_output` yields a temporary path in the target's folder; whatever is written
  there (by any writer: ``json``, ``to_parquet``, ``save_pretrained`` into a folder...) is
  renamed into place when the block ends without an error, and removed otherwise. A reader
  sees the old file or the new one, never half of one. With ``overwrite=False`` an existing
  target is never replaced: a file is linked into place (``os.link`` fails when the name
  exists, even if another process created it a moment ago).
- :func:`atomic_write_text` / :func:`atomic_write_bytes` write a string or bytes that way.
- :func:`check_writable` checks an output path before any long computation: not a folder,
  not an existing file unless ``overwrite``, inside a folder that exists (or can be made) and
  is writable. Every error names the file.
- :func:`file_lock` is an exclusive advisory lock (``fcntl.flock``) held for a ``with`` block.
- :func:`read_json` reads a JSON file and names the file when it is unreadable or truncated.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "CorruptFileError",
    "atomic_output",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_writable",
    "file_lock",
    "read_json",
]


class CorruptFileError(ValueError):
    """A file that exists but cannot be read as what it should be; ``path`` names it."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path} is corrupt or truncated ({reason})")


def _fsync_tree(path: Path) -> None:
    """Flush a file, or every file of a folder, to disk before it is renamed into place."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_output(
    path: Path | str, *, overwrite: bool = True, folder: bool = False
) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it into place when the block succeeds.

    ``folder=True`` when the writer makes a folder (the temporary path does not exist yet
    then). ``overwrite=False`` raises ``FileExistsError`` naming ``path`` if it exists (also
    when it appeared while the block ran); a folder target with ``overwrite=True`` must not
    exist either (a folder cannot be renamed over a non-empty one).
    """
    path = Path(path)
    if path.is_dir() and not folder:
        raise IsADirectoryError(f"{path} is a folder, not a file")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; refusing to overwrite it (use --force)")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    temporary = staging / path.name
    try:
        yield temporary
        if not temporary.exists():
            raise FileNotFoundError(f"nothing was written for {path}")
        _fsync_tree(temporary)
        if folder or overwrite:
            if folder and path.exists():
                raise FileExistsError(f"{path} exists; a folder is never replaced in place")
            os.replace(temporary, path)
        else:  # link: fails if the name exists, never replaces a file another process wrote
            try:
                os.link(temporary, path)
            except FileExistsError:
                raise FileExistsError(
                    f"{path} exists; refusing to overwrite it (use --force)"
                ) from None
    finally:
        _remove(staging)


def atomic_write_text(path: Path | str, text: str, *, overwrite: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; return the path."""
    with atomic_output(path, overwrite=overwrite) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)


def atomic_write_bytes(path: Path | str, data: bytes, *, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically; return the path."""
    with atomic_output(path, overwrite=overwrite) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def check_writable(path: Path | str, *, overwrite: bool = False) -> Path:
    """Check that an output file can be written at ``path``, before the work that produces it.

    Raises ``IsADirectoryError`` (a folder), ``FileExistsError`` (an existing file and not
    ``overwrite``), ``NotADirectoryError`` (a parent is a file) or ``PermissionError`` (the
    folder cannot be made or written in: a file is created and removed there to find out);
    each message names the path. Returns ``path``; its folder exists afterwards.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a file name")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; refusing to overwrite it (use --force)")
    parent = path.parent
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {existing} is a file, not a folder")
    try:  # the only sure test (root passes os.access everywhere): make the folder, write in it
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as error:
        raise PermissionError(
            f"cannot write {path}: {error.strerror or error} in {error.filename or parent}"
        ) from None
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


def read_json(path: Path | str) -> Any:
    """The JSON value in ``path``; :class:`CorruptFileError` naming the file if it does not
    parse (truncated, not UTF-8), ``FileNotFoundError`` naming it if it is missing."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except UnicodeDecodeError as error:
        raise CorruptFileError(path, f"not UTF-8: {error.reason}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CorruptFileError(path, f"invalid JSON: {error.msg} at line {error.lineno}") from None
