"""Running the Alembic migrations programmatically, at start-up, on the database's own engine.

Every process that opens the database runs ``upgrade head`` first (a no-op when it is current).
On PostgreSQL a transaction-scoped advisory lock serialises nodes and gateways starting at once;
the whole upgrade is one transaction there (PostgreSQL has transactional DDL), so a failed
migration leaves the schema as it was.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from forkyard.storage.db import schema

MIGRATIONS = Path(__file__).with_name("migrations")
#: Any constant: the key of the advisory lock migrations take on PostgreSQL.
_MIGRATION_LOCK = 0x6167656E76  # "agenv"


def alembic_config(connection: Connection, node_id: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    #: Rows older than the ``node_id`` columns belong to the node that upgrades them.
    cfg.attributes["node_id"] = node_id
    return cfg


async def upgrade(engine: AsyncEngine, *, node_id: str, adopt: bool = False) -> None:
    """Bring the schema to the newest revision. ``adopt``: the database is this node's alone
    (its SQLite file), so every row is made this node's (the host name may have changed since)."""
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade, node_id, adopt)


def _upgrade(connection: Connection, node_id: str, adopt: bool) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
    command.upgrade(alembic_config(connection, node_id), "head")
    if adopt:
        for table in (schema.sandboxes, schema.snapshots, schema.snapshot_copies):
            connection.execute(update(table).where(table.c.node_id != node_id).values(node_id=node_id))
