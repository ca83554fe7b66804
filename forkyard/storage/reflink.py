"""Copy-on-write disk layers by reflink (``FICLONE``), on XFS/btrfs.

Every per-sandbox and per-snapshot disk is a reflink clone of its parent file: creating,
snapshotting or forking a disk shares all blocks and copies no data. Where the data directory's
file system cannot reflink (ext4, the common root), :class:`ReflinkPool` creates a sparse XFS
image file with ``reflink=1`` under the data directory and loop-mounts it; the pool is removed
again by :meth:`ReflinkPool.destroy`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from forkyard.errors import Failed

#: ``_IOW(0x94, 9, int)`` from linux/fs.h.
FICLONE = 0x40049409
#: The pool file is sparse: this is a ceiling, not an allocation.
DEFAULT_POOL_SIZE = 256 << 30


class ReflinkError(Failed):
    """A clone, or setting up or removing the pool, failed."""


def clone_file(src: Path, dst: Path) -> None:
    """Make ``dst`` a reflink copy of ``src`` (same file system); no data blocks are copied."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as s, open(dst, "wb") as d:
        try:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        except OSError as exc:
            d.close()
            dst.unlink(missing_ok=True)
            raise ReflinkError(f"cannot reflink {src} to {dst}: {exc.strerror}") from exc
    os.chmod(dst, os.stat(src).st_mode & 0o7777)


def supports_reflink(directory: Path) -> bool:
    """Whether files in ``directory`` can be reflink-cloned (tried, not guessed from the fs type)."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".reflink-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"x" * 4096)
        clone_file(probe, probe.with_suffix(".clone"))
        return True
    except (ReflinkError, OSError):
        return False
    finally:
        probe.unlink(missing_ok=True)
        probe.with_suffix(".clone").unlink(missing_ok=True)


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ReflinkError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _is_mountpoint(path: Path) -> bool:
    return os.path.ismount(path)


@dataclass
class ReflinkPool:
    """A directory that supports reflink: ``{data_dir}/layers`` itself, or an XFS pool mounted there.

    ``root`` is where disk layers live; everything cloned from each other must be under it.
    """

    data_dir: Path
    pool_size: int = DEFAULT_POOL_SIZE

    @property
    def root(self) -> Path:
        return self.data_dir / "layers"

    @property
    def pool_file(self) -> Path:
        return self.data_dir / "layers.xfs"

    def ensure(self) -> Path:
        """Make ``root`` reflink-capable (mounting or creating the pool if needed); return it."""
        if _is_mountpoint(self.root):
            return self.root
        # Serialised across threads and processes: two first users at once (a create and the
        # server's template warm-up) would both mount the new pool, and XFS refuses the second
        # mount of the same file system ("wrong fs type").
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / ".layers.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._ensure_locked()

    def _ensure_locked(self) -> Path:
        if _is_mountpoint(self.root):
            return self.root
        if self.pool_file.exists():
            self._mount()
            return self.root
        if supports_reflink(self.root):
            return self.root
        self._create_pool()
        return self.root

    def _create_pool(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if any(self.root.iterdir()):
            raise ReflinkError(f"{self.root} is not empty and cannot reflink; move its files away first")
        tmp = self.pool_file.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.truncate(self.pool_size)
        try:
            _run("mkfs.xfs", "-q", "-f", "-m", "reflink=1", str(tmp))
        except ReflinkError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.rename(self.pool_file)
        self._mount()

    def _mount(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # "loop" makes mount(8) attach a loop device with autoclear: unmounting frees it.
        _run("mount", "-o", "loop,noatime", str(self.pool_file), str(self.root))

    def destroy(self) -> None:
        """Unmount and delete the pool file (and every layer in it). Idempotent."""
        if _is_mountpoint(self.root):
            _run("umount", str(self.root))
        self.pool_file.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.root.rmdir()

    def unmount(self) -> None:
        """Unmount the pool but keep its file (node shutdown)."""
        if _is_mountpoint(self.root):
            _run("umount", str(self.root))

    def clone(self, src: Path, dst: Path) -> Path:
        clone_file(src, dst)
        return dst

    def remove(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def remove_tree(self, directory: Path) -> None:
        """Delete a layer directory under ``root`` (refuses paths outside it)."""
        if self.root.resolve() not in directory.resolve().parents:
            raise ReflinkError(f"{directory} is not inside {self.root}")
        for child in sorted(directory.rglob("*"), reverse=True):
            if child.is_dir() and not child.is_symlink():
                child.rmdir()
            else:
                child.unlink()
        with contextlib.suppress(FileNotFoundError):
            directory.rmdir()


def disk_usage_bytes(path: Path) -> int:
    """Blocks in use on the file system holding ``path`` (for measuring what clones cost)."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def allocated_bytes(path: Path) -> int:
    """Bytes actually allocated to one file (sparse and shared blocks show up as allocated)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError as exc:
        raise ReflinkError(f"{path}: {os.strerror(errno.ENOENT)}") from exc
