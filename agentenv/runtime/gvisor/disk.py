"""The root file systems of gVisor sandboxes: a host overlayfs per sandbox of its private upper
over a chain of shared, read-only snapshot layers (:mod:`agentenv.storage.layers`) over the
template rootfs.

A sandbox's chain is written to its ``layers.json`` before the mount, so that layer garbage
collection sees every layer a sandbox stands on; the layers copied from its upper for running
snapshots are named in its ``held-layers.json`` (see :meth:`RootDisks.in_use`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import Failed, Gone
from agentenv.runtime.gvisor import upper_delta
from agentenv.runtime.gvisor.paths import SandboxPaths
from agentenv.storage.atomic import write_json_atomic
from agentenv.storage.envd_bundle import MOUNT_POINT
from agentenv.storage.layers import LayerError, LayerStore, overlay_mount, overlay_unmount, tree_bytes

#: Where the envd bundle is mounted, relative to the root.
MOUNT_POINT_DIR = MOUNT_POINT.lstrip("/")
#: The largest upper (bytes, entries) a running snapshot walks, and after a new mount copies
#: whole, in the sandbox's pause, rather than stopping the sandbox to seal it. Copying runs at
#: 1-2 GB/s from the page cache here and a stop + restore in place costs 0.4-0.6 s more than the
#: pause, so this keeps the first copy and the walk well below that.
COPY_MAX_BYTES = 256 << 20
COPY_MAX_ENTRIES = 4096


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

    def mount(self, paths: SandboxPaths, template_rootfs: Path, chain: list[str]) -> Path:
        """Mount the sandbox's root: its private upper over ``chain`` (layer ids, newest first)
        over the template rootfs. Returns the mount point; a no-op when it is mounted already."""
        missing = [lid for lid in chain if not self.layers.exists(lid)]
        if missing:
            raise Gone(f"disk layers {', '.join(missing)} of sandbox {paths.sandbox_id} are gone")
        paths.root.mkdir(parents=True, exist_ok=True)
        self.set_chain(paths, chain)
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
        overlay_unmount(paths.rootfs)

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

    def copy_upper(self, paths: SandboxPaths) -> UpperCopy:
        """Copy into ``paths.upper_copy`` what the (paused) upper changed since the last running
        snapshot on the current mount, else all of it (:mod:`~agentenv.runtime.gvisor.upper_delta`)."""
        base, before = self.delta_base(paths)
        shutil.rmtree(paths.upper_copy, ignore_errors=True)
        try:
            entries = upper_delta.build(paths.upper, paths.upper_copy, before)
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

    @staticmethod
    def fresh_upper(paths: SandboxPaths) -> None:
        """Empty the sandbox's (unmounted) upper and work directories."""
        for d in (paths.upper, paths.work):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()

    def used_bytes(self, paths: SandboxPaths) -> int:
        """What the sandbox wrote: its upper plus the snapshot layers under it."""
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
