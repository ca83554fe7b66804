"""The sandbox registry: one SQLite database (``settings.db_path``) accessed through aiosqlite.

Tables:
- ``sandboxes``: one row per sandbox ever created on this node (killed ones stay, so their logs
  and ids remain answerable); ``instance`` holds the runtime's JSON state for re-attach/cleanup.
- ``sandbox_logs``: structured log lines per sandbox (orchestrator events, envd/runtime output).

The snapshot catalog keeps its ``snapshots`` table in the same database. Columns added after a
node's database was first made are added on open (:data:`ADDED_COLUMNS`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import aiosqlite

from agentenv.types import EgressPolicy, SandboxInstance, SandboxState

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL UNIQUE,
    template_id TEXT NOT NULL,
    alias TEXT,
    client_id TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    envs TEXT NOT NULL DEFAULT '{}',
    state TEXT NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_mb INTEGER NOT NULL,
    runtime TEXT NOT NULL,
    instance TEXT,
    envd_version TEXT NOT NULL,
    envd_access_token TEXT,
    traffic_access_token TEXT,
    allow_internet_access INTEGER,
    auto_pause INTEGER NOT NULL DEFAULT 0,
    auto_resume INTEGER NOT NULL DEFAULT 0,
    network TEXT NOT NULL DEFAULT '{}',
    origin TEXT NOT NULL DEFAULT 'boot',
    restored_from TEXT,
    pause_snapshot TEXT,
    pause_tier TEXT,
    paused_at REAL,
    memory_base TEXT,
    log_offsets TEXT NOT NULL DEFAULT '{}',
    egress TEXT,
    auto_pause_memory INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS sandbox_logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    ts REAL NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    fields TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS sandbox_logs_sandbox ON sandbox_logs(sandbox_id, ts);
"""

#: Columns newer than the first schema: (name, SQL type and default), added to older databases.
ADDED_COLUMNS = (
    ("origin", "TEXT NOT NULL DEFAULT 'boot'"),
    ("restored_from", "TEXT"),
    ("pause_snapshot", "TEXT"),
    ("pause_tier", "TEXT"),
    ("paused_at", "REAL"),
    ("memory_base", "TEXT"),
    ("log_offsets", "TEXT NOT NULL DEFAULT '{}'"),
    ("egress", "TEXT"),
    ("auto_pause_memory", "INTEGER NOT NULL DEFAULT 1"),
)

#: States in which a record still owns host resources (recovery re-attaches or cleans them).
LIVE_STATES = (
    SandboxState.CREATING,
    SandboxState.RUNNING,
    SandboxState.PAUSING,
    SandboxState.RESUMING,
    SandboxState.KILLING,
)
#: States the API lists.
LISTED_STATES = (SandboxState.RUNNING, SandboxState.PAUSED)

#: How a sandbox came to be: booted from its template, restored from the template's snapshot,
#: claimed from the warm pool, restored from a user snapshot or claimed from its standbys, or
#: restored as a fork child.
Origin = Literal["boot", "template", "warm_pool", "snapshot", "standby", "fork"]

#: Where a paused sandbox is: ``frozen`` in place (memory kept, resumes in milliseconds),
#: ``moving`` to disk (its checkpoint under way), or on ``disk`` (checkpointed, memory freed);
#: ``filesystem``: E2B's ``memory: false`` pause (processes ended, only the disk kept; a resume
#: boots afresh over it).
PauseTier = Literal["frozen", "moving", "disk", "filesystem"]


def _ts(value: dt.datetime) -> float:
    return value.timestamp()


