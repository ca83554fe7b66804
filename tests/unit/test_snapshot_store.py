"""Snapshot directories and registry rows: atomic commit, sweep of crash leftovers, delete (on
SQLite and PostgreSQL: ``database_url``, tests/support/postgres.py)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from forkyard.storage import snapshots as storage
from forkyard.storage.db import Database, open_database_at
from forkyard.storage.snapshots import SnapshotRow, SnapshotStore

pytestmark = pytest.mark.asyncio(loop_scope="session")


def row(snapshot_id: str, name: str | None = None) -> SnapshotRow:
    return SnapshotRow(
        snapshot_id=snapshot_id,
        kind="snapshot",
        source_sandbox_id="sbx1",
        runtime="gvisor",
        template_id="base",
        created_at=dt.datetime.now(dt.UTC),
        name=name,
    )


async def make_store(url: str, tmp_path: Path, node: str = "node-a") -> tuple[SnapshotStore, Database]:
    db = await open_database_at(url, node, shared=not url.startswith("sqlite"))
    store = SnapshotStore(db, tmp_path)
    await store.open()
    return store, db


async def test_commit_is_a_rename_and_sweep_removes_only_leftovers(tmp_path: Path, database_url: str) -> None:
    store, db = await make_store(database_url, tmp_path)
    try:
        temp = storage.temp_ref(tmp_path, "snapA")
        temp.path.mkdir()
        (temp.path / "meta.json").write_text("{}")
        committed = storage.commit_dir(tmp_path, temp)
        assert committed.path == tmp_path / "snapshots" / "snapA" and not temp.path.exists()
        await store.add(row("snapA", name="mine"))
        # Crash leftovers: an uncommitted temp dir, a committed dir whose row never got written,
        # and a row whose dir is gone.
        (tmp_path / "snapshots" / ".tmp-snapB-123").mkdir()
        (tmp_path / "snapshots" / "snapC").mkdir()
        await store.add(row("snapD"))
        removed = await store.sweep_incomplete()
        assert sorted(removed) == [".tmp-snapB-123", "snapC", "snapD"]
        assert [p.name for p in (tmp_path / "snapshots").iterdir()] == ["snapA"]
        assert (tmp_path / "snapshots" / "snapA" / "meta.json").read_text() == "{}"
        found = await store.find("team/mine:default")
        assert found is not None and found.snapshot_id == "snapA"
        assert await store.find("snapD") is None
    finally:
        await db.close()


async def test_delete_removes_row_and_dir(tmp_path: Path, database_url: str) -> None:
    store, db = await make_store(database_url, tmp_path)
    try:
        for sid in ("s1", "s2"):
            (tmp_path / "snapshots" / sid).mkdir(parents=True)
            await store.add(row(sid))
        await store.delete("s1")
        assert await store.get("s1") is None and not (tmp_path / "snapshots" / "s1").exists()
        assert await store.get("s2") is not None and (tmp_path / "snapshots" / "s2").is_dir()
        assert [p.name for p in (tmp_path / "snapshots").iterdir()] == ["s2"]
    finally:
        await db.close()


async def test_the_sweep_drops_only_this_nodes_rows_without_a_directory(
    tmp_path: Path, postgres: Any
) -> None:
    """Two nodes on one shared registry: a's snapshots have no directory on b's disk, and b's
    start-up sweep must leave their rows (and b's local copy of a's snapshot) alone."""
    url = postgres.new_database()
    a, a_db = await make_store(url, tmp_path / "a", "node-a")
    b, b_db = await make_store(url, tmp_path / "b", "node-b")
    try:
        for store, sid in ((a, "fromA"), (a, "copiedToB"), (b, "fromB"), (b, "lostOnB")):
            (store.data_dir / "snapshots" / sid).mkdir(parents=True)
            await store.add(row(sid))
        (b.data_dir / "snapshots" / "copiedToB").mkdir()  # b fetched a's durable snapshot
        storage.remove_dir(b.data_dir / "snapshots" / "lostOnB")
        assert sorted(await b.sweep_incomplete()) == ["lostOnB"]
        assert {r.snapshot_id for r in await a.rows()} == {"fromA", "copiedToB", "fromB"}
        assert (b.data_dir / "snapshots" / "copiedToB").is_dir()
        assert [r.snapshot_id for r in await a.rows(mine=True)] == ["copiedToB", "fromA"]
        assert await a.sweep_incomplete() == []
    finally:
        await a_db.close()
        await b_db.close()
