"""The registry's PostgreSQL engine outlives its server's restart (found by the Compose cluster's
fault test, tests/system/test_compose_cluster.py::test_fault_postgres_restarted: requests failed
with InterfaceError after a restart of the registry). A restart closes every pooled connection on
the server's side; here the server ends them itself (``pg_terminate_backend``), the same for the
pool, and the next statement must work."""

from __future__ import annotations

from sqlalchemy import text

from forkyard.storage.db.engine import engine_for
from tests.support.postgres import PostgresCluster


async def test_a_pooled_connection_the_server_closed_is_replaced(postgres: PostgresCluster) -> None:
    url = postgres.new_database()
    engine, killer = engine_for(url), engine_for(url)
    try:
        async with engine.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        async with killer.connect() as conn:  # the pooled connection dies as in a restart
            assert (await conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})).scalar_one()
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1
    finally:
        await engine.dispose()
        await killer.dispose()
