"""The root file systems of gVisor sandboxes: a host overlayfs per sandbox of its private upper
over a chain of shared, read-only snapshot layers (:mod:`forkyard.storage.layers`) over the
template rootfs.

The upper lives on the sandbox's own disk: a sparse ext4 image of the template's
``diskSizeMB`` (``disk.img``), loop-mounted in the sandbox's directory. That is the disk quota:
a sandbox that fills it gets ENOSPC from its own file system, ``df /`` inside shows its size
(overlayfs reports the upper's file system), and the node's disk holds at most that much of
its writes (``discard`` gives deleted blocks back to the host). Project quotas on one shared
file system would keep sealing a rename, but this kernel is built without XFS quota and the
quota formats ext4 needs (``CONFIG_XFS_QUOTA``, ``CONFIG_QFMT_V2`` unset): so a sealed layer is
a copy of the upper into the layer store (:meth:`RootDisks.seal_copy`), made on the stopping
paths only (pause to disk, fork, a snapshot of a large upper).

A sandbox's chain is written to its ``layers.json`` before the mount, so that layer garbage
collection sees every layer a sandbox stands on; the layers copied from its upper for running
snapshots are named in its ``held-layers.json`` (see :meth:`RootDisks.in_use`).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from forkyard.errors import Failed, Gone
from forkyard.runtime.gvisor import cgroups, upper_delta
from forkyard.runtime.gvisor.paths import SandboxPaths
from forkyard.storage import mounts
from forkyard.storage.atomic import write_json_atomic
from forkyard.storage.envd_bundle import MOUNT_POINT
from forkyard.storage.layers import LayerError, LayerStore, overlay_mount, overlay_unmount, tree_bytes

log = logging.getLogger(__name__)

#: Where the envd bundle is mounted, relative to the root.
MOUNT_POINT_DIR = MOUNT_POINT.lstrip("/")
#: The largest upper (bytes, entries) a running snapshot walks, and after a new mount copies
#: whole, in the sandbox's pause, rather than stopping the sandbox to seal it. Copying runs at
#: 1-2 GB/s from the page cache here and a stop + restore in place costs 0.4-0.6 s more than the
#: pause, so this keeps the first copy and the walk well below that.
COPY_MAX_BYTES = 256 << 20
COPY_MAX_ENTRIES = 4096
#: mkfs of a sandbox disk: no blocks reserved for root (the sandbox gets all of its size),
#: inode tables and journal initialised lazily (20-30 ms for 4 GiB here, the image stays sparse).
MKFS = ("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard")
#: Part of a blank file system's name (see :meth:`RootDisks._blank`): new mkfs options, new blanks.
_MKFS_TAG = hashlib.sha256(" ".join(MKFS).encode()).hexdigest()[:12]
#: ``discard``: what the sandbox deletes is punched out of the sparse image, back to the node
#: (mounted ``noatime`` through a loop device with autoclear, as ``mount -o loop,noatime,discard``).
DISK_DATA_OPTIONS = "discard"
#: The smallest disk a sandbox gets (ext4 and its journal need room of their own).
MIN_DISK_MB = 64


@dataclass(frozen=True)
class UpperCopy:
    """What a running snapshot copied from the upper."""

    #: The copy, to be adopted as a layer.
    path: Path
    #: The chain (newest first) the copy goes on top of.
    base: list[str]
    #: The upper's entries the copy brings the chain up to.
    entries: upper_delta.Entries


class RootDisks:
    """The layer store of one data directory and the root mounts of its sandboxes."""

    def __init__(self, data_dir: Path) -> None:
        #: Snapshot disk layers, shared read-only by snapshots and the sandboxes made from them.
        self.layers = LayerStore(data_dir / "disk-layers")
        #: Held while a chain is mounted, sealed or collected, so that a collection never frees a
        #: layer a restore is about to stand on.
        self.lock = asyncio.Lock()
        #: Bytes of each sealed layer, measured once (a layer never changes).
        self._layer_bytes: dict[str, int] = {}
        #: Freshly made file systems, one per disk size, that new sandbox disks are copies of.
        self._blanks = data_dir / "disk-blanks"

    def mount(self, paths: SandboxPaths, template_rootfs: Path, chain: list[str], disk_mb: int) -> Path:
        """Mount the sandbox's root: its private upper (on its own disk of ``disk_mb`` MiB, made
        if missing) over ``chain`` (layer ids, newest first) over the template rootfs. Returns
        the mount point; a no-op when it is mounted already."""
        missing = [lid for lid in chain if not self.layers.exists(lid)]
        if missing:
            raise Gone(f"disk layers {', '.join(missing)} of sandbox {paths.sandbox_id} are gone")
        paths.root.mkdir(parents=True, exist_ok=True)
        self.set_chain(paths, chain)
        self.ensure_disk(paths, disk_mb)
        for d in (paths.upper, paths.work, paths.rootfs):
            d.mkdir(exist_ok=True)
        if not (template_rootfs / MOUNT_POINT_DIR).is_dir():  # the envd bundle's mount point
            (paths.upper / MOUNT_POINT_DIR).mkdir(exist_ok=True)
        if not os.path.ismount(paths.rootfs):
            lowers = [self.layers.path(lid) for lid in chain] + [template_rootfs]
            try:
                overlay_mount(paths.rootfs, lowers, paths.upper, paths.work)
            except LayerError as exc:
                raise Failed(
                    f"mounting the root file system of sandbox {paths.sandbox_id} failed: {exc.message}"
                ) from exc
        return paths.rootfs

    @staticmethod
    def unmount(paths: SandboxPaths) -> None:
        """Unmount the root overlay (the disk under its upper stays mounted)."""
        overlay_unmount(paths.rootfs)

    def ensure_disk(self, paths: SandboxPaths, disk_mb: int) -> None:
        """Have the sandbox's disk mounted at ``paths.disk``, making the image if there is none."""
        if os.path.ismount(paths.disk):
            return
        paths.disk.mkdir(parents=True, exist_ok=True)
        if not paths.disk_image.exists():
            tmp = paths.disk_image.with_suffix(".tmp")
            sparse_copy(self._blank(max(disk_mb, MIN_DISK_MB), paths.sandbox_id), tmp)
            tmp.rename(paths.disk_image)
        try:
            # mount(2) through a loop device of our own, as ``mount -o loop,noatime,discard``:
            # no mount process per sandbox (~4 ms of CPU each here).
            mounts.mount_image(paths.disk_image, paths.disk, "ext4", mounts.MS_NOATIME, DISK_DATA_OPTIONS)
        except OSError as exc:
            raise Failed(f"mounting the disk of sandbox {paths.sandbox_id} failed: {exc}") from exc

    def _blank(self, size_mb: int, sandbox_id: str) -> Path:
        """A new file system of ``size_mb`` MiB, made once per size (and mkfs options): a
        sandbox's disk is a sparse copy of it (1-2 ms for the ~2 MiB mkfs writes, against a
        mkfs.ext4 process per sandbox). Copies share the file system's UUID, which ext4 allows."""
        blank = self._blanks / f"ext4-{size_mb}m-{_MKFS_TAG}.img"
        if blank.exists():
            return blank
        self._blanks.mkdir(parents=True, exist_ok=True)
        tmp = blank.with_name(f".{blank.name}.{os.getpid()}-{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.truncate(size_mb << 20)
            _run([*MKFS, str(tmp)], f"making the disk of sandbox {sandbox_id}")
            os.replace(tmp, blank)  # a concurrent maker's blank is as good as this one
        finally:
            tmp.unlink(missing_ok=True)
        return blank

    @staticmethod
    def release_disk(paths: SandboxPaths) -> None:
        """Unmount the sandbox's disk (its loop device goes with it: it was attached with autoclear)."""
        overlay_unmount(paths.disk)

    @staticmethod
    def chain(paths: SandboxPaths) -> list[str]:
        """The snapshot layers the sandbox's root stands on (newest first)."""
        try:
            chain = json.loads(paths.layers_file.read_text())
        except (OSError, ValueError):
            return []
        return [str(lid) for lid in chain]

    @staticmethod
    def set_chain(paths: SandboxPaths, chain: list[str]) -> None:
        write_json_atomic(paths.layers_file, chain)

    @staticmethod
    def held(paths: SandboxPaths) -> list[str]:
        """Layers the sandbox holds without standing on them (copies of its upper)."""
        try:
            return [str(lid) for lid in json.loads(paths.held_layers_file.read_text())]
        except (OSError, ValueError):
            return []

    def hold(self, paths: SandboxPaths, layer_id: str) -> None:
        write_json_atomic(paths.held_layers_file, [*self.held(paths), layer_id])

    def in_use(self, paths: SandboxPaths) -> set[str]:
        """Every layer the sandbox keeps from garbage collection."""
        return {*self.chain(paths), *self.held(paths)}

    @staticmethod
    def upper_is_small(paths: SandboxPaths) -> bool:
        """Whether the upper is within :data:`COPY_MAX_BYTES` and :data:`COPY_MAX_ENTRIES` (the
        walk stops at the first limit crossed)."""
        size, entries, todo = 0, 0, [str(paths.upper)]
        while todo:
            with os.scandir(todo.pop()) as it:
                for entry in it:
                    entries += 1
                    st = entry.stat(follow_symlinks=False)
                    size += st.st_blocks * 512
                    if entries > COPY_MAX_ENTRIES or size > COPY_MAX_BYTES:
                        return False
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
        return True

    def precopy_upper(self, paths: SandboxPaths) -> dict[str, upper_delta.Staged]:
        """Copy the large files the next :meth:`copy_upper` needs while the sandbox still runs
        (:func:`upper_delta.precopy`); nothing when its mapped files cannot be told. Best effort:
        what is not pre-copied is copied in the pause."""
        shutil.rmtree(paths.upper_precopy, ignore_errors=True)
        mapped = self._mapped(paths)
        if mapped is None:
            return {}
        try:
            return upper_delta.precopy(paths.upper, paths.upper_precopy, self.delta_base(paths)[1], mapped)
        except OSError as exc:
            log.warning("pre-copying the upper of sandbox %s failed: %s", paths.sandbox_id, exc)
            return {}

    def drop_precopy(self, paths: SandboxPaths) -> None:
        shutil.rmtree(paths.upper_precopy, ignore_errors=True)

    @staticmethod
    def _mapped(paths: SandboxPaths) -> set[int] | None:
        return cgroups.mapped_inodes(paths.sandbox_id)

    def copy_upper(
        self, paths: SandboxPaths, staged: dict[str, upper_delta.Staged] | None = None
    ) -> UpperCopy:
        """Copy into ``paths.upper_copy`` what the (paused) upper changed since the last running
        snapshot on the current mount, else all of it (:mod:`~forkyard.runtime.gvisor.upper_delta`);
        ``staged``: what :meth:`precopy_upper` copied before the pause, linked where still current."""
        base, before = self.delta_base(paths)
        shutil.rmtree(paths.upper_copy, ignore_errors=True)
        mapped = self._mapped(paths) if staged else None
        try:
            entries = upper_delta.build(
                paths.upper, paths.upper_copy, before, staged if mapped is not None else None, mapped
            )
        except OSError as exc:
            shutil.rmtree(paths.upper_copy, ignore_errors=True)
            raise Failed(f"copying the upper of sandbox {paths.sandbox_id} failed: {exc}") from exc
        return UpperCopy(paths.upper_copy, base, entries)

    def delta_base(self, paths: SandboxPaths) -> tuple[list[str], upper_delta.Entries]:
        """The chain the next running snapshot's layer goes on and the upper entries it already
        holds: the last running snapshot's, while the sandbox is still on the mount it was taken on."""
        try:
            last = json.loads(paths.upper_delta_file.read_text())
        except (OSError, ValueError):
            last = None
        if not last or last.get("mount_chain") != self.chain(paths):
            return self.chain(paths), {}
        return list(last["chain"]), dict(last["entries"])

    def remember_delta(self, paths: SandboxPaths, chain: list[str], entries: upper_delta.Entries) -> None:
        record = {"mount_chain": self.chain(paths), "chain": chain, "entries": entries}
        write_json_atomic(paths.upper_delta_file, record)

    def fresh_upper(self, paths: SandboxPaths) -> None:
        """Empty the sandbox's (unmounted) upper and work directories: a small upper is removed,
        a large one by making its disk anew (one unlink instead of a walk). Without a disk yet
        there is nothing to empty: the next :meth:`mount` makes one."""
        if not paths.disk_image.exists():
            return
        disk_mb = paths.disk_image.stat().st_size >> 20
        self.ensure_disk(paths, disk_mb)  # a host reboot unmounted it
        if paths.upper.is_dir() and not self.upper_is_small(paths):
            self.release_disk(paths)
            paths.disk_image.unlink()
            self.ensure_disk(paths, disk_mb)
        for d in (paths.upper, paths.work):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()

    def seal_copy(self, paths: SandboxPaths) -> Path:
        """A copy of the whole (unmounted) upper at ``paths.upper_copy``, on the layer store's file
        system, to be adopted as a layer: the upper's own disk is another file system."""
        shutil.rmtree(paths.upper_copy, ignore_errors=True)
        try:
            upper_delta.build(paths.upper, paths.upper_copy, {})
        except OSError as exc:
            shutil.rmtree(paths.upper_copy, ignore_errors=True)
            raise Failed(f"copying the upper of sandbox {paths.sandbox_id} failed: {exc}") from exc
        return paths.upper_copy

    def used_bytes(self, paths: SandboxPaths) -> int:
        """What the sandbox wrote: its disk's used blocks (else its upper) plus the snapshot
        layers under it."""
        if os.path.ismount(paths.disk):
            st = os.statvfs(paths.disk)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
        else:
            used = tree_bytes(paths.upper)
        for layer_id in self.chain(paths):
            if layer_id not in self._layer_bytes and self.layers.exists(layer_id):
                self._layer_bytes[layer_id] = self.layers.disk_usage(layer_id)
            used += self._layer_bytes.get(layer_id, 0)
        return used

    def collect(self, in_use: set[str]) -> list[str]:
        """Delete the layers not in ``in_use`` (call under :attr:`lock`); return their ids."""
        removed = self.layers.gc(in_use)
        for layer_id in removed:
            self._layer_bytes.pop(layer_id, None)
        return removed


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "LC_ALL": "C"})
    if proc.returncode != 0:
        raise Failed(f"{what} failed: {' '.join(cmd[:2])}: {(proc.stderr or proc.stdout).strip()[-500:]}")


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` keeping its holes: only the extents holding data are copied
    (``SEEK_DATA``/``SEEK_HOLE``, ``copy_file_range``)."""
    with open(src, "rb") as s, open(dst, "wb") as d:
        size = os.fstat(s.fileno()).st_size
        d.truncate(size)
        offset = 0
        while offset < size:
            try:
                offset = os.lseek(s.fileno(), offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole is left
                    return
                raise
            end = os.lseek(s.fileno(), offset, os.SEEK_HOLE)
            while offset < end:
                copied = os.copy_file_range(s.fileno(), d.fileno(), end - offset, offset, offset)
                if copied == 0:
                    raise OSError(errno.EIO, f"copying {src} stopped short at byte {offset}")
                offset += copied