def _dt(value: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(value, dt.UTC)


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    client_id: str
    state: SandboxState
    started_at: dt.datetime
    end_at: dt.datetime
    cpu_count: int
    memory_mb: int
    disk_mb: int
    runtime: str
    envd_version: str
    alias: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    instance: SandboxInstance | None = None
    envd_access_token: str | None = None
    traffic_access_token: str | None = None
    allow_internet_access: bool | None = None
    auto_pause: bool = False
    #: ``autoPauseMemory``: False makes the timeout's auto-pause a filesystem-only one.
    auto_pause_memory: bool = True
    auto_resume: bool = False
    network: dict[str, Any] = field(default_factory=dict)
    origin: Origin = "boot"
    #: The snapshot this sandbox was restored from (user snapshot, template snapshot, fork).
    restored_from: str | None = None
    #: While paused on disk: the snapshot its resume restores.
    pause_snapshot: str | None = None
    #: While paused: which tier (the API shows both as ``paused``), and since when.
    pause_tier: PauseTier | None = None
    paused_at: dt.datetime | None = None
    #: The snapshot the sandbox's memory was last written to or restored from: the parent a
    #: runtime with incremental memory snapshots (Firecracker ``Diff``) takes the next one against.
    memory_base: str | None = None
    #: Bytes of each runtime log file already moved into the sandbox's logs.
    log_offsets: dict[str, int] = field(default_factory=dict)
    #: Outbound rules beyond the defaults (``network.allowOut``/``denyOut``, as enforced; None:
    #: the defaults). Kept here so that every restore (resume from disk, a restart) re-applies them.
    egress: EgressPolicy | None = None
    seq: int = 0


_COLUMNS = (
    "sandbox_id",
    "template_id",
    "alias",
    "client_id",
    "metadata",
    "envs",
    "state",
    "started_at",
    "end_at",
    "cpu_count",
    "memory_mb",
    "disk_mb",
    "runtime",
    "instance",
    "envd_version",
    "envd_access_token",
    "traffic_access_token",
    "allow_internet_access",
    "auto_pause",
    "auto_resume",
    "network",
    "origin",
    "restored_from",
    "pause_snapshot",
    "pause_tier",
    "paused_at",
    "memory_base",
    "log_offsets",
    "egress",
    "auto_pause_memory",
)


def _to_row(rec: SandboxRecord) -> tuple[Any, ...]:
    return (
        rec.sandbox_id,
        rec.template_id,
        rec.alias,
        rec.client_id,
        json.dumps(rec.metadata),
        json.dumps(rec.envs),
        rec.state,
        _ts(rec.started_at),
        _ts(rec.end_at),
        rec.cpu_count,
        rec.memory_mb,
        rec.disk_mb,
        rec.runtime,
        json.dumps(asdict(rec.instance)) if rec.instance else None,
        rec.envd_version,
        rec.envd_access_token,
        rec.traffic_access_token,
        None if rec.allow_internet_access is None else int(rec.allow_internet_access),
        int(rec.auto_pause),
        int(rec.auto_resume),
        json.dumps(rec.network),
        rec.origin,
        rec.restored_from,
        rec.pause_snapshot,
        rec.pause_tier,
        _ts(rec.paused_at) if rec.paused_at else None,
        rec.memory_base,
        json.dumps(rec.log_offsets),
        json.dumps(asdict(rec.egress)) if rec.egress else None,
        int(rec.auto_pause_memory),
    )


def _from_row(row: aiosqlite.Row) -> SandboxRecord:
    instance = json.loads(row["instance"]) if row["instance"] else None
    aia = row["allow_internet_access"]
    return SandboxRecord(
        seq=row["seq"],
        sandbox_id=row["sandbox_id"],
        template_id=row["template_id"],
        alias=row["alias"],
        client_id=row["client_id"],
        metadata=json.loads(row["metadata"]),
        envs=json.loads(row["envs"]),
        state=SandboxState(row["state"]),
        started_at=_dt(row["started_at"]),
        end_at=_dt(row["end_at"]),
        cpu_count=row["cpu_count"],
        memory_mb=row["memory_mb"],
        disk_mb=row["disk_mb"],
        runtime=row["runtime"],
        instance=SandboxInstance(**instance) if instance else None,
        envd_version=row["envd_version"],
        envd_access_token=row["envd_access_token"],
        traffic_access_token=row["traffic_access_token"],
        allow_internet_access=None if aia is None else bool(aia),
        auto_pause=bool(row["auto_pause"]),
        auto_resume=bool(row["auto_resume"]),
        network=json.loads(row["network"]),
        origin=cast(Origin, row["origin"]),
        restored_from=row["restored_from"],
        pause_snapshot=row["pause_snapshot"],
        pause_tier=cast("PauseTier | None", row["pause_tier"]),
        paused_at=_dt(row["paused_at"]) if row["paused_at"] is not None else None,
        memory_base=row["memory_base"],
        log_offsets=json.loads(row["log_offsets"]),
        egress=_egress(row["egress"]),
        auto_pause_memory=bool(row["auto_pause_memory"]),
    )


def _egress(raw: str | None) -> EgressPolicy | None:
    if not raw:
        return None
    data = json.loads(raw)
    return EgressPolicy(allow_out=tuple(data.get("allow_out", ())), deny_out=tuple(data.get("deny_out", ())))


@dataclass(frozen=True)
class LogLine:
    timestamp: dt.datetime
    level: str
    message: str
    fields: dict[str, str]


@dataclass(frozen=True)
class ListQuery:
    states: tuple[SandboxState, ...] = LISTED_STATES
    metadata: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    started_after: dt.datetime | None = None
    ascending: bool = False
    #: Resume after this ``(started_at, seq)`` position (the decoded ``nextToken``).
    after: tuple[float, int] | None = None
    limit: int | None = None


class SandboxStore:
    """Async access to the registry. One connection; aiosqlite runs it on its own thread and
    serialises statements, and a lock keeps multi-statement writes atomic."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._db: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()

    async def open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._db = await aiosqlite.connect(self._path)
        self._db.row_factory = aiosqlite.Row
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute("PRAGMA synchronous=NORMAL")
        await self._db.executescript(SCHEMA)
        await self._add_missing_columns()
        await self._db.commit()
        self._path.chmod(0o600)

    async def _add_missing_columns(self) -> None:
        async with self.db.execute("PRAGMA table_info(sandboxes)") as cur:
            have = {r["name"] for r in await cur.fetchall()}
        for name, decl in ADDED_COLUMNS:
            if name not in have:
                await self.db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {decl}")
        if "extra" in have and "pause_snapshot" not in have:
            # Databases made before these were columns kept them in a free-form ``extra`` JSON: a
            # paused sandbox's pause snapshot must survive the upgrade (start-up deletes unowned ones).
            await self.db.execute(
                "UPDATE sandboxes SET pause_snapshot = json_extract(extra, '$.pause_snapshot'),"
                " restored_from = json_extract(extra, '$.restored_from'),"
                " log_offsets = coalesce(json_extract(extra, '$.log_offsets'), '{}')"
            )
        if "pause_tier" not in have:  # every pause was a checkpoint before the frozen tier
            await self.db.execute("UPDATE sandboxes SET pause_tier = 'disk' WHERE state = 'paused'")

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("sandbox store is not open")
        return self._db

    async def insert(self, rec: SandboxRecord) -> None:
        placeholders = ", ".join("?" for _ in _COLUMNS)
        async with self._write_lock:
            cur = await self.db.execute(
                f"INSERT INTO sandboxes ({', '.join(_COLUMNS)}) VALUES ({placeholders})", _to_row(rec)
            )
            await self.db.commit()
            rec.seq = cur.lastrowid or 0

    async def save(self, rec: SandboxRecord) -> None:
        """Write every field of ``rec`` back (the orchestrator holds the sandbox's lock)."""
        assignments = ", ".join(f"{c} = ?" for c in _COLUMNS[1:])
        row = _to_row(rec)
        async with self._write_lock:
            await self.db.execute(
                f"UPDATE sandboxes SET {assignments} WHERE sandbox_id = ?", (*row[1:], rec.sandbox_id)
            )
            await self.db.commit()

    async def get(self, sandbox_id: str) -> SandboxRecord | None:
        async with self.db.execute("SELECT * FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)) as cur:
            row = await cur.fetchone()
        return _from_row(row) if row else None

    async def in_states(self, states: Iterable[SandboxState]) -> list[SandboxRecord]:
        wanted = tuple(states)
        marks = ", ".join("?" for _ in wanted)
        async with self.db.execute(
            f"SELECT * FROM sandboxes WHERE state IN ({marks}) ORDER BY seq", wanted
        ) as cur:
            return [_from_row(r) for r in await cur.fetchall()]

    async def expired(self, now: dt.datetime) -> list[str]:
        async with self.db.execute(
            "SELECT sandbox_id FROM sandboxes WHERE state = 'running' AND end_at <= ?", (_ts(now),)
        ) as cur:
            return [r["sandbox_id"] for r in await cur.fetchall()]

    async def query(self, query: ListQuery) -> list[SandboxRecord]:
        """Sandboxes matching ``query`` ordered by start time (then creation order), filtered
        by metadata in Python (it is a JSON column), paged by the ``after`` cursor."""
        marks = ", ".join("?" for _ in query.states)
        sql = f"SELECT * FROM sandboxes WHERE state IN ({marks})"
        params: list[Any] = list(query.states)
        if query.template:
            sql += " AND (template_id = ? OR alias = ?)"
            params += [query.template, query.template]
        if query.started_after:
            sql += " AND started_at >= ?"
            params.append(_ts(query.started_after))
        if query.after:
            op = ">" if query.ascending else "<"
            sql += f" AND (started_at, seq) {op} (?, ?)"
            params += list(query.after)
        direction = "ASC" if query.ascending else "DESC"
        sql += f" ORDER BY started_at {direction}, seq {direction}"
        out: list[SandboxRecord] = []
        async with self.db.execute(sql, params) as cur:
            async for row in cur:
                rec = _from_row(row)
                if all(rec.metadata.get(k) == v for k, v in query.metadata.items()):
                    out.append(rec)
                    if query.limit is not None and len(out) > query.limit:
                        break  # one extra row tells the caller there is a next page
        return out

    async def add_log(self, sandbox_id: str, level: str, message: str, **fields: str) -> None:
        async with self._write_lock:
            await self.db.execute(
                "INSERT INTO sandbox_logs (sandbox_id, ts, level, message, fields) VALUES (?, ?, ?, ?, ?)",
                (sandbox_id, dt.datetime.now(dt.UTC).timestamp(), level, message, json.dumps(fields)),
            )
            await self.db.commit()

    async def add_logs(self, sandbox_id: str, lines: list[tuple[str, str, dict[str, str]]]) -> None:
        """Store several ``(level, message, fields)`` lines at once."""
        now = dt.datetime.now(dt.UTC).timestamp()
        async with self._write_lock:
            await self.db.executemany(
                "INSERT INTO sandbox_logs (sandbox_id, ts, level, message, fields) VALUES (?, ?, ?, ?, ?)",
                [(sandbox_id, now, level, msg, json.dumps(fields)) for level, msg, fields in lines],
            )
            await self.db.commit()

    async def set_log_offsets(self, sandbox_id: str, offsets: dict[str, int]) -> None:
        """Record how far the runtime log files were collected, without rewriting the record."""
        async with self._write_lock:
            await self.db.execute(
                "UPDATE sandboxes SET log_offsets = ? WHERE sandbox_id = ?", (json.dumps(offsets), sandbox_id)
            )
            await self.db.commit()

    async def logs(
        self, sandbox_id: str, *, start: dt.datetime | None, limit: int, ascending: bool = True
    ) -> list[LogLine]:
        sql = "SELECT ts, level, message, fields FROM sandbox_logs WHERE sandbox_id = ?"
        params: list[Any] = [sandbox_id]
        if start is not None:
            sql += " AND ts >= ?" if ascending else " AND ts <= ?"
            params.append(_ts(start))
        sql += f" ORDER BY id {'ASC' if ascending else 'DESC'} LIMIT ?"
        params.append(limit)
        async with self.db.execute(sql, params) as cur:
            return [
                LogLine(_dt(r["ts"]), r["level"], r["message"], json.loads(r["fields"]))
                for r in await cur.fetchall()
            ]
