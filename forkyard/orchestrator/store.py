"""The sandbox store: SQLAlchemy Core over the node's SQLite file (``settings.db_path``) or a
cluster's shared PostgreSQL (``settings.database_url``); tables in :mod:`forkyard.storage.db.schema`.

- ``sandboxes``: one row per sandbox ever created (killed ones stay, so their logs and ids remain
  answerable); ``instance`` holds the runtime's JSON state for re-attach/cleanup; ``node_id`` the
  node that owns it. A node reads only its own rows (recovery, expiry, listing, ``get``); the
  gateway lists across nodes (:meth:`SandboxStore.query_all`, :meth:`SandboxStore.get_any`).
- ``sandbox_logs``: structured log lines per sandbox (orchestrator events, envd/runtime output).

The snapshot catalog keeps its tables in the same database (:attr:`SandboxStore.db`). Opening
the store migrates the schema to the newest revision (``forkyard/storage/db/migrations``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import json
import logging
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Executable,
    RowMapping,
    Select,
    bindparam,
    insert,
    select,
    true,
    tuple_,
    update,
)

from forkyard.config import Settings
from forkyard.errors import Unavailable
from forkyard.storage.db import Database, open_database_at
from forkyard.storage.db.schema import sandbox_logs, sandboxes
from forkyard.types import LISTED_STATES, EgressPolicy, SandboxInstance, SandboxState

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


@dataclass(frozen=True)
class NetworkPolicy:
    """A sandbox's network policy as its create (and ``PUT /sandboxes/{id}/network``) set it.

    Stored in the record's columns as before it was typed (``allow_internet_access``, ``egress``
    and ``network`` holding E2B's camelCase keys), so records of either version read back."""

    #: ``allowInternetAccess`` as asked (None: not said, which allows it).
    allow_internet_access: bool | None = None
    #: ``network.allowOut``/``denyOut`` as enforced (None: the defaults only).
    egress: EgressPolicy | None = None
    #: ``network.maskRequestHost``: the Host the sandbox sees (``${PORT}`` expanded by the proxy).
    mask_request_host: str | None = None
    #: ``network.dnsServers`` (None: not set).
    dns_servers: tuple[str, ...] | None = None

    @property
    def internet(self) -> bool:
        return self.allow_internet_access is not False


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
    auto_pause: bool = False
    #: ``autoPauseMemory``: False makes the timeout's auto-pause a filesystem-only one.
    auto_pause_memory: bool = True
    auto_resume: bool = False
    #: The timeout it was created with: an auto-resume gives it that again, counted from the
    #: resume (E2B's; 0 in rows from before it was kept: the SDKs' default then).
    timeout_seconds: int = 0
    #: Its network policy (E2B's ``allowInternetAccess`` and ``network``; ``allowPublicTraffic`` is
    #: ``traffic_access_token``): every restore (resume from disk, a restart) re-applies it.
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
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
    seq: int = 0


def _to_row(rec: SandboxRecord) -> dict[str, Any]:
    """Every column but ``seq`` and ``node_id`` (the store's own)."""
    return {
        "sandbox_id": rec.sandbox_id,
        "template_id": rec.template_id,
        "alias": rec.alias,
        "client_id": rec.client_id,
        "metadata": json.dumps(rec.metadata),
        "envs": json.dumps(rec.envs),
        "state": str(rec.state),
        "started_at": _ts(rec.started_at),
        "end_at": _ts(rec.end_at),
        "cpu_count": rec.cpu_count,
        "memory_mb": rec.memory_mb,
        "disk_mb": rec.disk_mb,
        "runtime": rec.runtime,
        "instance": json.dumps(rec.instance.to_json()) if rec.instance else None,
        "envd_version": rec.envd_version,
        "envd_access_token": rec.envd_access_token,
        "traffic_access_token": rec.traffic_access_token,
        "allow_internet_access": None
        if rec.network.allow_internet_access is None
        else int(rec.network.allow_internet_access),
        "auto_pause": int(rec.auto_pause),
        "auto_resume": int(rec.auto_resume),
        "network": json.dumps(_network_extras(rec.network)),
        "origin": rec.origin,
        "restored_from": rec.restored_from,
        "pause_snapshot": rec.pause_snapshot,
        "pause_tier": rec.pause_tier,
        "paused_at": _ts(rec.paused_at) if rec.paused_at else None,
        "memory_base": rec.memory_base,
        "log_offsets": json.dumps(rec.log_offsets),
        "egress": json.dumps(asdict(rec.network.egress)) if rec.network.egress else None,
        "auto_pause_memory": int(rec.auto_pause_memory),
        "timeout_seconds": rec.timeout_seconds,
    }


