"""Cluster mode: ``node_id`` on sandboxes and snapshots, snapshot copies keyed by snapshot and
node, and the ``nodes`` table (heartbeats, capacity).

Rows from before belong to the node that upgrades them (``config.attributes["node_id"]``).

Revision ID: r0002
Revises: r0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "r0002"
down_revision = "r0001"
branch_labels = None
depends_on = None

_COPY_COLUMNS = "snapshot_id, state, cached, bytes, last_used, uploaded_at, upload_ms, error"


def _node_id() -> str:
    node = context.config.attributes.get("node_id")
    if not node:
        raise RuntimeError("the database migration needs this node's id")
    return str(node)


def _own_column(table: str) -> None:
    op.add_column(table, sa.Column("node_id", sa.Text, nullable=False, server_default=sa.text("''")))
    op.execute(sa.text(f"UPDATE {table} SET node_id = :node").bindparams(node=_node_id()))


def _copies_columns() -> list[sa.Column[object]]:
    return [
        sa.Column("snapshot_id", sa.Text, primary_key=True),
        sa.Column("node_id", sa.Text, primary_key=True, server_default=sa.text("''")),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("cached", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("bytes", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("last_used", sa.Float, nullable=False),
        sa.Column("uploaded_at", sa.Float),
        sa.Column("upload_ms", sa.Integer),
        sa.Column("error", sa.Text),
    ]


def _key_copies_by_node() -> None:
    """``snapshot_copies``' key becomes (snapshot_id, node_id): each node has its own copy."""
    if op.get_bind().dialect.name == "sqlite":  # SQLite cannot change a primary key: rebuild
        op.rename_table("snapshot_copies", "snapshot_copies_r0001")
        op.create_table("snapshot_copies", *_copies_columns())
        op.execute(
            sa.text(
                f"INSERT INTO snapshot_copies ({_COPY_COLUMNS}, node_id)"
                f" SELECT {_COPY_COLUMNS}, :node FROM snapshot_copies_r0001"
            ).bindparams(node=_node_id())
        )
        op.drop_table("snapshot_copies_r0001")
        return
    _own_column("snapshot_copies")
    op.drop_constraint("snapshot_copies_pkey", "snapshot_copies", type_="primary")
    op.create_primary_key("snapshot_copies_pkey", "snapshot_copies", ["snapshot_id", "node_id"])


def _nodes() -> None:
    def count(name: str, kind: type[sa.Integer] = sa.Integer) -> sa.Column[int]:
        return sa.Column(name, kind, nullable=False, server_default=sa.text("0"))

    op.create_table(
        "nodes",
        sa.Column("node_id", sa.Text, primary_key=True),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False, server_default=sa.text("'up'")),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("runtime", sa.Text, nullable=False, server_default=sa.text("''")),
        count("vcpus_total"),
        count("vcpus_free"),
        count("memory_total_mib", sa.BigInteger),
        count("memory_free_mib", sa.BigInteger),
        count("disk_free_mib", sa.BigInteger),
        count("sandboxes_running"),
        count("slots_free"),
        sa.Column("warm_templates", sa.Text, nullable=False, server_default=sa.text("'[]'")),
        sa.Column("version", sa.Text, nullable=False, server_default=sa.text("''")),
    )


def upgrade() -> None:
    _own_column("sandboxes")
    op.create_index("sandboxes_node_state", "sandboxes", ["node_id", "state"])
    _own_column("snapshots")
    _key_copies_by_node()
    _nodes()


def downgrade() -> None:
    raise NotImplementedError("the database's cluster revision has no downgrade")
