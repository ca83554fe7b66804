"""E2B volumes: the ``volumes`` table (named directories of a node, mounted into sandboxes).

Revision ID: r0003
Revises: r0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0003"
down_revision = "r0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "volumes",
        sa.Column("volume_id", sa.Text, primary_key=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("token", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("node_id", sa.Text, nullable=False, server_default=sa.text("''")),
    )


def downgrade() -> None:
    op.drop_table("volumes")
