"""Templates are snapshots: the booted state of a template, and the warm pool restored from it.

The first create of a template boots it (the lifecycle owner does) while this collaborator boots
one more sandbox of it in the background and snapshots it with envd answering; later creates
restore that snapshot, or claim a sandbox the warm pool restored from it ahead of demand. A
template snapshot is valid for one runtime, one template build and one envd bundle (its key).

The sandboxes booted here to be snapshotted, the pooled ones and a build's have no database row:
they are made and killed through :class:`~forkyard.orchestrator.rowless.RowlessSandboxes`, and a
crashed server's start-up clean-up (``Runtime.cleanup_orphans``) removes them like any leak.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from forkyard.config import Settings
from forkyard.errors import Failed, ForkyardError, Gone, Unavailable
from forkyard.orchestrator import templates
from forkyard.orchestrator.background import Background
from forkyard.orchestrator.catalog import SnapshotCatalog, SnapshotMeta
from forkyard.orchestrator.envd_client import EnvdClient, initialised
from forkyard.orchestrator.envd_exec import EnvdExec, start_and_wait_ready
from forkyard.orchestrator.ids import new_sandbox_id
from forkyard.orchestrator.pool import WarmPool
from forkyard.orchestrator.rowless import RowlessSandboxes
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.orchestrator.timing import elapsed_ms
from forkyard.runtime.base import Runtime
from forkyard.storage.envd_bundle import bundle_hash
from forkyard.storage.snapshots import SnapshotRow
from forkyard.types import SandboxInstance, SandboxSpec, TemplateImage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TemplateSnapshot:
    key: str
    row: SnapshotRow
    image: TemplateImage
    runtime: Runtime


class TemplateSnapshots:
    def __init__(
        self,
        settings: Settings,
        catalog: SnapshotCatalog,
        runtimes: RuntimeSet,
        background: Background,
        envd_client: EnvdClient,
        rowless: RowlessSandboxes,
    ) -> None:
        self._settings = settings
        self._envd_client = envd_client
        self._rowless = rowless
        self._catalog = catalog
        self._runtimes = runtimes
        self._background = background
        self._known: dict[str, TemplateSnapshot] = {}
        self._building: set[str] = set()
        self._envd_hash: str | None = None
        self._envd = EnvdExec()
        self.pool = WarmPool(
            min(settings.warm_pool_low, settings.warm_pool_high),
            settings.warm_pool_high,
            self._make_pooled,
            self._kill_pooled,
            settings.pool_refill_quiet_ms / 1000,
        )

    def key(self, info: templates.TemplateInfo, runtime: Runtime) -> str:
        """What a template snapshot is valid for: the runtime, the template build and envd."""
        if self._envd_hash is None:
            self._envd_hash = bundle_hash()
        # envd's file mode is in its environment, which a snapshot keeps.
        mode = ":files-as-user" if self._settings.envd_files_as_user else ""
        return f"{runtime.name}:{info.image.template_id}:{info.build_id}:{self._envd_hash}{mode}"

    async def lookup(self, info: templates.TemplateInfo, runtime: Runtime) -> TemplateSnapshot | None:
        """The template's snapshot, or None (boot instead) while it has none; making one then
        starts in the background. None too when template snapshots are turned off."""
        if not self._settings.template_snapshots:
            return None
        key = self.key(info, runtime)
        rows = await self._catalog.rows("template")
        row = next((r for r in rows if r.name == key), None)
        if row is None:
            self._ensure(key, info, runtime)
            return None
        snap = TemplateSnapshot(key, row, info.image, runtime)
        self._known[key] = snap
        return snap

    def claim(self, snap: TemplateSnapshot) -> SandboxInstance | None:
        """A pooled sandbox restored from ``snap``, or None (restore one instead); the caller's
        from now on (a user sandbox)."""
        instance = self.pool.take(snap.key)
        if instance is not None:
            self._rowless.claimed(instance)
        return instance

    async def drop(self, snap: TemplateSnapshot) -> None:
        """Forget a template snapshot that would not restore (its pool too): the next create boots."""
        self._known.pop(snap.key, None)
        await self.pool.drop(snap.key)
        await self._catalog.delete(snap.row.snapshot_id)

    def making(self, template_id: str) -> bool:
        """Whether a snapshot of ``template_id`` (any build, runtime) is being made right now."""
        return any(key.split(":")[1:2] == [template_id] for key in self._building)

    # -- making them -------------------------------------------------------------------------

    def _ensure(self, key: str, info: templates.TemplateInfo, runtime: Runtime) -> None:
        if key not in self._building:
            self._building.add(key)
            self._background.spawn(self._build(key, info, runtime), name=f"template-snapshot-{key}")

    async def _build(self, key: str, info: templates.TemplateInfo, runtime: Runtime) -> None:
        try:
            row = await self._take(key, info, runtime)
        finally:
            self._building.discard(key)
        self._known[key] = TemplateSnapshot(key, row, info.image, runtime)
        for old in await self._catalog.rows("template"):
            if old.template_id == row.template_id and old.runtime == row.runtime and old.name != key:
                await self.drop(TemplateSnapshot(old.name or "", old, info.image, runtime))
        if info.image.template_id in self._settings.warm_pool_templates or info.pooled:
            self.pool.fill(key)

    async def make(self, info: templates.TemplateInfo, runtime: Runtime) -> None:
        """Make the template's snapshot now (a template build's last step), failing as its
        start or ready command does. With template snapshots off, nothing to make."""
        if not self._settings.template_snapshots:
            return
        key = self.key(info, runtime)
        self._building.add(key)
        await self._build(key, info, runtime)

    async def sandbox_of(
        self, info: templates.TemplateInfo, runtime: Runtime, spec: SandboxSpec
    ) -> SandboxInstance:
        """A sandbox of the template with no database row (a template build's): restored from
        the template's snapshot when it has one (a fraction of a boot), else booted."""
        snap = await self.lookup(info, runtime)
        if snap is not None:
            try:
                return await self._rowless.restore(runtime, spec, self._catalog.ref(snap.row), "build")
            except (Failed, Unavailable, Gone) as exc:
                log.warning("restoring template snapshot %s failed (%s); booting instead", snap.key, exc)
        return await self._rowless.create(runtime, spec, "build")

    async def start_command(
        self, info: templates.TemplateInfo, instance: SandboxInstance, access_token: str | None
    ) -> None:
        """Start a built template's start command in a booted sandbox of it and wait for its
        ready command; a failure is logged (the sandbox stays up, as E2B's would)."""
        if info.start is None:
            return
        try:
            await start_and_wait_ready(
                self._envd, instance, info.image.rootfs, info.start, access_token=access_token
            )
        except ForkyardError as exc:
            log.warning("start command of %s in %s: %s", info.image.template_id, instance.sandbox_id, exc)

    async def forget(self, template_id: str) -> None:
        """Drop every snapshot of a deleted template, and its warm pool."""
        for row in await self._catalog.rows("template"):
            if row.template_id == template_id:
                snap = self._known.get(row.name or "")
                if snap is not None:
                    await self.drop(snap)
                else:
                    await self._catalog.delete(row.snapshot_id)

    async def _take(self, key: str, info: templates.TemplateInfo, runtime: Runtime) -> SnapshotRow:
        """Boot a sandbox of the template, start its start command (once its ready command
        passes), snapshot it with envd answering, remove it."""
        image = info.image
        spec = SandboxSpec(sandbox_id=new_sandbox_id(), template=image)
        started = time.monotonic()
        instance = await self._rowless.create(runtime, spec, "template-snapshot")
        try:
            if info.start is not None:
                await start_and_wait_ready(self._envd, instance, image.rootfs, info.start)
            meta = SnapshotMeta(
                template_rootfs=str(image.rootfs),
                cpu_count=image.vcpus,
                memory_mb=image.memory_mb,
                disk_mb=image.disk_mb,
            )
            row = await self._catalog.take(
                runtime,
                instance,
                kind="template",
                stop=True,
                template_id=image.template_id,
                meta=meta,
                name=key,
            )
        finally:
            await self._rowless.kill(instance)
        log.info("template snapshot %s of %s made in %s ms", row.snapshot_id, key, elapsed_ms(started))
        return row

    # -- the warm pool -----------------------------------------------------------------------

    async def _make_pooled(self, key: str) -> SandboxInstance:
        """One warm-pool sandbox: a restore of the template's snapshot and its ``/init`` with no
        env vars or token (the claim's ``/init`` sets them and skips what this one did)."""
        snap = self._known[key]
        spec = SandboxSpec(sandbox_id=new_sandbox_id(), template=snap.image, ahead_of_demand=True)
        async with self._catalog.use(snap.row) as ref:  # fetched first if its copy was evicted
            instance = await self._rowless.restore(snap.runtime, spec, ref, "warm-pool")
        return await initialised(self._envd_client, self._envd, self._rowless, instance, {}, None)

    async def _kill_pooled(self, instance: SandboxInstance) -> None:
        await self._rowless.kill(instance)

    async def warm_up(self) -> None:
        """At start-up: snapshot and pool the templates named in ``warm_pool_templates`` and those
        built through the build API. With pooling off, template snapshots are made on first use
        instead."""
        if not self._settings.template_snapshots or not self.pool.enabled:
            return
        built = [t.image.template_id for t in templates.list_all(self._settings) if t.pooled]
        for template_id in dict.fromkeys([*self._settings.warm_pool_templates, *built]):
            try:
                info = templates.load(template_id, self._settings)
            except templates.TemplateNotFound:
                log.info("warm pool: template %s is not built; nothing to pool", template_id)
                continue
            runtime = self._runtimes.for_template(info.image)
            snap = await self.lookup(info, runtime)
            if snap is not None:
                self.pool.fill(snap.key)

    async def close(self) -> None:
        await self.pool.close()
        await self._envd.close()