def _from_row(row: RowMapping) -> SandboxRecord:
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
        instance=SandboxInstance.from_json(instance) if instance else None,
        envd_version=row["envd_version"],
        envd_access_token=row["envd_access_token"],
        traffic_access_token=row["traffic_access_token"],
        network=_network(aia, row["network"], row["egress"]),
        auto_pause=bool(row["auto_pause"]),
        auto_resume=bool(row["auto_resume"]),
        timeout_seconds=int(row["timeout_seconds"]),
        origin=cast(Origin, row["origin"]),
        restored_from=row["restored_from"],
        pause_snapshot=row["pause_snapshot"],
        pause_tier=cast("PauseTier | None", row["pause_tier"]),
        paused_at=_dt(row["paused_at"]) if row["paused_at"] is not None else None,
        memory_base=row["memory_base"],
        log_offsets=json.loads(row["log_offsets"]),
        auto_pause_memory=bool(row["auto_pause_memory"]),
    )


def _network_extras(policy: NetworkPolicy) -> dict[str, object]:
    """The ``network`` column: E2B's keys of what the policy holds besides its other columns."""
    extras: dict[str, object] = {}
    if policy.mask_request_host is not None:
        extras["maskRequestHost"] = policy.mask_request_host
    if policy.dns_servers is not None:
        extras["dnsServers"] = list(policy.dns_servers)
    return extras


def _network(
    allow_internet_access: int | None, extras_raw: str | None, egress_raw: str | None
) -> NetworkPolicy:
    extras = json.loads(extras_raw) if extras_raw else {}
    mask, dns = extras.get("maskRequestHost"), extras.get("dnsServers")
    return NetworkPolicy(
        allow_internet_access=None if allow_internet_access is None else bool(allow_internet_access),
        egress=_egress(egress_raw),
        mask_request_host=str(mask) if mask is not None else None,
        dns_servers=tuple(str(d) for d in dns) if isinstance(dns, list) else None,
    )


def _egress(raw: str | None) -> EgressPolicy | None:
    if not raw:
        return None
    data = json.loads(raw)
    return EgressPolicy(
        allow_out=tuple(data.get("allow_out", ())),
        deny_out=tuple(data.get("deny_out", ())),
        allow_domains=tuple(data.get("allow_domains", ())),
        resolvers=tuple(data.get("resolvers", ())),
    )


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


log = logging.getLogger(__name__)

#: How often deferred records are tried again while the registry is out of reach.
DEFERRED_RETRY_S = 0.5

# The hot path's statements, built once: values travel as execute() parameters, so a write
# compiles nothing (SQLAlchemy's cache) and builds no expression per value.
_INSERT = insert(sandboxes)
#: ``UPDATE sandboxes SET <the parameters' columns> WHERE sandbox_id = :_sandbox_id``
_SAVE = update(sandboxes).where(sandboxes.c.sandbox_id == bindparam("_sandbox_id"))
_ADD_LOG = insert(sandbox_logs)


