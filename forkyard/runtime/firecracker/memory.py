"""Guest memory files of Firecracker snapshots.

A ``Diff`` snapshot's memory file is sparse: it holds only the pages dirtied since the snapshot
the VM was last saved to or loaded from, at their guest offsets, and holes elsewhere. Restoring
needs one complete file, so a diff is applied onto a copy (a reflink where the file system can)
of that snapshot's memory: only the dirty pages are written.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

_CHUNK = 8 << 20


def data_ranges(path: Path) -> Iterator[tuple[int, int]]:
    """(offset, length) of every allocated range of a sparse file (SEEK_DATA/SEEK_HOLE)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after offset
                    return
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            yield start, end - start
            offset = end
    finally:
        os.close(fd)


def copy_cow(src: Path, dst: Path) -> None:
    """Copy by reflink where the file system can, else a sparse copy (never a dense one)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["cp", "--reflink=auto", "--sparse=always", str(src), str(dst)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise OSError(f"cp {src} {dst}: {proc.stderr.strip()}")


def apply_diff_memory(diff_memory: Path, memory: Path) -> int:
    """Write the dirty pages of a ``Diff`` memory file into ``memory`` (a copy of the memory the
    diff is relative to) at their offsets; return the bytes written."""
    written = 0
    with open(diff_memory, "rb") as src, open(memory, "r+b") as dst:
        for start, length in data_ranges(diff_memory):
            src.seek(start)
            dst.seek(start)
            remaining = length
            while remaining:
                chunk = src.read(min(_CHUNK, remaining))
                if not chunk:
                    break
                dst.write(chunk)
                remaining -= len(chunk)
                written += len(chunk)
        diff_size = os.fstat(src.fileno()).st_size
        if diff_size > os.fstat(dst.fileno()).st_size:
            dst.truncate(diff_size)
    return written
