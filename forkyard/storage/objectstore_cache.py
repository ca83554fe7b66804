"""This node's side of the snapshot store: which snapshots are durable (stored), which have a local
copy, when each was last used, and which local copies to evict when the cache is over its cap.

One row per snapshot and node in the ``snapshot_copies`` table of the database (a cluster's
nodes each keep their own copies of the shared snapshots; this class sees only its node's rows):

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
from typing import Any, Literal

from sqlalchemy import ColumnElement, Connection, RowMapping, delete, insert, select, update

from forkyard.storage.db import Database
from forkyard.storage.db.schema import snapshot_copies

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


def _row(r: RowMapping) -> CopyRow:
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
    """This node's rows of the ``snapshot_copies`` table, and the in-memory pins."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._pins: Counter[str] = Counter()

    async def open(self) -> None:
        """Nothing to do: opening the database made the table (its migrations)."""

    def _mine(self, snapshot_id: str | None = None) -> ColumnElement[bool]:
        here = snapshot_copies.c.node_id == self.db.node_id
        return here if snapshot_id is None else here & (snapshot_copies.c.snapshot_id == snapshot_id)

    async def get(self, snapshot_id: str) -> CopyRow | None:
        stmt = select(snapshot_copies).where(self._mine(snapshot_id))
        found = await self.db.read(lambda conn: conn.execute(stmt).mappings().first())
        return _row(found) if found else None

    async def all(self) -> list[CopyRow]:
        stmt = select(snapshot_copies).where(self._mine())
        return await self.db.read(lambda conn: [_row(r) for r in conn.execute(stmt).mappings()])

    async def put(self, row: CopyRow) -> None:
        """Insert or replace this node's row for ``row.snapshot_id`` (one transaction)."""
        values = {
            "snapshot_id": row.snapshot_id,
            "node_id": self.db.node_id,
            "state": row.state,
            "cached": int(row.cached),
            "bytes": row.bytes,
            "last_used": row.last_used,
            "uploaded_at": row.uploaded_at,
            "upload_ms": row.upload_ms,
            "error": row.error,
        }
        stale = delete(snapshot_copies).where(self._mine(row.snapshot_id))

        def replace(conn: Connection) -> None:
            conn.execute(stale)
            conn.execute(insert(snapshot_copies), values)

        await self.db.write(replace)

    async def update(self, snapshot_id: str, **fields: Any) -> None:
        if not fields:
            return
        stmt = update(snapshot_copies).where(self._mine(snapshot_id)).values(**fields)
        await self.db.write(lambda conn: conn.execute(stmt))

    async def touch(self, snapshot_id: str) -> None:
        await self.update(snapshot_id, last_used=time.time())

    async def remove(self, snapshot_id: str) -> None:
        stmt = delete(snapshot_copies).where(self._mine(snapshot_id))
        await self.db.write(lambda conn: conn.execute(stmt))

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
