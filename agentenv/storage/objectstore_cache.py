"""This node's side of the snapshot store: which snapshots are durable (stored), which have a local
copy, when each was last used, and which local copies to evict when the cache is over its cap.

One row per snapshot in the ``snapshot_copies`` table of the registry database:

* ``state``: ``local`` (committed here only), ``uploading``, ``durable`` (the store holds it:
  any node can restore it), ``failed`` (the upload failed; retried at the next start-up);
* ``cached``: whether ``snapshots/<id>/`` is on this node (a durable snapshot's copy can be evicted
  and fetched again); ``bytes``: what the copy's files take; ``last_used``: its LRU clock.

Only durable copies are evicted, least recently used first, and never a pinned one (a restore
from it is under way). Disk layers are not entries of their own: evicting a snapshot's copy stops
it naming its layers, and the runtime's layer collection frees those no other copy and no
sandbox stands on, which is what keeps a running or paused sandbox's disk from ever being evicted.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import aiosqlite

SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshot_copies (
    snapshot_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    cached INTEGER NOT NULL DEFAULT 1,
    bytes INTEGER NOT NULL DEFAULT 0,
    last_used REAL NOT NULL,
    uploaded_at REAL,
    upload_ms INTEGER,
    error TEXT
);
"""

CopyState = Literal["local", "uploading", "durable", "failed"]


@dataclass
class CopyRow:
    snapshot_id: str
    state: CopyState
    cached: bool
    bytes: int
    last_used: float
    uploaded_at: float | None = None
    upload_ms: int | None = None
    error: str | None = None

    @property
    def durable(self) -> bool:
        return self.state == "durable"

    def json(self) -> dict[str, object]:
        """What our API shows of it (an extension of E2B's snapshot info)."""
        return {
            "state": self.state,
            "durable": self.durable,
            "cached": self.cached,
            "bytes": self.bytes,
            "uploadedAt": self.uploaded_at,
            "uploadMs": self.upload_ms,
            "error": self.error,
        }


def _row(r: aiosqlite.Row) -> CopyRow:
    return CopyRow(
        snapshot_id=r["snapshot_id"],
        state=r["state"],
        cached=bool(r["cached"]),
        bytes=int(r["bytes"]),
        last_used=float(r["last_used"]),
        uploaded_at=r["uploaded_at"],
        upload_ms=r["upload_ms"],
        error=r["error"],
    )


class SnapshotCopies:
    """The ``snapshot_copies`` table and the in-memory pins."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db
        self._pins: Counter[str] = Counter()

    async def open(self) -> None:
        await self.db.executescript(SCHEMA)
        await self.db.commit()

    async def get(self, snapshot_id: str) -> CopyRow | None:
        async with self.db.execute(
            "SELECT * FROM snapshot_copies WHERE snapshot_id = ?", (snapshot_id,)
        ) as cur:
            r = await cur.fetchone()
        return _row(r) if r else None

    async def all(self) -> list[CopyRow]:
        async with self.db.execute("SELECT * FROM snapshot_copies") as cur:
            return [_row(r) for r in await cur.fetchall()]

    async def put(self, row: CopyRow) -> None:
        await self.db.execute(
            "INSERT OR REPLACE INTO snapshot_copies (snapshot_id, state, cached, bytes, last_used,"
            " uploaded_at, upload_ms, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.snapshot_id,
                row.state,
                int(row.cached),
                row.bytes,
                row.last_used,
                row.uploaded_at,
                row.upload_ms,
                row.error,
            ),
        )
        await self.db.commit()

    async def update(self, snapshot_id: str, **fields: object) -> None:
        if not fields:
            return
        cols = ", ".join(f"{k} = ?" for k in fields)
        await self.db.execute(
            f"UPDATE snapshot_copies SET {cols} WHERE snapshot_id = ?", (*fields.values(), snapshot_id)
        )
        await self.db.commit()

    async def touch(self, snapshot_id: str) -> None:
        await self.update(snapshot_id, last_used=time.time())

    async def remove(self, snapshot_id: str) -> None:
        await self.db.execute("DELETE FROM snapshot_copies WHERE snapshot_id = ?", (snapshot_id,))
        await self.db.commit()

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, snapshot_id: str) -> None:
        self._pins[snapshot_id] += 1

    def unpin(self, snapshot_id: str) -> None:
        self._pins[snapshot_id] -= 1
        if self._pins[snapshot_id] <= 0:
            del self._pins[snapshot_id]

    def pinned(self, snapshot_id: str) -> bool:
        return self._pins[snapshot_id] > 0

    # -- eviction --------------------------------------------------------------------------------

    def victims(self, rows: list[CopyRow], over_bytes: int) -> list[CopyRow]:
        """The local copies to evict, least recently used first, to free ``over_bytes``: only
        durable, cached, unpinned ones."""
        chosen: list[CopyRow] = []
        freed = 0
        for row in sorted(rows, key=lambda r: r.last_used):
            if freed >= over_bytes:
                break
            if row.durable and row.cached and not self.pinned(row.snapshot_id):
                chosen.append(row)
                freed += row.bytes
        return chosen
