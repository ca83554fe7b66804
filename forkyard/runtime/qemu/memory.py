"""Guest RAM as a file in the reflink pool (``settings.qemu.memory = "file"``).

QEMU maps ``memory.ram`` (``memory-backend-file``, ``share=on``): the file *is* the guest's RAM.
A snapshot reflinks it (with the vCPUs stopped; FICLONE writes the mapping's dirty pages back
first) and migrates only device state (capability ``x-ignore-shared`` skips shared RAM). A
restore maps a reflink clone of the snapshot's file: nothing is read up front, pages fault in
from the shared extents, and the guest's writes land in its own clone (copy-on-write on
writeback), never in the snapshot's file or a sibling's.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from forkyard.storage.reflink import FICLONE, ReflinkError

RAM_FILE = "memory.ram"


def create_ram_file(path: Path, memory_mb: int) -> None:
    """A sparse file of the guest's RAM size (zeros; blocks are allocated as the guest writes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(memory_mb << 20)


def clone_into(src: Path, dst: Path) -> None:
    """Make the existing file ``dst`` a reflink copy of ``src`` in place (same inode).

    A VMM started ahead of its sandbox has ``dst`` open (and mapped) already: the clone replaces
    its content under it; the kernel drops ``dst``'s page cache and mappings, so the next access
    reads the new extents. No truncation first (a mapping of an empty file would fault)."""
    src_fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(dst_fd, FICLONE, src_fd)
        except OSError as exc:
            raise ReflinkError(f"cannot reflink {src} into {dst}: {exc.strerror}") from exc
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
