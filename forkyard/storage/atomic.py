"""Files replaced in one step that survive a crash: temp file, fsync, rename, fsync of the directory.

A plain ``write_text`` over a state file leaves a torn or empty file when the process or the host
dies half-way; a rename without the fsyncs can leave the new name pointing at data that never
reached the disk. Readers of a file written here see the old content or the new, never a mix.
Cached artifacts are built under :func:`exclusive` (concurrent builders wait for the first one)
and given their name by :func:`publish`.

Imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (across threads and processes)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fsync_path(path: Path) -> None:
    """Flush one file's data, or one directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` (a file, or a directory of files) over ``final``, durably."""
    if tmp.is_dir():
        for child in tmp.iterdir():
            if child.is_file() and not child.is_symlink():
                fsync_path(child)
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` in one step (see the module docstring)."""
    # Unique per thread: two writers of one file must not share a temp file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_json_atomic(path: Path, value: Any, *, indent: int | None = None) -> None:
    """Replace ``path`` with ``value`` as JSON, in one step."""
    write_atomic(path, json.dumps(value, indent=indent) + "\n")
