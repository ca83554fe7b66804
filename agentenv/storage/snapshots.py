"""Snapshots on disk: ``{data_dir}/snapshots/<snapshot_id>/`` plus a row in the registry.

Crash safety: a snapshot is written into ``snapshots/.tmp-<snapshot_id>-<pid>/``, committed by a
durable rename to its final name (:func:`agentenv.storage.atomic.publish`), then recorded in the
``snapshots`` table. A crash before the rename leaves only a ``.tmp-*`` directory (removed on
start-up, :meth:`SnapshotStore.sweep_incomplete`); a crash between rename and row leaves a
directory without row (also swept). A committed snapshot is never
touched by either. Deleting a snapshot only removes its own directory (memory image and meta);
the disk layers it names are shared with its descendants and freed by the runtime's
``collect_garbage`` once nothing names them, so descendants never break.
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

import aiosqlite

from agentenv.storage.atomic import publish
from agentenv.types import SnapshotRef

SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    snapshot_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    source_sandbox_id TEXT NOT NULL,
    parent_id TEXT,
    name TEXT,
    runtime TEXT NOT NULL,
    template_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    info TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS snapshots_source ON snapshots(source_sandbox_id);
"""

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


def _row(r: aiosqlite.Row) -> SnapshotRow:
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
    )


class SnapshotStore:
    """The ``snapshots`` table, in the orchestrator's SQLite database (its connection)."""

    def __init__(self, db: aiosqlite.Connection, data_dir: Path) -> None:
        self.db = db
        self.data_dir = data_dir

    async def open(self) -> None:
        await self.db.executescript(SCHEMA)
        await self.db.commit()

    def ref(self, row: SnapshotRow) -> SnapshotRef:
        return SnapshotRef(snapshot_id=row.snapshot_id, path=final_path(self.data_dir, row.snapshot_id))

    async def add(self, row: SnapshotRow) -> None:
        await self.db.execute(
            "INSERT INTO snapshots (snapshot_id, kind, source_sandbox_id, parent_id, name, runtime,"
            " template_id, created_at, info) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.snapshot_id,
                row.kind,
                row.source_sandbox_id,
                row.parent_id,
                row.name,
                row.runtime,
                row.template_id,
                row.created_at.timestamp(),
                json.dumps(row.info),
            ),
        )
        await self.db.commit()

    async def get(self, snapshot_id: str) -> SnapshotRow | None:
        async with self.db.execute("SELECT * FROM snapshots WHERE snapshot_id = ?", (snapshot_id,)) as cur:
            r = await cur.fetchone()
        return _row(r) if r else None

    async def find(self, name_or_id: str) -> SnapshotRow | None:
        """By id or name; a ``:tag`` suffix (``x:default``) and ``team/`` prefix are ignored."""
        key = name_or_id.split("/")[-1].split(":")[0]
        row = await self.get(key)
        if row is None:
            async with self.db.execute(
                "SELECT * FROM snapshots WHERE name = ? AND kind = 'snapshot' ORDER BY created_at DESC",
                (key,),
            ) as cur:
                r = await cur.fetchone()
            row = _row(r) if r else None
        return row

    async def rows(self, *, kind: SnapshotKind | None = None, source: str | None = None) -> list[SnapshotRow]:
        sql = "SELECT * FROM snapshots WHERE 1=1"
        params: list[str] = []
        if kind:
            sql += " AND kind = ?"
            params.append(kind)
        if source:
            sql += " AND source_sandbox_id = ?"
            params.append(source)
        async with self.db.execute(sql + " ORDER BY created_at DESC", params) as cur:
            return [_row(r) for r in await cur.fetchall()]

    async def delete(self, snapshot_id: str) -> None:
        """Row first, then files: a crash in between leaves an unreferenced dir (swept later)."""
        await self.db.execute("DELETE FROM snapshots WHERE snapshot_id = ?", (snapshot_id,))
        await self.db.commit()
        with contextlib.suppress(OSError):
            remove_dir(final_path(self.data_dir, snapshot_id))

    async def sweep_incomplete(self, keep_without_dir: set[str] | None = None) -> list[str]:
        """Remove temp dirs and committed dirs without a row (crash leftovers); rows whose
        directory vanished are dropped too, except ``keep_without_dir`` (snapshots the snapshot
        store holds, whose local copy may have been evicted). Returns what was removed."""
        removed: list[str] = []
        root = snapshots_dir(self.data_dir)
        known = {r.snapshot_id for r in await self.rows()}
        for entry in root.iterdir():
            if entry.name.startswith(TMP_PREFIX) or entry.name not in known:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        for sid in known - (keep_without_dir or set()):
            if not (root / sid).is_dir():
                await self.db.execute("DELETE FROM snapshots WHERE snapshot_id = ?", (sid,))
                removed.append(sid)
        await self.db.commit()
        return removed
