"""Every table of the database, as one SQLAlchemy Core :data:`metadata` (SQLite and PostgreSQL).

Types are chosen to keep today's SQLite files valid as they are: times are float epoch seconds
(``Float``: SQLite ``REAL``, PostgreSQL ``double precision``), booleans are ``Integer`` 0/1 and
JSON documents are ``Text``. The Alembic revisions in ``migrations/`` create exactly this; a test
compares them (``tests/unit/test_db_migrations.py``).

- ``sandboxes``: one row per sandbox ever created (killed ones stay, so their logs and ids remain
  answerable); ``node_id`` is the node that owns it (runs it, recovers it, expires it).
- ``sandbox_logs``: structured log lines per sandbox.
- ``snapshots``: shared rows (a durable snapshot is restorable on any node); ``node_id`` is the
  node that took it, whose disk has (or had) its directory.
- ``snapshot_copies``: a node's local copy of a snapshot (keyed by snapshot and node).
- ``volumes``: E2B's volumes (named directories); ``node_id`` is the node whose disk holds it.
- ``nodes``: the cluster's nodes and their last heartbeat (written by ``forkyard node serve``,
  read by the gateway).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Index, Integer, MetaData, Table, Text, text

metadata = MetaData()

#: An autoincrementing key: ``INTEGER PRIMARY KEY AUTOINCREMENT`` on SQLite, ``bigserial`` elsewhere.
_SerialKey = BigInteger().with_variant(Integer(), "sqlite")


def _json_text(name: str) -> Column[str]:
    return Column(name, Text, nullable=False, server_default=text("'{}'"))


sandboxes = Table(
    "sandboxes",
    metadata,
    Column("seq", _SerialKey, primary_key=True, autoincrement=True),
    Column("sandbox_id", Text, nullable=False, unique=True),
    Column("template_id", Text, nullable=False),
    Column("alias", Text),
    Column("client_id", Text, nullable=False),
    _json_text("metadata"),
    _json_text("envs"),
    Column("state", Text, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("end_at", Float, nullable=False),
    Column("cpu_count", Integer, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    Column("disk_mb", Integer, nullable=False),
    Column("runtime", Text, nullable=False),
    Column("instance", Text),
    Column("envd_version", Text, nullable=False),
    Column("envd_access_token", Text),
    Column("traffic_access_token", Text),
    Column("allow_internet_access", Integer),
    Column("auto_pause", Integer, nullable=False, server_default=text("0")),
    Column("auto_resume", Integer, nullable=False, server_default=text("0")),
    _json_text("network"),
    Column("origin", Text, nullable=False, server_default=text("'boot'")),
    Column("restored_from", Text),
    Column("pause_snapshot", Text),
    Column("pause_tier", Text),
    Column("paused_at", Float),
    Column("memory_base", Text),
    _json_text("log_offsets"),
    Column("egress", Text),
    Column("auto_pause_memory", Integer, nullable=False, server_default=text("1")),
    Column("timeout_seconds", Integer, nullable=False, server_default=text("0")),
    Column("node_id", Text, nullable=False, server_default=text("''")),
    Index("sandboxes_state", "state"),
    Index("sandboxes_node_state", "node_id", "state"),
    sqlite_autoincrement=True,
)

sandbox_logs = Table(
    "sandbox_logs",
    metadata,
    Column("id", _SerialKey, primary_key=True, autoincrement=True),
    Column("sandbox_id", Text, nullable=False),
    Column("ts", Float, nullable=False),
    Column("level", Text, nullable=False),
    Column("message", Text, nullable=False),
    _json_text("fields"),
    Index("sandbox_logs_sandbox", "sandbox_id", "ts"),
    sqlite_autoincrement=True,
)

snapshots = Table(
    "snapshots",
    metadata,
    Column("snapshot_id", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("source_sandbox_id", Text, nullable=False),
    Column("parent_id", Text),
    Column("name", Text),
    Column("runtime", Text, nullable=False),
    Column("template_id", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    _json_text("info"),
    Column("node_id", Text, nullable=False, server_default=text("''")),
    Index("snapshots_source", "source_sandbox_id"),
)

snapshot_copies = Table(
    "snapshot_copies",
    metadata,
    Column("snapshot_id", Text, primary_key=True),
    Column("node_id", Text, primary_key=True, server_default=text("''")),
    Column("state", Text, nullable=False),
    Column("cached", Integer, nullable=False, server_default=text("1")),
    Column("bytes", BigInteger, nullable=False, server_default=text("0")),
    Column("last_used", Float, nullable=False),
    Column("uploaded_at", Float),
    Column("upload_ms", Integer),
    Column("error", Text),
)

volumes = Table(
    "volumes",
    metadata,
    Column("volume_id", Text, primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    #: The bearer token of the volume content API (``VolumeAndToken.token``).
    Column("token", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("node_id", Text, nullable=False, server_default=text("''")),
)

#: ``state``: ``up`` (heartbeating), ``draining`` (takes no new sandboxes), ``lost`` (missed its
#: heartbeats: the gateway marked it and killed its sandboxes' rows).
nodes = Table(
    "nodes",
    metadata,
    Column("node_id", Text, primary_key=True),
    Column("url", Text, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'up'")),
    Column("heartbeat_at", Float, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("runtime", Text, nullable=False, server_default=text("''")),
    Column("vcpus_total", Integer, nullable=False, server_default=text("0")),
    Column("vcpus_free", Integer, nullable=False, server_default=text("0")),
    Column("memory_total_mib", BigInteger, nullable=False, server_default=text("0")),
    Column("memory_free_mib", BigInteger, nullable=False, server_default=text("0")),
    Column("disk_free_mib", BigInteger, nullable=False, server_default=text("0")),
    Column("sandboxes_running", Integer, nullable=False, server_default=text("0")),
    Column("slots_free", Integer, nullable=False, server_default=text("0")),
    Column("warm_templates", Text, nullable=False, server_default=text("'[]'")),
    Column("version", Text, nullable=False, server_default=text("''")),
)

NODE_STATES = ("up", "draining", "lost")
