"""Snapshots on disk: ``{data_dir}/snapshots/<snapshot_id>/`` plus a row in the database.

Crash safety: a snapshot is written into ``snapshots/.tmp-<snapshot_id>-<pid>/``, committed by a
durable rename to its final name (:func:`forkyard.storage.atomic.publish`), then recorded in the
``snapshots`` table. A crash before the rename leaves only a ``.tmp-*`` directory (removed on
start-up, :meth:`SnapshotStore.sweep_incomplete`); a crash between rename and row leaves a
directory without row (also swept). A committed snapshot is never
touched by either. Deleting a snapshot only removes its own directory (memory image and meta);
the disk layers it names are shared with its descendants and freed by the runtime's
``collect_garbage`` once nothing names them, so descendants never break.

The rows are shared by a cluster's nodes (a durable snapshot restores on any of them); each names
the node that took it (``node_id``), and the start-up sweep only ever drops this node's rows.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import RowMapping, Select, delete, insert, select

from forkyard.storage.atomic import publish
from forkyard.storage.db import Database
from forkyard.storage.db.schema import snapshots
from forkyard.types import SnapshotRef

#: ``pause``: the memory state of a paused sandbox (private to it, deleted on resume/kill);
#: ``snapshot``: a user snapshot (a template sandboxes are created from); ``fork``: a fork's one
#: checkpoint (deleted when its request ends); ``template``: a template's booted state, which
#: creates from the template restore.
SnapshotKind = Literal["pause", "snapshot", "fork", "template"]
TMP_PREFIX = ".tmp-"


@dataclass
class SnapshotRow:
    snapshot_id: str
    kind: SnapshotKind
    source_sandbox_id: str
    runtime: str
    template_id: str
    created_at: dt.datetime
    parent_id: str | None = None
    name: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: The node that took it (its ``info`` paths are that node's); set when read from the database.
    node_id: str = ""


def snapshots_dir(data_dir: Path) -> Path:
    d = data_dir / "snapshots"
    d.mkdir(parents=True, exist_ok=True)
    return d


def temp_ref(data_dir: Path, snapshot_id: str) -> SnapshotRef:
    """Where to write a snapshot before it is committed."""
    path = snapshots_dir(data_dir) / f"{TMP_PREFIX}{snapshot_id}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    return SnapshotRef(snapshot_id=snapshot_id, path=path)


def final_path(data_dir: Path, snapshot_id: str) -> Path:
    return snapshots_dir(data_dir) / snapshot_id


def commit_dir(data_dir: Path, temp: SnapshotRef) -> SnapshotRef:
    """Atomically and durably publish a finished temp snapshot under its final name."""
    final = final_path(data_dir, temp.snapshot_id)
    publish(temp.path, final)
    return SnapshotRef(snapshot_id=temp.snapshot_id, path=final, parent=temp.parent)


def remove_dir(path: Path) -> None:
    """Delete a snapshot directory: rename away first so a crash mid-delete leaves only a temp."""
    if not path.exists():
        return
    doomed = path.parent / f"{TMP_PREFIX}deleting-{path.name}-{os.getpid()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _row(r: RowMapping) -> SnapshotRow:
    return SnapshotRow(
        snapshot_id=r["snapshot_id"],
        kind=r["kind"],
        source_sandbox_id=r["source_sandbox_id"],
        runtime=r["runtime"],
        template_id=r["template_id"],
        created_at=dt.datetime.fromtimestamp(r["created_at"], dt.UTC),
        parent_id=r["parent_id"],
        name=r["name"],
        info=json.loads(r["info"]),
        node_id=r["node_id"],
    )


class SnapshotStore:
    """The ``snapshots`` table, in the database (the sandbox store's engine)."""

    def __init__(self, db: Database, data_dir: Path) -> None:
        self.db = db
        self.data_dir = data_dir

    async def open(self) -> None:
        """Nothing to do: opening the database made the table (its migrations)."""

    def ref(self, row: SnapshotRow) -> SnapshotRef:
        return SnapshotRef(snapshot_id=row.snapshot_id, path=final_path(self.data_dir, row.snapshot_id))

    async def _select(self, stmt: Select[Any]) -> list[SnapshotRow]:
        return await self.db.read(lambda conn: [_row(r) for r in conn.execute(stmt).mappings()])

    async def add(self, row: SnapshotRow) -> None:
        values = {
            "snapshot_id": row.snapshot_id,
            "kind": row.kind,
            "source_sandbox_id": row.source_sandbox_id,
            "parent_id": row.parent_id,
            "name": row.name,
            "runtime": row.runtime,
            "template_id": row.template_id,
            "created_at": row.created_at.timestamp(),
            "info": json.dumps(row.info),
            "node_id": self.db.node_id,
        }
        await self.db.write(lambda conn: conn.execute(insert(snapshots), values))

    async def get(self, snapshot_id: str) -> SnapshotRow | None:
        found = await self._select(select(snapshots).where(snapshots.c.snapshot_id == snapshot_id))
        return found[0] if found else None

    async def find(self, name_or_id: str) -> SnapshotRow | None:
        """By id or name; a ``:tag`` suffix (``x:default``) and ``team/`` prefix are ignored."""
        key = name_or_id.split("/")[-1].split(":")[0]
        row = await self.get(key)
        if row is None:
            stmt = (
                select(snapshots)
                .where(snapshots.c.name == key, snapshots.c.kind == "snapshot")
                .order_by(snapshots.c.created_at.desc())
                .limit(1)
            )
            found = await self._select(stmt)
            row = found[0] if found else None
        return row

    async def rows(
        self, *, kind: SnapshotKind | None = None, source: str | None = None, mine: bool = False
    ) -> list[SnapshotRow]:
        """Newest first; ``mine``: only those this node took (its pause and fork snapshots, the
        uploads it owes the store)."""
        stmt = select(snapshots)
        if kind:
            stmt = stmt.where(snapshots.c.kind == kind)
        if source:
            stmt = stmt.where(snapshots.c.source_sandbox_id == source)
        if mine:
            stmt = stmt.where(snapshots.c.node_id == self.db.node_id)
        return await self._select(stmt.order_by(snapshots.c.created_at.desc()))

    async def delete(self, snapshot_id: str) -> None:
        """Row first, then files: a crash in between leaves an unreferenced dir (swept later)."""
        stmt = delete(snapshots).where(snapshots.c.snapshot_id == snapshot_id)
        await self.db.write(lambda conn: conn.execute(stmt))
        with contextlib.suppress(OSError):
            remove_dir(final_path(self.data_dir, snapshot_id))

    async def sweep_incomplete(self, keep_without_dir: set[str] | None = None) -> list[str]:
        """Remove temp dirs and committed dirs without a row (crash leftovers); this node's rows
        whose directory vanished are dropped too, except ``keep_without_dir`` (snapshots the
        snapshot store holds, whose local copy may have been evicted). Other nodes' rows are
        theirs: their directories are on their disks. Returns what was removed."""
        removed: list[str] = []
        root = snapshots_dir(self.data_dir)
        known = {r.snapshot_id for r in await self.rows()}
        for entry in root.iterdir():
            if entry.name.startswith(TMP_PREFIX) or entry.name not in known:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        mine = {r.snapshot_id for r in await self.rows(mine=True)}
        vanished = sorted(sid for sid in mine - (keep_without_dir or set()) if not (root / sid).is_dir())
        if vanished:
            stmt = delete(snapshots).where(snapshots.c.snapshot_id.in_(vanished))
            await self.db.write(lambda conn: conn.execute(stmt))
            removed.extend(vanished)
        return removed
