"""The writable upper drive of a microVM and its snapshot copies, all reflink clones in the pool.

A sandbox's upper drive is ``{pool}/sandboxes/<id>/upper.ext4``, cloned from the empty upper
template (boot) or from a snapshot's drive (restore). A snapshot's drive is cloned into
``{pool}/snapshots/<snapshot id>/upper.ext4`` while the vCPUs are stopped, and the snapshot
directory links to it (:func:`snapshot_disk`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from forkyard.config import Settings
from forkyard.storage.atomic import write_atomic
from forkyard.storage.images import GuestImages, create_upper_drive
from forkyard.storage.reflink import ReflinkPool
from forkyard.types import SnapshotRef

SNAPSHOT_UPPER = "upper.ext4"


def prepare_upper(settings: Settings, images: GuestImages, snapshot: Path | None, upper: Path) -> None:
    """The sandbox's upper drive: empty for a boot, the snapshot's drive for a restore."""
    upper.parent.mkdir(parents=True, exist_ok=True)
    if snapshot is None:
        create_upper_drive(settings, images, upper)
    else:
        ReflinkPool(settings.data_dir).clone((snapshot / SNAPSHOT_UPPER).resolve(), upper)


def snapshot_disk(settings: Settings, upper: Path, dest: SnapshotRef) -> Path:
    """Reflink-clone a VM's upper drive into the pool for snapshot ``dest``.

    Clones must stay inside the pool's file system, and ``dest.path`` (the snapshot directory)
    may not be: the clone lives at ``layers/snapshots/<id>/`` and ``dest.path/upper.ext4`` is a
    symlink to it. The layer's ``owner`` file names the directory that holds ``dest.path``: the
    orchestrator renames snapshot directories there (temp -> committed -> deleting), so the layer
    is in use exactly while some directory there links to it (:func:`remove_orphan_snapshot_disks`)."""
    layer = snapshot_layer_file(settings, upper, dest, SNAPSHOT_UPPER)
    # Written last: a layer without an owner is never collected (it is being made).
    write_atomic(layer.parent / "owner", str(dest.path.resolve().parent) + "\n")
    return layer


def snapshot_layer_file(settings: Settings, src: Path, dest: SnapshotRef, name: str) -> Path:
    """Reflink-clone ``src`` into snapshot ``dest``'s layer directory as ``name`` and link
    ``dest.path/name`` to it. Other files of a snapshot (a VM's RAM file) are cloned before
    :func:`snapshot_disk`, which writes the layer's owner: the whole directory is one layer."""
    pool = ReflinkPool(settings.data_dir)
    layer = pool.root / "snapshots" / dest.snapshot_id / name
    pool.clone(src, layer)
    link = dest.path / name
    link.unlink(missing_ok=True)
    link.symlink_to(layer)
    return layer


def _layer_linked_from(home: Path, layer: Path) -> bool:
    """Whether a snapshot directory in ``home`` links its upper drive to ``layer``."""
    target = os.path.realpath(layer)
    try:
        entries = list(home.iterdir())
    except FileNotFoundError:
        return False
    for entry in entries:
        link = entry / SNAPSHOT_UPPER
        if link.is_symlink() and os.path.realpath(link) == target:
            return True
    return False


def remove_orphan_snapshot_disks(settings: Settings) -> list[str]:
    """Delete snapshot layers no snapshot directory links to any more (deleted snapshots)."""
    pool = ReflinkPool(settings.data_dir)
    removed = []
    for owner in sorted((pool.root / "snapshots").glob("*/owner")):
        with contextlib.suppress(OSError):
            home = Path(owner.read_text().strip())
            if not _layer_linked_from(home, owner.parent / SNAPSHOT_UPPER):
                pool.remove_tree(owner.parent)
                removed.append(owner.parent.name)
    return removed


def allocated_and_size(path: Path) -> tuple[int, int]:
    """(bytes allocated, apparent size) of a sparse drive; zeros when it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0, 0
    return st.st_blocks * 512, st.st_size