class SandboxStore:
    """Async access to the database's sandboxes and their logs, as one node (``node_id``).

    Every write is one transaction (:meth:`Database.write`; on SQLite all of them run on the
    database's one thread, in order, as the single aiosqlite connection used to)."""

    def __init__(self, path: Path, *, database_url: str = "", node_id: str = "") -> None:
        self._url = database_url or f"sqlite+aiosqlite:///{path}"
        self._shared = bool(database_url)
        self.node_id = node_id or socket.gethostname()
        self._database: Database | None = None
        #: Records whose save found the registry out of reach (:meth:`save_or_defer`), newest per
        #: sandbox, written by :meth:`_flush_deferred` once it answers again.
        self._deferred: dict[str, SandboxRecord] = {}
        self._flusher: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> SandboxStore:
        return cls(settings.db_path, database_url=settings.database_url, node_id=settings.node_name)

    async def open(self) -> None:
        self._database = await open_database_at(self._url, self.node_id, shared=self._shared)

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self._deferred and self._database is not None:
            # A last try; what is still unwritten, start-up's recovery finds by its processes.
            with contextlib.suppress(Unavailable):
                await self._write_deferred()
        if self._database is not None:
            await self._database.close()
            self._database = None

    @property
    def db(self) -> Database:
        """The open database (the snapshot catalog shares it)."""
        if self._database is None:
            raise RuntimeError("sandbox store is not open")
        return self._database

    async def _rows(self, stmt: Select[Any]) -> list[RowMapping]:
        return await self.db.read(lambda conn: list(conn.execute(stmt).mappings()))

    async def _write(
        self, stmt: Executable, params: dict[str, Any] | list[dict[str, Any]]
    ) -> CursorResult[Any]:
        return await self.db.write(lambda conn: conn.execute(stmt, params))

    def _mine(self) -> ColumnElement[bool]:
        return sandboxes.c.node_id == self.node_id

    async def insert(self, rec: SandboxRecord) -> None:
        result = await self._write(_INSERT, {**_to_row(rec), "node_id": self.node_id})
        key = result.inserted_primary_key
        rec.seq = int(key[0]) if key else 0

    async def save(self, rec: SandboxRecord) -> None:
        """Write every field of ``rec`` back (the orchestrator holds the sandbox's lock)."""
        await self._save_row(rec)
        self._deferred.pop(rec.sandbox_id, None)  # older than what was just written

    async def _save_row(self, rec: SandboxRecord) -> None:
        row = _to_row(rec)
        row["_sandbox_id"] = row.pop("sandbox_id")
        await self._write(_SAVE, row)

    async def save_or_defer(self, rec: SandboxRecord) -> bool:
        """:meth:`save`, or, when the registry is out of reach, keep ``rec`` and write it as soon
        as the registry answers again (False). For what has already happened and must be
        recorded whatever the database does: a kill, a create undone. Until it is written,
        :meth:`get` answers with it. (A save is a whole-row ``UPDATE``: repeating it is safe.)"""
        try:
            await self.save(rec)
            return True
        except Unavailable:
            self._deferred[rec.sandbox_id] = copy.deepcopy(rec)
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush_deferred(), name="registry-deferred")
            log.warning("registry unreachable: the record of %s (%s) waits", rec.sandbox_id, rec.state)
            return False

    @property
    def deferred(self) -> list[str]:
        """The sandboxes whose latest record is not written yet."""
        return list(self._deferred)

    async def _flush_deferred(self) -> None:
        while self._deferred:
            await asyncio.sleep(DEFERRED_RETRY_S)
            with contextlib.suppress(Unavailable):
                await self._write_deferred()

    async def _write_deferred(self) -> None:
        for sandbox_id, rec in list(self._deferred.items()):
            if self._deferred.get(sandbox_id) is not rec:
                continue  # written, or replaced by a newer one, meanwhile
            await self._save_row(rec)
            if self._deferred.get(sandbox_id) is rec:
                del self._deferred[sandbox_id]
                log.info("registry back: the deferred record of %s (%s) is written", sandbox_id, rec.state)

    async def get(self, sandbox_id: str) -> SandboxRecord | None:
        """This node's sandbox ``sandbox_id`` (None: unknown, or another node's)."""
        waiting = self._deferred.get(sandbox_id)
        if waiting is not None:  # newer than its row
            return copy.deepcopy(waiting)
        rows = await self._rows(select(sandboxes).where(sandboxes.c.sandbox_id == sandbox_id, self._mine()))
        return _from_row(rows[0]) if rows else None

    async def get_any(self, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox whichever node owns it (the gateway's look-up), with its owner."""
        rows = await self._rows(select(sandboxes).where(sandboxes.c.sandbox_id == sandbox_id))
        return _from_row(rows[0]) if rows else None

    async def owner(self, sandbox_id: str) -> str | None:
        """The node that owns ``sandbox_id`` (None: no such sandbox)."""
        stmt = select(sandboxes.c.node_id).where(sandboxes.c.sandbox_id == sandbox_id)
        found = await self.db.read(lambda conn: conn.scalar(stmt))
        return None if found is None else str(found)

    async def in_states(self, states: Iterable[SandboxState]) -> list[SandboxRecord]:
        wanted = [str(s) for s in states]
        stmt = select(sandboxes).where(sandboxes.c.state.in_(wanted), self._mine()).order_by(sandboxes.c.seq)
        return [_from_row(r) for r in await self._rows(stmt)]

    async def expired(self, now: dt.datetime) -> list[str]:
        stmt = select(sandboxes.c.sandbox_id).where(
            sandboxes.c.state == str(SandboxState.RUNNING), sandboxes.c.end_at <= _ts(now), self._mine()
        )
        return [r["sandbox_id"] for r in await self._rows(stmt)]

    async def query(self, query: ListQuery) -> list[SandboxRecord]:
        """This node's sandboxes matching ``query`` ordered by start time (then creation order),
        filtered by metadata in Python (it is a JSON column), paged by the ``after`` cursor."""
        return await self._query(query, self._mine())

    async def query_all(self, query: ListQuery) -> list[SandboxRecord]:
        """:meth:`query` across every node (the gateway's ``GET /sandboxes``)."""
        return await self._query(query, true())

    async def _query(self, query: ListQuery, scope: ColumnElement[bool]) -> list[SandboxRecord]:
        c = sandboxes.c
        stmt = select(sandboxes).where(scope, c.state.in_([str(s) for s in query.states]))
        if query.template:
            stmt = stmt.where((c.template_id == query.template) | (c.alias == query.template))
        if query.started_after:
            stmt = stmt.where(c.started_at >= _ts(query.started_after))
        if query.after:
            position, after = tuple_(c.started_at, c.seq), tuple_(*query.after)
            stmt = stmt.where(position > after if query.ascending else position < after)
        order = (c.started_at.asc(), c.seq.asc()) if query.ascending else (c.started_at.desc(), c.seq.desc())
        stmt = stmt.order_by(*order)
        if query.limit is not None and not query.metadata:
            stmt = stmt.limit(query.limit + 1)  # one extra row tells the caller there is a next page
        out: list[SandboxRecord] = []
        for row in await self._rows(stmt):
            rec = _from_row(row)
            if all(rec.metadata.get(k) == v for k, v in query.metadata.items()):
                out.append(rec)
                if query.limit is not None and len(out) > query.limit:
                    break
        return out

    async def add_log(self, sandbox_id: str, level: str, message: str, **fields: str) -> None:
        await self.add_logs(sandbox_id, [(level, message, fields)])

    async def add_logs(self, sandbox_id: str, lines: list[tuple[str, str, dict[str, str]]]) -> None:
        """Store several ``(level, message, fields)`` lines at once."""
        if not lines:
            return
        now = dt.datetime.now(dt.UTC).timestamp()
        rows = [
            {
                "sandbox_id": sandbox_id,
                "ts": now,
                "level": level,
                "message": msg,
                "fields": json.dumps(fields),
            }
            for level, msg, fields in lines
        ]
        await self._write(_ADD_LOG, rows)

    async def set_log_offsets(self, sandbox_id: str, offsets: dict[str, int]) -> None:
        """Record how far the runtime log files were collected, without rewriting the record."""
        await self._write(_SAVE, {"_sandbox_id": sandbox_id, "log_offsets": json.dumps(offsets)})

    async def logs(
        self, sandbox_id: str, *, start: dt.datetime | None, limit: int, ascending: bool = True
    ) -> list[LogLine]:
        c = sandbox_logs.c
        stmt = select(c.ts, c.level, c.message, c.fields).where(c.sandbox_id == sandbox_id)
        if start is not None:
            stmt = stmt.where(c.ts >= _ts(start) if ascending else c.ts <= _ts(start))
        stmt = stmt.order_by(c.id.asc() if ascending else c.id.desc()).limit(limit)
        return [
            LogLine(_dt(r["ts"]), r["level"], r["message"], json.loads(r["fields"]))
            for r in await self._rows(stmt)
        ]
