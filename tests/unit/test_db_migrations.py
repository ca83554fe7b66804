"""The registry's Alembic migrations: a new database gets exactly ``schema.py`` on both backends,
and SQLite files made by the aiosqlite stores (before Alembic) upgrade in place, data intact."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection

from forkyard.orchestrator.store import SandboxStore
from forkyard.storage.db import Database, open_database_at
from forkyard.storage.db.schema import metadata
from forkyard.storage.objectstore_cache import SnapshotCopies
from forkyard.storage.snapshots import SnapshotStore
from forkyard.types import SandboxState

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: The tables as the aiosqlite stores made them (orchestrator/store.py, storage/snapshots.py,
#: storage/objectstore_cache.py before the registry moved to SQLAlchemy), with the oldest
#: sandboxes table: its later columns were added on open, and a free-form ``extra`` JSON held some.
OLDEST_SCHEMA = """
CREATE TABLE sandboxes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL UNIQUE,
    template_id TEXT NOT NULL,
    alias TEXT,
    client_id TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    envs TEXT NOT NULL DEFAULT '{}',
    state TEXT NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_mb INTEGER NOT NULL,
    runtime TEXT NOT NULL,
    instance TEXT,
    envd_version TEXT NOT NULL,
    envd_access_token TEXT,
    traffic_access_token TEXT,
    allow_internet_access INTEGER,
    auto_pause INTEGER NOT NULL DEFAULT 0,
    auto_resume INTEGER NOT NULL DEFAULT 0,
    network TEXT NOT NULL DEFAULT '{}',
    extra TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX sandboxes_state ON sandboxes(state);
CREATE TABLE sandbox_logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    ts REAL NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    fields TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX sandbox_logs_sandbox ON sandbox_logs(sandbox_id, ts);
CREATE TABLE snapshots (
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
CREATE INDEX snapshots_source ON snapshots(source_sandbox_id);
CREATE TABLE snapshot_copies (
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


def _diff(conn: Connection) -> list[Any]:
    return list(compare_metadata(MigrationContext.configure(conn), metadata))


async def _schema_diff(registry: Database) -> list[Any]:
    async with registry.engine.connect() as conn:
        return await conn.run_sync(_diff)


async def test_a_new_database_gets_exactly_the_schema(database_url: str) -> None:
    registry = await open_database_at(database_url, "node-a", shared=not database_url.startswith("sqlite"))
    try:
        assert await _schema_diff(registry) == []
    finally:
        await registry.close()
    again = await open_database_at(database_url, "node-a", shared=False)  # current: a no-op
    await again.close()


async def test_concurrent_start_ups_migrate_a_shared_database_once(postgres: Any) -> None:
    url = postgres.new_database()
    opened = await asyncio.gather(*(open_database_at(url, f"node-{i}", shared=True) for i in range(3)))
    try:
        assert await _schema_diff(opened[0]) == []
    finally:
        for registry in opened:
            await registry.close()


def _write_old_file(path: Path) -> None:
    """A registry file as a node running the pre-Alembic code left it: a paused sandbox (its
    pause snapshot still in ``extra``), a running one, logs, a snapshot and its copy."""
    now = dt.datetime.now(dt.UTC).timestamp()
    db = sqlite3.connect(path)
    db.executescript(OLDEST_SCHEMA)
    for sid, state, extra in (
        ("sbxpaused", "paused", {"pause_snapshot": "snap1", "log_offsets": {"envd.log": 42}}),
        ("sbxrunning", "running", {}),
    ):
        db.execute(
            "INSERT INTO sandboxes (sandbox_id, template_id, client_id, metadata, state, started_at,"
            " end_at, cpu_count, memory_mb, disk_mb, runtime, envd_version, extra)"
            " VALUES (?, 'base', 'c1', ?, ?, ?, ?, 2, 512, 1024, 'gvisor', '0.1.0', ?)",
            (sid, json.dumps({"k": sid}), state, now, now + 300, json.dumps(extra)),
        )
    db.execute(
        "INSERT INTO sandbox_logs (sandbox_id, ts, level, message) VALUES ('sbxrunning', ?, 'info', 'hi')",
        (now,),
    )
    db.execute(
        "INSERT INTO snapshots VALUES ('snap1', 'pause', 'sbxpaused', NULL, NULL, 'gvisor', 'base', ?, '{}')",
        (now,),
    )
    db.execute(
        "INSERT INTO snapshot_copies (snapshot_id, state, last_used) VALUES ('snap1', 'durable', ?)", (now,)
    )
    db.commit()
    db.close()


async def test_a_file_from_before_the_migrations_upgrades_in_place(tmp_path: Path) -> None:
    path = tmp_path / "forkyard.sqlite3"
    _write_old_file(path)
    store = SandboxStore(path, node_id="renamed-host")
    await store.open()
    try:
        paused = await store.get("sbxpaused")
        assert paused is not None and paused.state == SandboxState.PAUSED
        assert paused.pause_snapshot == "snap1" and paused.pause_tier == "disk"
        assert paused.log_offsets == {"envd.log": 42} and paused.metadata == {"k": "sbxpaused"}
        running = await store.get("sbxrunning")
        assert running is not None and running.origin == "boot" and running.auto_pause_memory
        assert [r.sandbox_id for r in await store.in_states([SandboxState.RUNNING])] == ["sbxrunning"]
        assert [line.message for line in await store.logs("sbxrunning", start=None, limit=10)] == ["hi"]
        snapshot = await SnapshotStore(store.db, tmp_path).get("snap1")
        copy = await SnapshotCopies(store.db).get("snap1")
        assert snapshot is not None and snapshot.kind == "pause"
        assert copy is not None and copy.durable
        # New rows continue the old sequence.
        running.sandbox_id, running.state = "sbxnew", SandboxState.CREATING
        await store.insert(running)
        assert running.seq == 3
    finally:
        await store.close()
    # Reopened under another host name (a new container), it is still this node's file.
    store = SandboxStore(path, node_id="another-host")
    await store.open()
    try:
        assert {r.sandbox_id for r in await store.in_states([SandboxState.RUNNING, SandboxState.PAUSED])} == {
            "sbxpaused",
            "sbxrunning",
        }
        assert await SnapshotCopies(store.db).get("snap1") is not None
    finally:
        await store.close()
