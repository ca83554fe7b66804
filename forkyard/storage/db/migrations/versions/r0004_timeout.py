"""The timeout a sandbox was created with (``sandboxes.timeout_seconds``): an auto-resume gives
it that again (E2B's). Rows from before get 0, read as the default timeout.

Revision ID: r0004
Revises: r0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0004"
down_revision = "r0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "sandboxes", sa.Column("timeout_seconds", sa.Integer, nullable=False, server_default=sa.text("0"))
    )


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("timeout_seconds")
