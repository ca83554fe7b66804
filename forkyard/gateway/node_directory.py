"""What a gateway reads and writes in the shared database (forkyard/storage/db/schema.py): the
nodes and their heartbeats, which node owns a sandbox, which nodes hold a snapshot, and the
marking of lost nodes."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Executable, delete, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from forkyard.gateway.placement import NodeInfo
from forkyard.storage.db import schema
from forkyard.storage.db.outage import reconnecting
from forkyard.types import HELD_STATES, REACHABLE_STATES, SandboxState

#: A lost node's sandboxes in these states are reported gone (``killed``).
_HELD_STATES = tuple(str(s) for s in HELD_STATES)
#: What the SDK can still reach: a sandbox in any other state answers 404.
_REACHABLE_STATES = tuple(str(s) for s in REACHABLE_STATES)
LOST_REASON = "node lost"


@dataclass(frozen=True)
class Lost:
    node_id: str
    sandbox_ids: tuple[str, ...]


class NodeDirectory:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _rows(self, query: Executable) -> list[Any]:
        """The rows of a read; a connection lost on the way is tried again, then answered 503."""

        async def run() -> list[Any]:
            async with self.engine.connect() as conn:
                return list((await conn.execute(query)).all())

        return await reconnecting(run, "reading the registry")

    async def nodes(self) -> list[NodeInfo]:
        rows = await self._rows(select(schema.nodes))
        return [NodeInfo.from_row(dict(r._mapping)) for r in rows]

    async def node_rows(self) -> list[dict[str, object]]:
        """Every ``nodes`` row, all columns (``GET /node`` on a gateway)."""
        rows = await self._rows(select(schema.nodes).order_by(schema.nodes.c.node_id))
        return [dict(r._mapping) for r in rows]

    async def sandbox_counts(self) -> list[tuple[str, str, str | None, int]]:
        """(node id, state, pause tier, how many) of the sandboxes the SDK can still reach."""
        s = schema.sandboxes
        query = (
            select(s.c.node_id, s.c.state, s.c.pause_tier, func.count())
            .where(s.c.state.in_(_REACHABLE_STATES))
            .group_by(s.c.node_id, s.c.state, s.c.pause_tier)
        )
        rows = await self._rows(query)
        return [(str(r[0]), str(r[1]), None if r[2] is None else str(r[2]), int(r[3])) for r in rows]

    async def owner(self, sandbox_id: str) -> str | None:
        """The node owning a sandbox the SDK can still reach, else None (answered as gone)."""
        s = schema.sandboxes
        query = select(s.c.node_id).where(s.c.sandbox_id == sandbox_id, s.c.state.in_(_REACHABLE_STATES))
        rows = await self._rows(query)
        return str(rows[0][0]) if rows else None

    async def volume_nodes(self, *, ids: Sequence[str] = (), names: Sequence[str] = ()) -> dict[str, str]:
        """The node holding each named volume, by volume id and by name (unknown ones left out)."""
        v = schema.volumes
        query = select(v.c.volume_id, v.c.name, v.c.node_id).where(
            or_(v.c.volume_id.in_(list(ids)), v.c.name.in_(list(names)))
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        found: dict[str, str] = {}
        for volume_id, name, node_id in rows:
            found[str(volume_id)] = found[str(name)] = str(node_id)
        return found

    async def envd_tokens(self) -> list[tuple[str, str]]:
        """(sandbox id, envd access token) of every running sandbox that has a token."""
        s = schema.sandboxes
        query = select(s.c.sandbox_id, s.c.envd_access_token).where(
            s.c.state == str(SandboxState.RUNNING), s.c.envd_access_token.is_not(None)
        )
        return [(str(r[0]), str(r[1])) for r in await self._rows(query)]

    async def holders(self, reference: str) -> frozenset[str]:
        """Nodes with a local copy of the user snapshot named by ``reference`` (its id or name).

        Template snapshots do not count: a node without one makes its own at its first create of
        the template (seconds, once), so spreading creates wins over piling them onto the first
        node that had one. A user snapshot's copy saves fetching its memory image and layers."""
        snaps, copies = schema.snapshots, schema.snapshot_copies
        query = (
            select(copies.c.node_id)
            .join(snaps, snaps.c.snapshot_id == copies.c.snapshot_id)
            .where(
                copies.c.cached == 1,
                snaps.c.kind == "snapshot",
                or_(snaps.c.snapshot_id == reference, snaps.c.name == reference),
            )
        )
        rows = await self._rows(query)
        return frozenset(str(r[0]) for r in rows)

    async def mark_lost(self, lost_after: float, now: float | None = None) -> list[Lost]:
        """Mark the nodes whose heartbeat is older than ``lost_after`` lost and their sandboxes
        killed (reason in their logs), their snapshot copies forgotten, all in one transaction.
        Idempotent, and safe with several gateways at once: only the one whose ``UPDATE ... WHERE
        state != 'lost'`` changed a node's row goes on to its sandboxes."""
        now = time.time() if now is None else now
        n, s = schema.nodes, schema.sandboxes
        found: list[Lost] = []
        async with self.engine.begin() as conn:
            marked = await conn.execute(
                update(n)
                .where(n.c.state != "lost", n.c.heartbeat_at < now - lost_after)
                .values(state="lost")
                .returning(n.c.node_id)
            )
            for (node_id,) in marked.all():
                killed = await conn.execute(
                    update(s)
                    .where(s.c.node_id == node_id, s.c.state.in_(_HELD_STATES))
                    .values(state=str(SandboxState.KILLED), end_at=now)
                    .returning(s.c.sandbox_id)
                )
                ids = tuple(str(r[0]) for r in killed.all())
                if ids:
                    await conn.execute(
                        insert(schema.sandbox_logs),
                        [
                            {
                                "sandbox_id": sid,
                                "ts": now,
                                "level": "error",
                                "message": f"killed: {LOST_REASON} ({node_id} missed its heartbeats)",
                                "fields": json.dumps({"node_id": node_id, "reason": LOST_REASON}),
                            }
                            for sid in ids
                        ],
                    )
                copies = schema.snapshot_copies
                await conn.execute(delete(copies).where(copies.c.node_id == node_id))
                found.append(Lost(node_id, ids))
        return found
