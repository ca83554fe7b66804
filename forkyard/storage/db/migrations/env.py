"""Alembic's environment: always run by :mod:`forkyard.storage.db.migrate` on a connection it
passes in ``config.attributes`` (there is no alembic.ini; ``alembic`` on the command line is not
how the database is migrated)."""

from __future__ import annotations

from alembic import context

from forkyard.storage.db.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
