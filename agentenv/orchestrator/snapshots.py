"""Pause/resume, snapshots and fork on top of the runtime's ``snapshot``/``restore``.

Every operation writes its snapshot to a temp dir, commits it by rename, then records it
(:mod:`agentenv.storage.snapshots`); sandbox records go through transient states (``pausing``,
``resuming``, ``creating``) so that the orchestrator's start-up recovery kills whatever a crash
interrupted, and :meth:`SnapshotService.startup` sweeps uncommitted snapshot dirs.

- pause: ``runtime.snapshot(stop=True)`` into a ``pause`` snapshot; the sandbox's network and
  scratch dir stay (a resume restores into them, so its address does not change).
- resume/connect: ``runtime.restore`` of the pause snapshot, which is then deleted.
- snapshot: ``runtime.snapshot(stop=False)``: a ``snapshot`` row other sandboxes are created from
  (``POST /sandboxes`` with the snapshot id as ``templateID``). Delete: ``DELETE /templates/{id}``.
- fork: one snapshot, then ``count`` restores in parallel, each an independent sandbox.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from agentenv.orchestrator import templates
from agentenv.orchestrator.ids import new_sandbox_id
from agentenv.orchestrator.service import (
    CLIENT_ID,
    Orchestrator,
    OrchestratorError,
    raise_creation_failure,
    utcnow,
)
from agentenv.orchestrator.store import SandboxRecord
from agentenv.runtime.base import SandboxSpec, TemplateImage
from agentenv.storage import snapshots as storage
from agentenv.storage.snapshots import SnapshotRow, SnapshotStore

log = logging.getLogger(__name__)

#: Parallel restores of a fork (each runs a runsc restore; more only queue on 2 cores).
FORK_PARALLELISM = 4
MAX_FORK_COUNT = 64


def new_snapshot_id() -> str:
    return "snap" + secrets.token_hex(8)


def _ms(start: float) -> str:
    return str(round((time.monotonic() - start) * 1000))


@dataclass
class ForkOutcome:
    record: SandboxRecord | None
    error: OrchestratorError | None


class SnapshotService:
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self._store: SnapshotStore | None = None

    async def store(self) -> SnapshotStore:
        if self._store is None:
            self._store = SnapshotStore(self.orch.store.db, self.orch.settings.data_dir)
            await self._store.open()
        return self._store

    async def startup(self) -> None:
        """After the orchestrator's recovery: drop uncommitted snapshot dirs and pause
        snapshots of sandboxes that are no longer paused."""
        store = await self.store()
        removed = await store.sweep_incomplete()
        for row in await store.rows(kind="pause"):
            rec = await self.orch.store.get(row.source_sandbox_id)
            if rec is None or rec.state != "paused" or rec.extra.get("pause_snapshot") != row.snapshot_id:
                await store.delete(row.snapshot_id)
                removed.append(row.snapshot_id)
        if removed:
            log.info("snapshot recovery removed %s", ", ".join(removed))

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _template(rec: SandboxRecord, info: dict[str, Any] | None = None) -> TemplateImage:
        try:
            image = templates.load(rec.template_id, OrchestratorSettings.of(rec)).image
        except Exception:
            image = None
        rootfs = (info or {}).get("template_rootfs") or (
            rec.instance.state.get("template_rootfs") if rec.instance else None
        )
        if image is not None:
            return image
        if not rootfs:
            raise OrchestratorError(500, f"template {rec.template_id} of {rec.sandbox_id} is gone")
        from pathlib import Path

        return TemplateImage(template_id=rec.template_id, rootfs=Path(rootfs), vcpus=rec.cpu_count,
                             memory_mb=rec.memory_mb, disk_mb=rec.disk_mb)

    def _spec(self, rec: SandboxRecord, image: TemplateImage) -> SandboxSpec:
        return SandboxSpec(
            sandbox_id=rec.sandbox_id, template=image, envs=rec.envs,
            allow_internet_access=rec.allow_internet_access is not False,
            envd_access_token=rec.envd_access_token,
        )

    async def _take(
        self, rec: SandboxRecord, kind: str, *, stop: bool, name: str | None = None
    ) -> SnapshotRow:
        """Snapshot ``rec`` (caller holds its lock) and commit it; returns the registry row."""
        assert rec.instance is not None
        store = await self.store()
        snapshot_id = new_snapshot_id()
        temp = storage.temp_ref(self.orch.settings.data_dir, snapshot_id)
        started = time.monotonic()
        try:
            await self.orch.runtime_for(rec).snapshot(rec.instance, temp, stop=stop)
            await asyncio.to_thread(storage.commit_dir, self.orch.settings.data_dir, temp)
        except BaseException:
            await asyncio.to_thread(storage.remove_dir, temp.path)
            raise
        row = SnapshotRow(
            snapshot_id=snapshot_id, kind=kind, source_sandbox_id=rec.sandbox_id, runtime=rec.runtime,
            template_id=rec.template_id, created_at=utcnow(), name=name,
            info={
                "template_rootfs": rec.instance.state.get("template_rootfs"),
                "cpu_count": rec.cpu_count, "memory_mb": rec.memory_mb, "disk_mb": rec.disk_mb,
                "envs": rec.envs, "metadata": rec.metadata, "duration_ms": _ms(started),
                # envd in the image still requires the source's token: restored sandboxes keep it.
                "envd_access_token": rec.envd_access_token,
            },
        )
        await store.add(row)
        await self.orch.log_event(rec.sandbox_id, "info", f"{kind} snapshot {snapshot_id} taken",
                                  duration_ms=_ms(started))
        return row

    # -- pause / resume ------------------------------------------------------------------------

    async def pause_locked(self, rec: SandboxRecord) -> None:
        if rec.state == "paused":
            raise OrchestratorError(409, f"sandbox {rec.sandbox_id} is already paused")
        if rec.state != "running" or rec.instance is None:
            raise OrchestratorError(409, f"sandbox {rec.sandbox_id} is {rec.state}, not running")
        self.orch.detach(rec.sandbox_id)
        rec.state = "pausing"
        await self.orch.store.save(rec)
        try:
            row = await self._take(rec, "pause", stop=True)
        except Exception as exc:
            await self._after_failed_snapshot(rec, exc)
            raise OrchestratorError(500, f"pausing sandbox {rec.sandbox_id} failed: {exc}") from exc
        rec.extra["pause_snapshot"] = row.snapshot_id
        rec.state = "paused"
        await self.orch.store.save(rec)

    async def _after_failed_snapshot(self, rec: SandboxRecord, exc: BaseException) -> None:
        """Back to running if the sandbox survived, else destroy it (never leak it)."""
        assert rec.instance is not None
        log.warning("snapshot of %s failed: %s", rec.sandbox_id, exc)
        runtime = self.orch.runtime_for(rec)
        alive = False
        try:
            alive = await runtime.is_alive(rec.instance)
        except Exception:
            alive = False
        if alive:
            rec.state = "running"
            await self.orch.store.save(rec)
            self.orch.attach(rec)
            return
        await self.orch._destroy(rec, reason=f"snapshot failed and the sandbox did not survive: {exc}")

    async def pause(self, sandbox_id: str) -> None:
        async with self.orch.locked(sandbox_id) as rec:
            await self.pause_locked(rec)

    async def resume_locked(self, rec: SandboxRecord, timeout_seconds: int) -> SandboxRecord:
        if rec.state == "running":
            raise OrchestratorError(409, f"sandbox {rec.sandbox_id} is already running")
        if rec.state != "paused":
            raise OrchestratorError(409, f"sandbox {rec.sandbox_id} is {rec.state}")
        store = await self.store()
        row = await store.get(str(rec.extra.get("pause_snapshot", "")))
        if row is None:
            raise OrchestratorError(500, f"the pause snapshot of {rec.sandbox_id} is missing")
        rec.state = "resuming"
        await self.orch.store.save(rec)
        started = time.monotonic()
        try:
            rec.instance = await self.orch.runtime_for(rec).restore(
                self._spec(rec, self._template(rec, row.info)), store.ref(row)
            )
            await self.orch._init_envd(rec)
        except Exception as exc:
            await self.orch._destroy(rec, reason=f"resume failed: {exc}")
            raise OrchestratorError(500, f"resuming sandbox {rec.sandbox_id} failed: {exc}") from exc
        rec.state = "running"
        rec.end_at = utcnow() + dt.timedelta(seconds=timeout_seconds)
        rec.extra.pop("pause_snapshot", None)
        await self.orch.store.save(rec)
        self.orch.attach(rec)
        await store.delete(row.snapshot_id)
        await self.orch.log_event(rec.sandbox_id, "info", "sandbox resumed", duration_ms=_ms(started))
        return rec

    async def resume(self, sandbox_id: str, timeout_seconds: int) -> SandboxRecord:
        async with self.orch.locked(sandbox_id) as rec:
            return await self.resume_locked(rec, timeout_seconds)

    # -- snapshots -----------------------------------------------------------------------------

    async def create_snapshot(self, sandbox_id: str, name: str | None) -> SnapshotRow:
        async with self.orch.locked(sandbox_id) as rec:
            if rec.state != "running" or rec.instance is None:
                raise OrchestratorError(409, f"sandbox {sandbox_id} is {rec.state}, not running")
            self.orch.detach(sandbox_id)
            try:
                row = await self._take(rec, "snapshot", stop=False, name=name)
            except Exception as exc:
                await self._after_failed_snapshot(rec, exc)
                raise OrchestratorError(500, f"snapshot of {sandbox_id} failed: {exc}") from exc
            self.orch.attach(rec)
            return row

    async def find_snapshot(self, name_or_id: str) -> SnapshotRow | None:
        row = await (await self.store()).find(name_or_id)
        return row if row is not None and row.kind == "snapshot" else None

    async def list_snapshots(self, source: str | None = None, name: str | None = None) -> list[SnapshotRow]:
        rows = await (await self.store()).rows(kind="snapshot", source=source)
        if name:
            key = name.split("/")[-1].split(":")[0]
            rows = [r for r in rows if key in (r.name, r.snapshot_id)]
        return rows

    async def delete_snapshot(self, name_or_id: str) -> bool:
        row = await self.find_snapshot(name_or_id)
        if row is None:
            return False
        await (await self.store()).delete(row.snapshot_id)
        return True

    async def create_from_snapshot(
        self, row: SnapshotRow, *, timeout_seconds: int, metadata: dict[str, str] | None,
        envs: dict[str, str] | None, secure: bool, allow_internet_access: bool | None,
        auto_pause: bool = False,
    ) -> SandboxRecord:
        """A new sandbox with the memory and disk of ``row`` (shielded, like a create)."""
        task = asyncio.ensure_future(self._restore_new(
            row, timeout_seconds=timeout_seconds, metadata=metadata, envs=envs, secure=secure,
            allow_internet_access=allow_internet_access, auto_pause=auto_pause,
        ))
        return await asyncio.shield(task)

    async def _restore_new(
        self, row: SnapshotRow, *, timeout_seconds: int, metadata: dict[str, str] | None,
        envs: dict[str, str] | None, secure: bool, allow_internet_access: bool | None,
        auto_pause: bool,
    ) -> SandboxRecord:
        from agentenv.orchestrator.ids import new_access_token

        store = await self.store()
        now = utcnow()
        info = row.info
        rec = SandboxRecord(
            sandbox_id=new_sandbox_id(), template_id=row.snapshot_id, alias=row.name or row.snapshot_id,
            client_id=CLIENT_ID, state="creating", started_at=now,
            end_at=now + dt.timedelta(seconds=timeout_seconds),
            cpu_count=int(info.get("cpu_count", 2)), memory_mb=int(info.get("memory_mb", 512)),
            disk_mb=int(info.get("disk_mb", 4096)), runtime=row.runtime, envd_version=_envd_version(),
            metadata=metadata if metadata is not None else dict(info.get("metadata") or {}),
            envs={**dict(info.get("envs") or {}), **(envs or {})},
            envd_access_token=info.get("envd_access_token") or (new_access_token() if secure else None),
            allow_internet_access=allow_internet_access, auto_pause=auto_pause,
            extra={"restored_from": row.snapshot_id},
        )
        source_template = TemplateImage(
            template_id=row.template_id, rootfs=_rootfs(info), vcpus=rec.cpu_count,
            memory_mb=rec.memory_mb, disk_mb=rec.disk_mb,
        )
        async with self.orch._locks.setdefault(rec.sandbox_id, asyncio.Lock()):
            await self.orch.store.insert(rec)
            started = time.monotonic()
            runtime = self.orch.runtime_for(rec)
            try:
                rec.instance = await runtime.restore(self._spec(rec, source_template), store.ref(row))
                await self.orch._init_envd(rec)
            except BaseException as exc:
                await self.orch._abort_create(rec, runtime, exc)
                raise_creation_failure(exc, f"restore from {row.snapshot_id}")
            now = utcnow()
            rec.started_at = now
            rec.end_at = now + dt.timedelta(seconds=timeout_seconds)
            rec.state = "running"
            await self.orch.store.save(rec)
            self.orch.attach(rec)
        await self.orch.log_event(rec.sandbox_id, "info", f"sandbox restored from {row.snapshot_id}",
                                  duration_ms=_ms(started))
        return rec

    # -- fork ----------------------------------------------------------------------------------

    async def fork(self, sandbox_id: str, count: int, timeout_seconds: int) -> list[ForkOutcome]:
        if not 1 <= count <= MAX_FORK_COUNT:
            raise OrchestratorError(400, f"count must be between 1 and {MAX_FORK_COUNT}")
        async with self.orch.locked(sandbox_id) as rec:
            if rec.state != "running" or rec.instance is None:
                raise OrchestratorError(409, f"sandbox {sandbox_id} is {rec.state}, not running")
            self.orch.detach(sandbox_id)
            try:
                row = await self._take(rec, "fork", stop=False)
            except Exception as exc:
                await self._after_failed_snapshot(rec, exc)
                raise OrchestratorError(500, f"fork of {sandbox_id} failed: {exc}") from exc
            self.orch.attach(rec)
            parent = rec
        gate = asyncio.Semaphore(FORK_PARALLELISM)

        async def one() -> ForkOutcome:
            async with gate:
                try:
                    child = await self._restore_new(
                        row, timeout_seconds=timeout_seconds, metadata=dict(parent.metadata),
                        envs=None, secure=parent.envd_access_token is not None,
                        allow_internet_access=parent.allow_internet_access, auto_pause=False,
                    )
                    return ForkOutcome(child, None)
                except OrchestratorError as exc:
                    return ForkOutcome(None, exc)
                except Exception as exc:
                    return ForkOutcome(None, OrchestratorError(500, str(exc)))

        try:
            outcomes = await asyncio.shield(asyncio.gather(*(one() for _ in range(count))))
        finally:
            # Children copied the disk layer and runsc read the memory image: it is not needed.
            await (await self.store()).delete(row.snapshot_id)
        return list(outcomes)


def _rootfs(info: dict[str, Any]) -> Any:
    from pathlib import Path

    raw = info.get("template_rootfs")
    if not raw:
        raise OrchestratorError(500, "snapshot does not record its template's root file system")
    return Path(raw)


def _envd_version() -> str:
    from agentenv.config import ENVD_VERSION

    return ENVD_VERSION


class OrchestratorSettings:
    """Settings lookup for template loading (kept separate for tests)."""

    settings: Any = None

    @classmethod
    def of(cls, rec: SandboxRecord) -> Any:
        return cls.settings


def install(orch: Orchestrator) -> None:
    """Called by the API before ``orch.start()``: register hooks and the start-up sweep."""
    service = SnapshotService(orch)
    OrchestratorSettings.settings = orch.settings
    orch.snapshots = service  # type: ignore[attr-defined]

    async def pause_hook(o: Orchestrator, rec: SandboxRecord) -> None:
        await service.pause_locked(rec)

    async def resume_hook(o: Orchestrator, rec: SandboxRecord, seconds: int) -> SandboxRecord:
        return await service.resume_locked(rec, seconds)

    orch.pause_hook = pause_hook
    orch.resume_hook = resume_hook
    original_start = orch.start

    async def start() -> None:
        await original_start()
        await service.startup()

    orch.start = start  # type: ignore[method-assign]


def service_of(orch: Orchestrator) -> SnapshotService:
    service = getattr(orch, "snapshots", None)
    if not isinstance(service, SnapshotService):
        install(orch)
        service = orch.snapshots  # type: ignore[attr-defined]
    assert isinstance(service, SnapshotService)
    return service
