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
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from agentenv.orchestrator import templates
from agentenv.orchestrator.ids import new_sandbox_id
from agentenv.orchestrator.pool import WarmPool
from agentenv.orchestrator.service import (
    CLIENT_ID,
    CreateRequest,
    Orchestrator,
    OrchestratorError,
    raise_creation_failure,
    utcnow,
)
from agentenv.orchestrator.store import SandboxRecord
from agentenv.runtime.base import Runtime
from agentenv.types import SandboxInstance, SandboxSpec, SnapshotRef, TemplateImage
from agentenv.storage import snapshots as storage
from agentenv.storage.snapshots import SnapshotRow, SnapshotStore

log = logging.getLogger(__name__)

#: Snapshot kind of a template's snapshot (internal: not listed, not a template of its own).
TEMPLATE_KIND = "template"
#: Snapshot kind of a fork's one checkpoint (deleted once the children and parent restored).
FORK_KIND = "fork"
#: Parallel restores of a fork: each is a runsc (or VMM) start plus a CPU-bound state load, so
#: two per core keep the cores busy while one waits on I/O; more only queue.
FORK_PARALLELISM = max(2, 2 * (os.cpu_count() or 1))
#: The API's limit (openapi.yml: SandboxForkRequest.count maximum); the SDKs send at most 20.
MAX_FORK_COUNT = 100


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
        self._envd_hash: str | None = None
        #: Template snapshot key -> (its row, the template, the runtime it restores with).
        self._templates: dict[str, tuple[SnapshotRow, TemplateImage, Runtime]] = {}
        self._building: dict[str, asyncio.Task[object]] = {}
        self._gc_lock = asyncio.Lock()
        settings = orch.settings
        self.pool = WarmPool(
            min(settings.warm_pool_low, settings.warm_pool_high), settings.warm_pool_high,
            self._make_pooled, self._kill_pooled,
        )

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
        # A fork's snapshot never outlives its request: one left behind was cut by a crash (its
        # parent was revived from it during recovery, see :meth:`revive`).
        for row in await store.rows(kind=FORK_KIND):
            await store.delete(row.snapshot_id)
            removed.append(row.snapshot_id)
        if removed:
            log.info("snapshot recovery removed %s", ", ".join(removed))
        await self.collect_garbage()

    async def revive(self, rec: SandboxRecord) -> bool:
        """Restore a sandbox recorded running but found stopped at start-up from the fork
        snapshot a crash cut short (the parent of a fork is stopped between its checkpoint and
        its own restore). False when there is none or the restore fails."""
        store = await self.store()
        rows = await store.rows(kind=FORK_KIND, source=rec.sandbox_id)
        if not rows:
            return False
        row = rows[0]
        try:
            rec.instance = await self.orch.runtime_for(rec).restore(
                self._spec(rec, self._template(rec, row.info)), store.ref(row)
            )
            await self.orch._init_envd(rec)
        except Exception as exc:
            log.warning("reviving %s from %s failed: %s", rec.sandbox_id, row.snapshot_id, exc)
            return False
        await self.orch.store.save(rec)
        self.orch.attach(rec)
        return True

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

    async def _write_snapshot(self, runtime: Runtime, instance: SandboxInstance, *, stop: bool) -> str:
        """Snapshot ``instance`` into a temp dir and commit it by rename; returns its id. The
        caller records it: a crash before that leaves a directory the start-up sweep removes."""
        snapshot_id = new_snapshot_id()
        temp = storage.temp_ref(self.orch.settings.data_dir, snapshot_id)
        try:
            await runtime.snapshot(instance, temp, stop=stop)
            await asyncio.to_thread(storage.commit_dir, self.orch.settings.data_dir, temp)
        except BaseException:
            await asyncio.to_thread(storage.remove_dir, temp.path)
            raise
        return snapshot_id

    async def _take(
        self, rec: SandboxRecord, kind: str, *, stop: bool, name: str | None = None
    ) -> SnapshotRow:
        """Snapshot ``rec`` (caller holds its lock) and commit it; returns the registry row."""
        assert rec.instance is not None
        store = await self.store()
        started = time.monotonic()
        snapshot_id = await self._write_snapshot(self.orch.runtime_for(rec), rec.instance, stop=stop)
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
        self.orch._spawn(self.collect_garbage())
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
        await self.collect_garbage()
        return True

    async def create_from_snapshot(self, row: SnapshotRow, req: CreateRequest) -> SandboxRecord:
        """A new sandbox with the memory and disk of ``row`` (shielded, like a create)."""
        return await asyncio.shield(asyncio.ensure_future(self._restore_new(row, req)))

    async def _restore_new(
        self, row: SnapshotRow, req: CreateRequest, template_id: str | None = None
    ) -> SandboxRecord:
        store = await self.store()
        rec = self._new_record(row, new_sandbox_id(), req, template_id)
        source_template = TemplateImage(
            template_id=row.template_id, rootfs=_rootfs(row.info), vcpus=rec.cpu_count,
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
            await self._go_live(rec, req.timeout_seconds)
        await self.orch.log_event(rec.sandbox_id, "info", f"sandbox restored from {row.snapshot_id}",
                                  duration_ms=_ms(started))
        return rec

    def _new_record(
        self, row: SnapshotRow, sandbox_id: str, req: CreateRequest, template_id: str | None
    ) -> SandboxRecord:
        """The registry row of a sandbox made from ``row``: a user snapshot's sandboxes carry its
        id as their template; a template snapshot's carry the template's id. Metadata and env vars
        default to the snapshot's; envd in the image keeps the source's access token, if any."""
        from agentenv.orchestrator.ids import new_access_token

        now = utcnow()
        info = row.info
        return SandboxRecord(
            sandbox_id=sandbox_id, template_id=template_id or row.snapshot_id,
            alias=template_id or row.name or row.snapshot_id,
            client_id=CLIENT_ID, state="creating", started_at=now,
            end_at=now + dt.timedelta(seconds=req.timeout_seconds),
            cpu_count=int(info.get("cpu_count", 2)), memory_mb=int(info.get("memory_mb", 512)),
            disk_mb=int(info.get("disk_mb", 4096)), runtime=row.runtime, envd_version=_envd_version(),
            metadata=dict(req.metadata or info.get("metadata") or {}),
            envs={**dict(info.get("envs") or {}), **req.envs},
            envd_access_token=info.get("envd_access_token") or (new_access_token() if req.secure else None),
            traffic_access_token=None if req.allow_public_traffic else new_access_token(),
            allow_internet_access=req.allow_internet_access, auto_pause=req.auto_pause,
            auto_resume=req.auto_resume, network=dict(req.network or {}),
            extra={"restored_from": row.snapshot_id},
        )

    async def _go_live(self, rec: SandboxRecord, timeout_seconds: int) -> None:
        """The timeout counts from when the sandbox is usable, as with a create."""
        now = utcnow()
        rec.started_at = now
        rec.end_at = now + dt.timedelta(seconds=timeout_seconds)
        rec.state = "running"
        await self.orch.store.save(rec)
        self.orch.attach(rec)

    # -- templates are snapshots ---------------------------------------------------------------

    def template_key(self, info: templates.TemplateInfo, runtime: Runtime) -> str:
        """What a template snapshot is valid for: the runtime, the template build and envd."""
        if self._envd_hash is None:
            from agentenv.storage.envd_bundle import bundle_hash

            self._envd_hash = bundle_hash()
        return f"{runtime.name}:{info.image.template_id}:{info.build_id}:{self._envd_hash}"

    async def _template_row(self, key: str) -> SnapshotRow | None:
        rows = await (await self.store()).rows(kind=TEMPLATE_KIND)
        return next((r for r in rows if r.name == key), None)

    async def fast_create(
        self, req: CreateRequest, info: templates.TemplateInfo, runtime: Runtime
    ) -> SandboxRecord | None:
        """A create from a template without booting: claim a warm-pool sandbox, else restore the
        template's snapshot. None (boot it) while the template has no snapshot yet; making one
        starts in the background."""
        if not self.orch.settings.template_snapshots:
            return None
        key = self.template_key(info, runtime)
        row = await self._template_row(key)
        if row is None:
            self.ensure_template_snapshot(info, runtime)
            return None
        self._templates[key] = (row, info.image, runtime)
        if req.allow_internet_access is not False:
            instance = self.pool.take(key)
            if instance is not None:
                claimed = await self._claim(instance, row, req, info.image.template_id)
                if claimed is not None:
                    return claimed
        try:
            return await self._restore_new(row, req, template_id=info.image.template_id)
        except OrchestratorError as exc:
            if exc.code < 500:
                raise
            log.warning("restoring template snapshot %s failed (%s); booting instead", key, exc.message)
            await self._drop_template(row)
            return None

    async def _claim(
        self, instance: SandboxInstance, row: SnapshotRow, req: CreateRequest, template_id: str
    ) -> SandboxRecord | None:
        """Hand a pooled sandbox to a create: its row, then envd ``/init`` with the caller's env
        vars and access token. None when the pooled sandbox turned out unusable (it is removed)."""
        rec = self._new_record(row, instance.sandbox_id, req, template_id)
        rec.instance = instance
        rec.extra["warm_pool"] = True
        started = time.monotonic()
        async with self.orch._locks.setdefault(rec.sandbox_id, asyncio.Lock()):
            await self.orch.store.insert(rec)
            try:
                await self.orch._init_envd(rec)
            except Exception as exc:
                await self.orch._abort_create(rec, self.orch.runtime_for(rec), exc)
                return None
            await self._go_live(rec, req.timeout_seconds)
        await self.orch.log_event(rec.sandbox_id, "info", "sandbox created from the warm pool",
                                  template=template_id, duration_ms=_ms(started))
        return rec

    def ensure_template_snapshot(self, info: templates.TemplateInfo, runtime: Runtime) -> None:
        """Make the template's snapshot in the background, once (no-op while one is made)."""
        key = self.template_key(info, runtime)
        task = self._building.get(key)
        if task is None or task.done():
            self._building[key] = self.orch._spawn(self._build_template_snapshot(key, info, runtime))

    async def _build_template_snapshot(
        self, key: str, info: templates.TemplateInfo, runtime: Runtime
    ) -> None:
        try:
            row = await self._take_template_snapshot(key, info.image, runtime)
        except Exception:
            log.exception("making the snapshot of template %s failed", key)
            return
        self._templates[key] = (row, info.image, runtime)
        store = await self.store()
        for old in await store.rows(kind=TEMPLATE_KIND):
            if old.template_id == row.template_id and old.runtime == row.runtime and old.name != key:
                await self._drop_template(old)
        if info.image.template_id in self.orch.settings.warm_pool_templates:
            self.pool.fill(key)

    async def _take_template_snapshot(self, key: str, image: TemplateImage, runtime: Runtime) -> SnapshotRow:
        """Boot a sandbox of the template, snapshot it with envd answering, remove it. The
        sandbox has no registry row: a crash meanwhile leaves an orphan that recovery removes."""
        store = await self.store()
        spec = SandboxSpec(sandbox_id=new_sandbox_id(), template=image)
        started = time.monotonic()
        instance = await runtime.create(spec)
        try:
            snapshot_id = await self._write_snapshot(runtime, instance, stop=True)
            row = SnapshotRow(
                snapshot_id=snapshot_id, kind=TEMPLATE_KIND, source_sandbox_id=spec.sandbox_id,
                runtime=runtime.name, template_id=image.template_id, created_at=utcnow(), name=key,
                info={
                    "template_rootfs": str(image.rootfs), "cpu_count": image.vcpus,
                    "memory_mb": image.memory_mb, "disk_mb": image.disk_mb, "duration_ms": _ms(started),
                },
            )
            await store.add(row)
        finally:
            await runtime.kill(instance)
        log.info("template snapshot %s of %s made in %s ms", snapshot_id, key, _ms(started))
        return row

    async def _drop_template(self, row: SnapshotRow) -> None:
        if row.name:
            self._templates.pop(row.name, None)
            await self.pool.drop(row.name)
        await (await self.store()).delete(row.snapshot_id)
        await self.collect_garbage()

    async def _make_pooled(self, key: str) -> SandboxInstance:
        """One warm-pool sandbox: a restore of the template's snapshot, with no env vars or token
        (a claim's ``/init`` sets them)."""
        row, image, runtime = self._templates[key]
        spec = SandboxSpec(sandbox_id=new_sandbox_id(), template=image)
        return await runtime.restore(spec, (await self.store()).ref(row))

    async def _kill_pooled(self, instance: SandboxInstance) -> None:
        await self.orch.runtime_for_name(instance.runtime).kill(instance)

    async def warm_up(self) -> None:
        """At start-up: snapshot and pool the templates named in ``warm_pool_templates``. With
        pooling off, template snapshots are made on first use instead."""
        settings = self.orch.settings
        if not settings.template_snapshots or not self.pool.enabled:
            return
        for template_id in settings.warm_pool_templates:
            try:
                info = templates.load(template_id, settings)
            except templates.TemplateNotFound:
                log.info("warm pool: template %s is not built; nothing to pool", template_id)
                continue
            runtime = self.orch.runtime_for_template(info.image)
            key = self.template_key(info, runtime)
            row = await self._template_row(key)
            if row is None:
                self.ensure_template_snapshot(info, runtime)
            else:
                self._templates[key] = (row, info.image, runtime)
                self.pool.fill(key)

    # -- shared disk layers --------------------------------------------------------------------

    async def collect_garbage(self) -> None:
        """Have every runtime free the disk layers no snapshot and no sandbox uses any more."""
        store = await self.store()
        async with self._gc_lock:
            for runtime in list(self.orch._runtimes.values()):

                async def live(name: str = runtime.name) -> list[SnapshotRef]:
                    return [store.ref(r) for r in await store.rows() if r.runtime == name]

                try:
                    await runtime.collect_garbage(live)
                except Exception:
                    log.exception("%s: collecting unused disk layers failed", runtime.name)

    # -- fork ----------------------------------------------------------------------------------

    async def fork(self, sandbox_id: str, count: int, timeout_seconds: int) -> list[ForkOutcome]:
        """``count`` independent children with the parent's memory, processes and disk.

        The parent is checkpointed and stopped once; then it is restored in place *alongside*
        its children (it is just one more restore of the same image), rather than before them."""
        if not 1 <= count <= MAX_FORK_COUNT:
            raise OrchestratorError(400, f"count must be between 1 and {MAX_FORK_COUNT}")
        children: list[asyncio.Future[ForkOutcome]] = []
        async with self.orch.locked(sandbox_id) as rec:
            if rec.state != "running" or rec.instance is None:
                raise OrchestratorError(409, f"sandbox {sandbox_id} is {rec.state}, not running")
            self.orch.detach(sandbox_id)
            try:
                row = await self._take(rec, FORK_KIND, stop=True)
            except Exception as exc:
                await self._after_failed_snapshot(rec, exc)
                raise OrchestratorError(500, f"fork of {sandbox_id} failed: {exc}") from exc
            gate = asyncio.Semaphore(FORK_PARALLELISM)
            children = [asyncio.ensure_future(self._fork_child(row, rec, gate, timeout_seconds))
                        for _ in range(count)]
            await asyncio.shield(self._back_after_fork(rec, row))
        try:
            outcomes = await asyncio.shield(asyncio.gather(*children))
        finally:
            # Children stand on the snapshot's disk layers (they hold them) and runsc read the
            # memory image: the snapshot itself is not needed any more.
            await (await self.store()).delete(row.snapshot_id)
            await self.collect_garbage()
        return list(outcomes)

    async def _back_after_fork(self, rec: SandboxRecord, row: SnapshotRow) -> None:
        """Restore the forked parent in place (same id, address and network); a parent that
        cannot come back is destroyed, its children live on."""
        store = await self.store()
        try:
            rec.instance = await self.orch.runtime_for(rec).restore(
                self._spec(rec, self._template(rec, row.info)), store.ref(row)
            )
        except Exception as exc:
            await self.orch._destroy(rec, reason=f"restoring the parent after its fork failed: {exc}")
            return
        await self.orch.store.save(rec)
        self.orch.attach(rec)

    async def _fork_child(
        self, row: SnapshotRow, parent: SandboxRecord, gate: asyncio.Semaphore, timeout_seconds: int
    ) -> ForkOutcome:
        async with gate:
            try:
                child = await self._restore_new(row, _child_request(row, parent, timeout_seconds))
                return ForkOutcome(child, None)
            except OrchestratorError as exc:
                return ForkOutcome(None, exc)
            except Exception as exc:
                return ForkOutcome(None, OrchestratorError(500, str(exc)))


def _child_request(row: SnapshotRow, parent: SandboxRecord, timeout_seconds: int) -> CreateRequest:
    """A fork child is made like its parent: same metadata, network and traffic policy."""
    return CreateRequest(
        template_id=row.snapshot_id, timeout_seconds=timeout_seconds, metadata=dict(parent.metadata),
        envs={}, secure=parent.envd_access_token is not None,
        allow_internet_access=parent.allow_internet_access,
        allow_public_traffic=parent.traffic_access_token is None, network=dict(parent.network or {}),
    )


def _rootfs(info: dict[str, Any]) -> Any:
    from pathlib import Path

    raw = info.get("template_rootfs")
    if not raw:
        raise OrchestratorError(500, "snapshot does not record its template's root file system")
    return Path(raw)


def _envd_version() -> str:
    from agentenv.types import ENVD_VERSION

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

    async def destroyed_hook(rec: SandboxRecord) -> None:
        await service.collect_garbage()

    orch.pause_hook = pause_hook
    orch.resume_hook = resume_hook
    orch.fast_create_hook = service.fast_create
    orch.revive_hook = service.revive
    orch.destroyed_hook = destroyed_hook
    original_start = orch.start
    original_close = orch.close

    async def start() -> None:
        await original_start()
        await service.startup()
        await service.warm_up()

    async def close() -> None:
        await service.pool.close()
        await original_close()

    orch.start = start  # type: ignore[method-assign]
    orch.close = close  # type: ignore[method-assign]


def service_of(orch: Orchestrator) -> SnapshotService:
    service = getattr(orch, "snapshots", None)
    if not isinstance(service, SnapshotService):
        install(orch)
        service = orch.snapshots  # type: ignore[attr-defined]
    assert isinstance(service, SnapshotService)
    return service
