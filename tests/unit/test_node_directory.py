"""The gateway's node directory (forkyard/gateway/node_directory.py) and the node heartbeat
(forkyard/orchestrator/heartbeat.py), on SQLite and on a real PostgreSQL: heartbeats upsert a
node's row, a stale node is marked lost with its sandboxes killed in one go, exactly once even
when several gateways look at the same moment, and a node that was lost reaps on its next beat."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from sqlalchemy import insert, select

from forkyard.config import Settings
from forkyard.gateway.node_directory import NodeDirectory
from forkyard.orchestrator.heartbeat import Capacity, Heartbeat
from forkyard.storage.db import open_database_at, schema

pytestmark = pytest.mark.asyncio(loop_scope="session")

CAPACITY = Capacity(
    runtime="gvisor",
    vcpus_total=2,
    vcpus_free=2,
    memory_total_mib=8000,
    memory_free_mib=6000,
    disk_free_mib=50000,
    sandboxes_running=1,
    slots_free=11,
    warm_templates=["base"],
)


def _sandbox(sandbox_id: str, node_id: str, state: str) -> dict[str, object]:
    now = time.time()
    return {
        "sandbox_id": sandbox_id,
        "template_id": "base",
        "client_id": "c",
        "state": state,
        "started_at": now,
        "end_at": now + 300,
        "cpu_count": 2,
        "memory_mb": 512,
        "disk_mb": 1024,
        "runtime": "gvisor",
        "envd_version": "0.1.0",
        "node_id": node_id,
    }


async def _measure() -> Capacity:
    return CAPACITY


async def test_heartbeats_loss_and_reaping(database_url: str) -> None:
    database = await open_database_at(database_url, "node-a", shared=True)
    try:
        engine = database.engine
        reaped: list[str] = []

        async def reap() -> None:
            reaped.append("node-a")

        settings = Settings(node_id="node-a", node_url="http://10.0.0.1:3000", node_heartbeat_seconds=60)
        heartbeat = Heartbeat(engine, settings, _measure, reap=reap, version="t")
        await heartbeat.start()
        other = Heartbeat(engine, Settings(node_id="node-b", port=3001, host="10.0.0.2"), _measure)
        await other.beat()
        gateway = NodeDirectory(engine)
        nodes = {n.node_id: n for n in await gateway.nodes()}
        assert nodes["node-a"].url == "http://10.0.0.1:3000" and nodes["node-b"].url == "http://10.0.0.2:3001"
        assert nodes["node-a"].warm_templates == {"base"} and nodes["node-a"].memory_free_mib == 6000

        async with engine.begin() as conn:
            await conn.execute(
                insert(schema.sandboxes),
                [
                    _sandbox("sa1", "node-a", "running"),
                    _sandbox("sa2", "node-a", "paused"),
                    _sandbox("sa3", "node-a", "killed"),
                    _sandbox("sb1", "node-b", "running"),
                ],
            )
        assert await gateway.owner("sa1") == "node-a" and await gateway.owner("sa3") is None

        # node-a stops beating; two gateways notice at the same moment: one marks it.
        later = time.time() + 30
        results = await asyncio.gather(
            gateway.mark_lost(10, now=later), NodeDirectory(engine).mark_lost(10, now=later)
        )
        marked = [lost for found in results for lost in found]
        # node-b's beat is as old: both are lost, each by exactly one gateway.
        assert sorted(m.node_id for m in marked) == ["node-a", "node-b"]
        by_node = {m.node_id: set(m.sandbox_ids) for m in marked}
        assert by_node == {"node-a": {"sa1", "sa2"}, "node-b": {"sb1"}}
        assert await gateway.mark_lost(10, now=later) == []  # idempotent
        async with engine.connect() as conn:
            states = dict(
                (await conn.execute(select(schema.sandboxes.c.sandbox_id, schema.sandboxes.c.state))).all()
            )
            logs = (
                await conn.execute(
                    select(schema.sandbox_logs.c.fields).where(schema.sandbox_logs.c.sandbox_id == "sa1")
                )
            ).all()
        assert states == {"sa1": "killed", "sa2": "killed", "sa3": "killed", "sb1": "killed"}
        assert [json.loads(r[0])["reason"] for r in logs] == ["node lost"]
        assert await gateway.owner("sa1") is None

        # node-a comes back: its row is up again and it reaps what the cluster killed.
        await heartbeat.beat()
        assert reaped == ["node-a"]
        assert {n.node_id: n.state for n in await gateway.nodes()}["node-a"] == "up"
        await heartbeat.stop()
        assert {n.node_id: n.state for n in await gateway.nodes()}["node-a"] == "draining"
    finally:
        await database.close()
