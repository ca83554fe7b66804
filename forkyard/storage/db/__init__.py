"""The database (SQLAlchemy Core, async): one SQLite file per node by default, or one
PostgreSQL shared by a cluster's nodes and gateways (``settings.database_url``).

:func:`open_database` opens the engine and brings the schema to the newest Alembic revision
(``migrations/``) before anything reads it; :class:`Database` is what the stores share: the engine
and this node's id (every sandbox row, snapshot row and snapshot copy names its node).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from forkyard.config import Settings
from forkyard.storage.db.engine import engine_for, open_engine, sqlite_path, sqlite_sync_engine
from forkyard.storage.db.migrate import upgrade
from forkyard.storage.db.outage import connection_lost, full_disk_as_507, reconnecting, unavailable

T = TypeVar("T")


@dataclass
class Database:
    engine: AsyncEngine
    #: This process's node (rows it writes carry it; a node reads and recovers only its own).
    node_id: str
    #: A database shared by several nodes (PostgreSQL). Not shared: the node's own SQLite file,
    #: whose rows all belong to it whatever its host name was when they were written.
    shared: bool
    #: SQLite only: the same file through the stdlib driver, used on one thread of its own by
    #: :meth:`read` and :meth:`write` (the lifecycle's hot path: a whole transaction is one
    #: thread hop, where aiosqlite takes one per cursor call).
    sync_engine: Engine | None = None
    _thread: ThreadPoolExecutor | None = field(default=None, repr=False)
    _sync_conn: Connection | None = field(default=None, repr=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    async def read(self, fn: Callable[[Connection], T]) -> T:
        """``fn(connection)`` outside any write transaction."""
        if self.sync_engine is not None:
            return await self._on_thread(self._read_sync, fn)
        return await reconnecting(lambda: self._read_async(fn))

    async def _read_async(self, fn: Callable[[Connection], T]) -> T:
        async with self.engine.connect() as conn:
            return await conn.run_sync(fn)

    async def write(self, fn: Callable[[Connection], T]) -> T:
        """``fn(connection)`` in one transaction, committed when it returns."""
        with full_disk_as_507():
            if self.sync_engine is not None:
                return await self._on_thread(self._write_sync, fn)
            return await reconnecting(lambda: self._write_async(fn))

    async def _write_async(self, fn: Callable[[Connection], T]) -> T:
        async with self.engine.connect() as conn:
            transaction = await conn.begin()
            try:
                result = await conn.run_sync(fn)
            except BaseException:
                with contextlib.suppress(Exception):  # a lost connection has nothing to roll back
                    await transaction.rollback()
                raise
            try:
                await transaction.commit()
            except Exception as exc:
                # Lost during its commit, it may or may not have been committed: never repeated.
                if connection_lost(exc):
                    raise unavailable(exc) from exc
                raise
            return result

    async def _on_thread(
        self, run: Callable[[Callable[[Connection], T]], T], fn: Callable[[Connection], T]
    ) -> T:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkyard-db")
        return await asyncio.get_running_loop().run_in_executor(self._thread, run, fn)

    def _read_sync(self, fn: Callable[[Connection], T]) -> T:
        return self._write_sync(fn)  # a read-only transaction: SQLite begins nothing for a SELECT

    def _write_sync(self, fn: Callable[[Connection], T]) -> T:
        # One connection, held by the database thread: checking one out of a pool per statement
        # costs three times the statement.
        if self._sync_conn is None:
            assert self.sync_engine is not None
            self._sync_conn = self.sync_engine.connect()
        with self._sync_conn.begin():
            return fn(self._sync_conn)

    def _close_sync(self) -> None:
        if self._sync_conn is not None:
            self._sync_conn.close()
            self._sync_conn = None

    async def close(self) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._close_sync)
            self._thread.shutdown(wait=True)
            self._thread = None
        if self.sync_engine is not None:
            self.sync_engine.dispose()
        await self.engine.dispose()


async def open_database(settings: Settings) -> Database:
    """Open ``settings``' database, migrated to the newest schema."""
    return await open_database_at(
        settings.resolved_database_url, settings.node_name, shared=bool(settings.database_url)
    )


async def open_database_at(url: str, node_id: str, *, shared: bool) -> Database:
    engine = engine_for(url)
    try:
        await upgrade(engine, node_id=node_id, adopt=not shared)
    except BaseException:
        await engine.dispose()
        raise
    path = sqlite_path(url)
    if path is not None:
        path.chmod(0o600)
    return Database(engine=engine, node_id=node_id, shared=shared, sync_engine=sqlite_sync_engine(url))


__all__ = ["Database", "engine_for", "open_database", "open_database_at", "open_engine", "upgrade"]
