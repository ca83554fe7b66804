"""A cluster node's heartbeat: every ``node_heartbeat_seconds`` its row in the database's
``nodes`` table is written with its capacity (what ``GET /node`` reports) so gateways can place
sandboxes on it and see it alive; on a clean shutdown the row says ``draining`` (no new
sandboxes; its sandboxes keep running and a restart re-attaches them).

A node whose row a gateway marked ``lost`` (it missed heartbeats: partitioned, or stopped for
longer than ``node_lost_after_seconds``) had its sandboxes' rows killed: the next beat puts the
row back ``up`` and hands the node's sandboxes the database now says are killed to ``reap``
(the orchestrator destroys them), so nothing runs that the cluster reports gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from forkyard.config import Settings
from forkyard.storage.db import schema

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """One beat's numbers (the ``nodes`` columns of the same names)."""

    runtime: str
    vcpus_total: int
    vcpus_free: int
    memory_total_mib: int
    memory_free_mib: int
    disk_free_mib: int
    sandboxes_running: int
    slots_free: int
    warm_templates: list[str] = field(default_factory=list)


class Heartbeat:
    def __init__(
        self,
        engine: AsyncEngine,
        settings: Settings,
        measure: Callable[[], Awaitable[Capacity]],
        reap: Callable[[], Awaitable[None]] | None = None,
        version: str = "",
    ) -> None:
        self.engine = engine
        self.node_id = settings.node_name
        self.url = settings.node_address
        self.interval = settings.node_heartbeat_seconds
        self.measure = measure
        self.reap = reap
        self.version = version
        self.started_at = time.time()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Beat once now (the node is placeable as soon as it serves), then every interval."""
        await self.beat()
        self._task = asyncio.create_task(self._run(), name="node-heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        n = schema.nodes
        with contextlib.suppress(Exception):  # the database may be gone first at shutdown
            async with self.engine.begin() as conn:
                await conn.execute(
                    update(n).where(n.c.node_id == self.node_id, n.c.state == "up").values(state="draining")
                )
            log.info("node %s: marked draining", self.node_id)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
            except Exception:  # one missed beat is not a lost node: try again next interval
                log.exception("node %s: heartbeat failed", self.node_id)

    async def beat(self) -> None:
        capacity = await self.measure()
        n = schema.nodes
        values = {
            **asdict(capacity),
            "warm_templates": json.dumps(capacity.warm_templates),
            "url": self.url,
            "state": "up",
            "heartbeat_at": time.time(),
            "version": self.version,
        }
        async with self.engine.begin() as conn:
            row = (await conn.execute(select(n.c.state).where(n.c.node_id == self.node_id))).first()
            if row is None:
                await conn.execute(
                    insert(n).values(node_id=self.node_id, started_at=self.started_at, **values)
                )
            else:
                await conn.execute(update(n).where(n.c.node_id == self.node_id).values(**values))
        if row is not None and row[0] == "lost":
            log.warning(
                "node %s: the cluster had marked this node lost; its killed sandboxes go", self.node_id
            )
            if self.reap is not None:
                await self.reap()
