"""The snapshot catalog: snapshots on disk and their rows, for the lifecycle owner.

Writing a snapshot is: the runtime writes it into a temp dir, the dir is committed by rename,
then the row is added (``forkyard.storage.snapshots``); a crash before the row leaves a dir the
start-up sweep removes. Snapshots share disk layers; :meth:`SnapshotCatalog.collect_garbage` has
each runtime free the layers nothing names any more, and frees dropped template builds' roots no
sandbox and no snapshot stands on any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from forkyard.errors import Failed, Unavailable
from forkyard.orchestrator.durable import DurableSnapshots
from forkyard.runtime.base import Runtime
from forkyard.storage import snapshots as storage
from forkyard.storage import templates as template_storage
from forkyard.storage.db import Database
from forkyard.storage.db.schema import sandboxes
from forkyard.storage.snapshots import SnapshotKind, SnapshotRow, SnapshotStore
from forkyard.types import SandboxInstance, SandboxState, SnapshotRef, TemplateImage

log = logging.getLogger(__name__)


def new_snapshot_id() -> str:
    return "snap" + secrets.token_hex(8)


@dataclass(frozen=True)
class SnapshotMeta:
    """What a snapshot records about the sandbox it was taken of (the row's ``info`` JSON)."""

    template_rootfs: str | None
    cpu_count: int = 2
    memory_mb: int = 512
    disk_mb: int = 4096
    envs: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    #: envd in the image still requires the source's token: restored sandboxes keep it.
    envd_access_token: str | None = None
    duration_ms: int = 0

    @classmethod
    def of(cls, row: SnapshotRow) -> SnapshotMeta:
        info = row.info
        return cls(
            template_rootfs=info.get("template_rootfs"),
            cpu_count=int(info.get("cpu_count", 2)),
            memory_mb=int(info.get("memory_mb", 512)),
            disk_mb=int(info.get("disk_mb", 4096)),
            envs=dict(info.get("envs") or {}),
            metadata=dict(info.get("metadata") or {}),
            envd_access_token=info.get("envd_access_token"),
            duration_ms=int(info.get("duration_ms", 0)),
        )

    def info(self) -> dict[str, Any]:
        return {
            "template_rootfs": self.template_rootfs,
            "cpu_count": self.cpu_count,
            "memory_mb": self.memory_mb,
            "disk_mb": self.disk_mb,
            "envs": self.envs,
            "metadata": self.metadata,
            "envd_access_token": self.envd_access_token,
            "duration_ms": self.duration_ms,
        }

    def image(self, template_id: str) -> TemplateImage:
        """The template the snapshot's sandbox stood on, as recorded when it was taken."""
        if not self.template_rootfs:
            raise Failed(f"snapshot of template {template_id} does not record its root file system")
        return TemplateImage(
            template_id=template_id,
            rootfs=Path(self.template_rootfs),
            vcpus=self.cpu_count,
            memory_mb=self.memory_mb,
            disk_mb=self.disk_mb,
        )


class SnapshotCatalog:
    def __init__(
        self,
        data_dir: Path,
        *,
        durable: DurableSnapshots | None = None,
        runtimes: Iterable[Runtime] = (),
        templates_dir: Path | None = None,
    ) -> None:
        self._data_dir = data_dir
        #: Where dropped template builds wait for the last sandbox or snapshot on them to go.
        self._templates_dir = templates_dir
        self._store: SnapshotStore | None = None
        self._gc_lock = asyncio.Lock()
        #: The snapshot store's side (uploads, fetches, the cache cap); None: node-local only.
        self.durable = durable
        self._runtimes = runtimes
        #: Told after every delete (the garbage collector's notice, see :mod:`.garbage`).
        self._deleted: list[Callable[[], None]] = []

    def on_delete(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after each snapshot delete (what it stood on may be free now)."""
        self._deleted.append(listener)

    async def open(self, db: Database) -> None:
        """Open on the database (the node's SQLite file, or a cluster's shared database)."""
        self._store = SnapshotStore(db, self._data_dir)
        await self._store.open()
        if self.durable is not None:
            await self.durable.open(db, self._store)

    @property
    def store(self) -> SnapshotStore:
        if self._store is None:
            raise RuntimeError("the snapshot catalog is not open")
        return self._store

    # -- writing -----------------------------------------------------------------------------

    async def take(
        self,
        runtime: Runtime,
        instance: SandboxInstance,
        *,
        kind: SnapshotKind,
        stop: bool,
        template_id: str,
        meta: SnapshotMeta,
        name: str | None = None,
        parent: SnapshotRef | None = None,
    ) -> SnapshotRow:
        """Snapshot ``instance`` into a temp dir, commit it by rename, then add its row. A crash
        before the row leaves a directory the start-up sweep removes."""
        started = time.monotonic()
        snapshot_id = new_snapshot_id()
        temp = storage.temp_ref(self._data_dir, snapshot_id)
        temp = SnapshotRef(snapshot_id=temp.snapshot_id, path=temp.path, parent=parent)
        try:
            await runtime.snapshot(instance, temp, stop=stop)
            committed = await asyncio.to_thread(storage.commit_dir, self._data_dir, temp)
        except BaseException:
            await asyncio.to_thread(storage.remove_dir, temp.path)
            raise
        row = SnapshotRow(
            snapshot_id=snapshot_id,
            kind=kind,
            source_sandbox_id=instance.sandbox_id,
            runtime=runtime.name,
            template_id=template_id,
            created_at=dt.datetime.now(dt.UTC),
            name=name,
            info=dataclasses.replace(meta, duration_ms=round((time.monotonic() - started) * 1000)).info(),
            parent_id=parent.snapshot_id if parent else None,
        )
        try:
            await self.store.add(row)
        except Unavailable:
            raise  # its commit may have gone through: the directory stays (start-up sweeps orphans)
        except BaseException:
            # No row names it (a full disk refused the row): no snapshot is left half-made.
            await asyncio.to_thread(storage.remove_dir, committed.path)
            raise
        if self.durable is not None:
            await self.durable.committed(row)
        return row

    # -- reading -----------------------------------------------------------------------------

    def ref(self, row: SnapshotRow) -> SnapshotRef:
        """Where the snapshot lies. Every snapshot directory is complete on its own (an incremental
        one was merged onto a copy of its parent when taken), so a restore needs no parent."""
        return self.store.ref(row)

    @contextlib.asynccontextmanager
    async def use(self, row: SnapshotRow) -> AsyncIterator[SnapshotRef]:
        """Where the snapshot lies, for a restore: its local copy is complete (what this node
        lacked fetched from the snapshot store) and kept from eviction until the block ends."""
        if self.durable is None:
            yield self.ref(row)
            return
        async with self.durable.use(row):
            yield self.ref(row)

    async def parent_for(self, snapshot_id: str | None) -> SnapshotRef | None:
        """The snapshot a new one may be incremental to, if it still exists on this node (an
        evicted copy is no base: the new one is then full)."""
        row = await self.store.get(snapshot_id) if snapshot_id else None
        ref = self.store.ref(row) if row is not None else None
        return ref if ref is not None and ref.path.is_dir() else None

    async def get(self, snapshot_id: str) -> SnapshotRow | None:
        return await self.store.get(snapshot_id)

    async def find_user_snapshot(self, name_or_id: str) -> SnapshotRow | None:
        """A user snapshot by id or name: this node's, else one the snapshot store holds (taken
        on another node, or before this node's database was lost)."""
        row = await self.store.find(name_or_id)
        if row is None and self.durable is not None:
            row = await self.durable.adopt(name_or_id)
        return row if row is not None and row.kind == "snapshot" else None

    async def storage_info(self, snapshot_id: str) -> dict[str, object] | None:
        """Our extension to E2B's snapshot info: durable (in the store) or not, cached here, size."""
        return await self.durable.info(snapshot_id) if self.durable is not None else None

    async def rows(self, kind: SnapshotKind | None = None, source: str | None = None) -> list[SnapshotRow]:
        return await self.store.rows(kind=kind, source=source)

    # -- removing ----------------------------------------------------------------------------

    async def delete(self, snapshot_id: str) -> None:
        """The store's copy first (an unreachable store fails the delete), then this node's."""
        if self.durable is not None:
            await self.durable.delete(snapshot_id)
        await self.store.delete(snapshot_id)
        for listener in self._deleted:
            listener()

    async def sweep(self, paused: dict[str, str]) -> list[str]:
        """At start-up: drop uncommitted snapshot dirs, pause snapshots no paused sandbox owns
        (``paused``: sandbox id -> its pause snapshot) and every fork snapshot (one never
        outlives its request: one left behind was cut short by a crash, and recovery has
        already revived its parent from it)."""
        evicted = await self.durable.evicted() if self.durable is not None else set()
        removed = await self.store.sweep_incomplete(keep_without_dir=evicted)
        for row in await self.store.rows(kind="pause", mine=True):  # others' are on their disks
            if paused.get(row.source_sandbox_id) != row.snapshot_id:
                await self.delete(row.snapshot_id)
                removed.append(row.snapshot_id)
        for row in await self.store.rows(kind="fork", mine=True):
            await self.delete(row.snapshot_id)
            removed.append(row.snapshot_id)
        if self.durable is not None:
            await self.durable.recover()
        return removed

    async def collect_garbage(self) -> None:
        """Have every runtime free the disk layers no snapshot and no sandbox uses any more, and
        free the dropped template roots nothing stands on. Called by the one
        :class:`~forkyard.orchestrator.garbage.GarbageCollector`, never by hand."""
        async with self._gc_lock:
            for runtime in self._runtimes:

                async def live(name: str = runtime.name) -> list[SnapshotRef]:
                    return [self.store.ref(r) for r in await self.rows() if r.runtime == name]

                try:
                    await runtime.collect_garbage(live)
                except Exception:
                    # Collection is retried after the next kill, delete or resume; a failure here
                    # must not fail the operation that triggered it.
                    log.exception("%s: collecting unused disk layers failed", runtime.name)
            if self._templates_dir is not None:
                try:
                    named = await self.template_roots_in_use()
                    freed = await asyncio.to_thread(
                        template_storage.collect_dropped, self._templates_dir, named
                    )
                    if freed:
                        log.info("freed dropped template roots %s", ", ".join(freed))
                except Exception:
                    log.exception("collecting dropped template roots failed")

    async def template_roots_in_use(self) -> set[str]:
        """The template roots every sandbox not killed (any node's) and every snapshot record
        standing on (a resume, restore or fork mounts it again)."""

        def sandbox_roots(conn: Any) -> set[str]:
            stmt = select(sandboxes.c.instance).where(sandboxes.c.state != str(SandboxState.KILLED))
            found = set()
            for (raw,) in conn.execute(stmt):
                root = SandboxInstance.from_json(json.loads(raw)).template_rootfs if raw else None
                if root:
                    found.add(root)
            return found

        named: set[str] = await self.store.db.read(sandbox_roots)
        for row in await self.rows():
            root = row.info.get("template_rootfs")
            # A template snapshot serves creates of its build only: of a dropped build (one made
            # in the background as the build was dropped, say), it is never restored again.
            if root and not (row.kind == "template" and template_storage.is_dropped_root(Path(root))):
                named.add(str(root))
        return named
