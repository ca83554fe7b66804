"""Telling a database out of reach from other database errors, on a real PostgreSQL (issue 28):
a connection the server ended and a server that does not listen are "connection lost", retried
where safe and then answered 503; a constraint violation is not; a write lost in its commit is
not repeated. Disk-full errors of the database and of the runtimes' tools are told apart too."""

from __future__ import annotations

import asyncio
import errno
import threading

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.exc import IntegrityError

from forkyard.errors import Failed, InsufficientStorage, Unavailable
from forkyard.orchestrator.lifecycle import failure, out_of_space
from forkyard.storage.db import Database, engine_for, outage
from forkyard.storage.db.outage import connection_lost, disk_full, full_disk_as_507, reconnecting
from tests.support import free_port
from tests.support.postgres import PostgresCluster


async def _terminated_error(url: str) -> BaseException:
    """What a statement on a pooled connection raises after the server ended that session."""
    engine, killer = engine_for(url), engine_for(url)
    try:
        async with engine.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            async with killer.connect() as other:
                await other.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            with pytest.raises(Exception) as caught:
                await conn.execute(text("SELECT 1"))
            return caught.value
    finally:
        await engine.dispose()
        await killer.dispose()


async def test_lost_connections_are_told_from_other_database_errors(postgres: PostgresCluster) -> None:
    url = postgres.new_database()
    assert connection_lost(await _terminated_error(url))
    nowhere = engine_for(f"postgresql+asyncpg://forkyard@127.0.0.1:{free_port()}/x")
    try:
        with pytest.raises(Exception) as refused:
            async with nowhere.connect():
                pass
        assert connection_lost(refused.value), repr(refused.value)
    finally:
        await nowhere.dispose()
    engine = engine_for(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t (k int PRIMARY KEY)"))
            await conn.execute(text("INSERT INTO t VALUES (1)"))
        with pytest.raises(IntegrityError) as duplicate:
            async with engine.begin() as conn:
                await conn.execute(text("INSERT INTO t VALUES (1)"))
        assert not connection_lost(duplicate.value)
    finally:
        await engine.dispose()


async def test_a_registry_out_of_reach_is_tried_again_then_answered_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(outage, "RETRY_PAUSES_S", (0.0, 0.0, 0.0))
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionRefusedError(111, "Connect call failed")

    with pytest.raises(Unavailable, match="the database is unreachable"):
        await reconnecting(refused)
    assert calls == 4  # the first try and three more

    async def bug() -> None:
        raise ValueError("not a connection problem")

    with pytest.raises(ValueError):
        await reconnecting(bug)


async def test_a_read_and_a_write_outlive_their_sessions_being_ended(postgres: PostgresCluster) -> None:
    url = postgres.new_database()
    database = Database(engine=engine_for(url), node_id="n", shared=True)
    killer = engine_for(url)
    try:
        await database.write(lambda conn: conn.execute(text("CREATE TABLE t (k int)")))
        async with killer.begin() as conn:  # every session of the database ends, as in a restart
            await conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid()")
            )
        await database.write(lambda conn: conn.execute(text("INSERT INTO t VALUES (1)")))
        assert await database.read(lambda conn: conn.execute(text("SELECT count(*) FROM t")).scalar()) == 1
    finally:
        await database.close()
        await killer.dispose()


async def test_a_write_lost_in_its_commit_is_not_repeated(postgres: PostgresCluster) -> None:
    """Its COMMIT is slowed by a deferred trigger and the session ended meanwhile: it may have
    been committed or not, so it is answered 503 and not run again (an INSERT would run twice)."""
    url = postgres.new_database()
    database = Database(engine=engine_for(url), node_id="n", shared=True)
    runs, killers = 0, []

    def insert_then_lose_the_commit(conn: Connection) -> None:
        nonlocal runs
        runs += 1
        conn.execute(text("INSERT INTO t VALUES (1)"))
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
        killer = threading.Thread(target=lambda: asyncio.run(_terminate_soon(url, pid)))
        killer.start()
        killers.append(killer)

    try:
        for statement in SLOW_COMMIT:
            await database.write(lambda conn, sql=statement: conn.execute(text(sql)))
        with pytest.raises(Unavailable):
            await database.write(insert_then_lose_the_commit)
        assert runs == 1
    finally:
        for killer in killers:
            killer.join(timeout=30)
        await database.close()


#: Rows whose COMMIT waits (10 s, cut short by the test): a deferred constraint trigger runs at commit.
SLOW_COMMIT = (
    "CREATE TABLE t (k int)",
    "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$"
    " BEGIN PERFORM pg_sleep(10); RETURN NULL; END $$",
    "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED"
    " FOR EACH ROW EXECUTE FUNCTION slow()",
)


async def _terminate_soon(url: str, pid: object) -> None:
    """End session ``pid`` once its COMMIT is in the trigger's sleep."""
    engine = engine_for(url)
    try:
        async with engine.connect() as conn:
            query = text("SELECT wait_event FROM pg_stat_activity WHERE pid = :p")
            for _ in range(600):
                if (await conn.execute(query, {"p": pid})).scalar() == "PgSleep":
                    break
                await asyncio.sleep(0.02)
            await conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
    finally:
        await engine.dispose()


def test_disk_full_is_507_wherever_it_is_said() -> None:
    assert out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    runsc = Failed("runsc checkpoint of sandbox x failed: statefile error: no space left on device")
    assert out_of_space(runsc)
    refused = failure(runsc, "snapshot of sandbox x")
    assert isinstance(refused, InsufficientStorage) and "disk is full" in refused.message
    assert not out_of_space(Failed("runsc checkpoint failed: container is stopped"))
    assert isinstance(failure(Failed("boom"), "x"), Failed)
    sqlite_full = Exception("(sqlite3.OperationalError) database or disk is full")
    assert disk_full(sqlite_full)
    with pytest.raises(InsufficientStorage):
        with full_disk_as_507():
            raise sqlite_full
