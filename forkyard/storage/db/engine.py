"""Opening the database: an async SQLAlchemy engine for SQLite or PostgreSQL.

SQLite (the single-node default, ``{data_dir}/forkyard.sqlite3``) keeps the settings the aiosqlite
store had: WAL journal and ``synchronous=NORMAL`` (a commit is one append to the WAL, no fsync of the
main file), plus a busy timeout so that another connection waits for the writer instead of failing.
Its ``AsyncEngine`` (aiosqlite) runs the migrations; the stores use :func:`sqlite_sync_engine` on the
database's own thread (see :class:`forkyard.storage.db.Database`). PostgreSQL (a cluster's shared
database) gets a small asyncpg connection pool per process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from forkyard.config import Settings

#: How long a SQLite statement waits for another connection's write lock (ms).
SQLITE_BUSY_TIMEOUT_MS = 10_000
#: PostgreSQL: connecting, a statement, and waiting for a pooled connection each give up after this (s).
PG_TIMEOUT_S = 60.0


def open_engine(settings: Settings) -> AsyncEngine:
    """The engine for ``settings.resolved_database_url`` (``database_url``, else the node's SQLite file)."""
    return engine_for(settings.resolved_database_url)


def engine_for(url: str | URL) -> AsyncEngine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed)
    # A PostgreSQL restart closes every pooled connection: pre-ping replaces a dead one at checkout
    # instead of failing the request with InterfaceError (a 500); the timeouts turn a connection
    # that hangs (the server gone mid-restart) into an error, never a request that waits forever.
    # Found by tests/system/test_compose_cluster.py::test_fault_postgres_restarted.
    return create_async_engine(
        parsed,
        pool_size=5,
        max_overflow=10,
        pool_recycle=1800,
        pool_pre_ping=True,
        pool_timeout=PG_TIMEOUT_S,
        connect_args={"timeout": PG_TIMEOUT_S, "command_timeout": PG_TIMEOUT_S},
    )


def sqlite_path(url: str | URL) -> Path | None:
    """The file behind a SQLite URL (None: not SQLite, or in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def _sqlite_engine(url: URL) -> AsyncEngine:
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    # Every use is a whole transaction (``engine.begin()``) or a read outside one, so the
    # connection needs no rollback when it goes back to the pool: skipping it saves a thread hop
    # per statement on the lifecycle's hot path.
    engine = create_async_engine(url, pool_size=4, max_overflow=4, pool_reset_on_return=None)
    event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


def sqlite_sync_engine(url: str | URL) -> Engine | None:
    """For a SQLite URL, an engine on the same file through the stdlib driver (one connection:
    it is used from one thread, :class:`forkyard.storage.db.Database`); None for other databases."""
    path = sqlite_path(url)
    if path is None:
        return None
    engine = create_engine(f"sqlite:///{path}", pool_size=1, max_overflow=0, pool_reset_on_return=None)
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.close()
