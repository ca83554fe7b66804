"""The database as it was before Alembic: sandboxes, sandbox_logs, snapshots, snapshot_copies.

An existing SQLite file (made by the aiosqlite stores, any age) is upgraded in place: tables it
has are kept and given the columns they lack (what ``_add_missing_columns`` used to do on every
open), tables it lacks are created. A new database gets all four. The tables are spelled out here,
not taken from ``schema.py``: a revision is what the schema was at that revision.

Revision ID: r0001
Revises:
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "r0001"
down_revision = None
branch_labels = None
depends_on = None

_Serial = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _json(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.Text, nullable=False, server_default=sa.text("'{}'"))


#: Columns newer than the first sandboxes table: older files gain them (a new column each call).
def _added_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("origin", sa.Text, nullable=False, server_default=sa.text("'boot'")),
        sa.Column("restored_from", sa.Text),
        sa.Column("pause_snapshot", sa.Text),
        sa.Column("pause_tier", sa.Text),
        sa.Column("paused_at", sa.Float),
        sa.Column("memory_base", sa.Text),
        _json("log_offsets"),
        sa.Column("egress", sa.Text),
        sa.Column("auto_pause_memory", sa.Integer, nullable=False, server_default=sa.text("1")),
    ]


def _sandboxes() -> None:
    op.create_table(
        "sandboxes",
        sa.Column("seq", _Serial, primary_key=True, autoincrement=True),
        sa.Column("sandbox_id", sa.Text, nullable=False, unique=True),
        sa.Column("template_id", sa.Text, nullable=False),
        sa.Column("alias", sa.Text),
        sa.Column("client_id", sa.Text, nullable=False),
        _json("metadata"),
        _json("envs"),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("end_at", sa.Float, nullable=False),
        sa.Column("cpu_count", sa.Integer, nullable=False),
        sa.Column("memory_mb", sa.Integer, nullable=False),
        sa.Column("disk_mb", sa.Integer, nullable=False),
        sa.Column("runtime", sa.Text, nullable=False),
        sa.Column("instance", sa.Text),
        sa.Column("envd_version", sa.Text, nullable=False),
        sa.Column("envd_access_token", sa.Text),
        sa.Column("traffic_access_token", sa.Text),
        sa.Column("allow_internet_access", sa.Integer),
        sa.Column("auto_pause", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("auto_resume", sa.Integer, nullable=False, server_default=sa.text("0")),
        _json("network"),
        *_added_columns(),
        sqlite_autoincrement=True,
    )


def _sandbox_logs() -> None:
    op.create_table(
        "sandbox_logs",
        sa.Column("id", _Serial, primary_key=True, autoincrement=True),
        sa.Column("sandbox_id", sa.Text, nullable=False),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("level", sa.Text, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        _json("fields"),
        sqlite_autoincrement=True,
    )


def _snapshots() -> None:
    op.create_table(
        "snapshots",
        sa.Column("snapshot_id", sa.Text, primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("source_sandbox_id", sa.Text, nullable=False),
        sa.Column("parent_id", sa.Text),
        sa.Column("name", sa.Text),
        sa.Column("runtime", sa.Text, nullable=False),
        sa.Column("template_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        _json("info"),
    )


def _snapshot_copies() -> None:
    op.create_table(
        "snapshot_copies",
        sa.Column("snapshot_id", sa.Text, primary_key=True),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("cached", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("bytes", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("last_used", sa.Float, nullable=False),
        sa.Column("uploaded_at", sa.Float),
        sa.Column("upload_ms", sa.Integer),
        sa.Column("error", sa.Text),
    )


def _add_missing_sandbox_columns(have: set[str]) -> None:
    """What the aiosqlite store did on every open, once more for files it last opened long ago."""
    for column in _added_columns():
        if column.name not in have:
            op.add_column("sandboxes", column)
    if "extra" in have and "pause_snapshot" not in have:
        # Files made before these were columns kept them in a free-form ``extra`` JSON: a paused
        # sandbox's pause snapshot must survive the upgrade (start-up deletes unowned ones).
        op.execute(
            "UPDATE sandboxes SET pause_snapshot = json_extract(extra, '$.pause_snapshot'),"
            " restored_from = json_extract(extra, '$.restored_from'),"
            " log_offsets = coalesce(json_extract(extra, '$.log_offsets'), '{}')"
        )
    if "pause_tier" not in have:  # every pause was a checkpoint before the frozen tier
        op.execute("UPDATE sandboxes SET pause_tier = 'disk' WHERE state = 'paused'")


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    tables = set(inspector.get_table_names())
    if "sandboxes" in tables:
        _add_missing_sandbox_columns({c["name"] for c in inspector.get_columns("sandboxes")})
    else:
        _sandboxes()
    for name, create in (("sandbox_logs", _sandbox_logs), ("snapshots", _snapshots)):
        if name not in tables:
            create()
    if "snapshot_copies" not in tables:
        _snapshot_copies()
    op.create_index("sandboxes_state", "sandboxes", ["state"], if_not_exists=True)
    op.create_index("sandbox_logs_sandbox", "sandbox_logs", ["sandbox_id", "ts"], if_not_exists=True)
    op.create_index("snapshots_source", "snapshots", ["source_sandbox_id"], if_not_exists=True)


def downgrade() -> None:
    raise NotImplementedError("the database's baseline has no downgrade")
