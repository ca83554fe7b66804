"""Nodes sharing one PostgreSQL registry: each reads, expires and recovers only its own sandboxes;
the gateway's queries (``query_all``, ``get_any``) see every node's."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from forkyard.config import Settings
from forkyard.orchestrator.lifecycle import CreateRequest, Orchestrator, build_orchestrator
from forkyard.orchestrator.store import ListQuery, NetworkPolicy, SandboxRecord, SandboxStore
from forkyard.types import SandboxState
from tests.support.loopback import LoopbackRuntime, write_template

pytestmark = pytest.mark.asyncio(loop_scope="session")


def record(sandbox_id: str, state: SandboxState, *, expired: bool = False) -> SandboxRecord:
    now = dt.datetime.now(dt.UTC)
    return SandboxRecord(
        sandbox_id=sandbox_id,
        template_id="base",
        client_id="c1",
        state=state,
        started_at=now,
        end_at=now + dt.timedelta(seconds=-1 if expired else 300),
        cpu_count=1,
        memory_mb=512,
        disk_mb=1024,
        runtime="loopback",
        envd_version="0.1.0",
    )


async def test_each_store_sees_its_own_rows_and_the_gateway_all(postgres: Any) -> None:
    url = postgres.new_database()
    a = SandboxStore(Path("/nonexistent"), database_url=url, node_id="node-a")
    b = SandboxStore(Path("/nonexistent"), database_url=url, node_id="node-b")
    await a.open()
    await b.open()
    try:
        await a.insert(record("sbxa1", SandboxState.RUNNING, expired=True))
        await a.insert(record("sbxa2", SandboxState.PAUSED))
        await b.insert(record("sbxb1", SandboxState.RUNNING, expired=True))
        live = [SandboxState.RUNNING, SandboxState.PAUSED]
        assert [r.sandbox_id for r in await a.in_states(live)] == ["sbxa1", "sbxa2"]
        assert [r.sandbox_id for r in await b.in_states(live)] == ["sbxb1"]
        assert await a.expired(dt.datetime.now(dt.UTC)) == ["sbxa1"]
        assert await b.expired(dt.datetime.now(dt.UTC)) == ["sbxb1"]
        assert {r.sandbox_id for r in await a.query(ListQuery())} == {"sbxa1", "sbxa2"}
        assert await b.get("sbxa1") is None
        everything = await b.query_all(ListQuery(ascending=True))
        assert [r.sandbox_id for r in everything] == ["sbxa1", "sbxa2", "sbxb1"]
        page = await b.query_all(
            ListQuery(ascending=True, limit=1, after=(everything[0].started_at.timestamp(), 1))
        )
        assert [r.sandbox_id for r in page] == ["sbxa2", "sbxb1"]  # one row past the limit: a next page
        found = await b.get_any("sbxa2")
        assert found is not None and found.state == SandboxState.PAUSED
        assert await b.owner("sbxa2") == "node-a" and await b.owner("nope") is None
    finally:
        await a.close()
        await b.close()


@contextlib.asynccontextmanager
async def node(tmp_path: Path, url: str, node_id: str) -> AsyncIterator[Orchestrator]:
    write_template(tmp_path / "templates")
    config = Settings(
        data_dir=tmp_path / node_id,
        templates_path=tmp_path / "templates",
        template_snapshots=False,
        warm_pool_high=0,
        database_url=url,
        node_id=node_id,
    )
    runtime = LoopbackRuntime(config)
    orch = build_orchestrator(config, runtime)
    await orch.start()
    try:
        yield orch
    finally:
        await orch.close()
        await runtime.close()


async def test_a_starting_node_recovers_only_its_own_sandboxes(tmp_path: Path, postgres: Any) -> None:
    """b starting (its recovery cleans up every live row it cannot re-attach) leaves a's running
    sandbox alone, and a restarted a re-attaches it."""
    url = postgres.new_database()
    request = CreateRequest(
        template_id="base",
        timeout_seconds=60,
        metadata={},
        envs={},
        secure=False,
        network=NetworkPolicy(allow_internet_access=True),
    )
    async with node(tmp_path, url, "node-a") as a:
        rec = await a.create(request)
        async with node(tmp_path, url, "node-b") as b:
            assert await b.store.get(rec.sandbox_id) is None
            assert [r.sandbox_id for r in await b.store.query_all(ListQuery())] == [rec.sandbox_id]
        stored = await a.store.get(rec.sandbox_id)
        assert stored is not None and stored.state == SandboxState.RUNNING and stored.instance is not None
        await a.kill(rec.sandbox_id)
        killed = await a.store.get(rec.sandbox_id)
        assert killed is not None and killed.state == SandboxState.KILLED
