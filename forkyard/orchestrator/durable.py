"""Durable snapshots: the snapshot catalog's side of the snapshot store (``FORKYARD_S3__*``).

* A committed user or template snapshot is usable on its node at once; it is uploaded in the
  background (:class:`~forkyard.orchestrator.background.Background`, two at a time) and marked
  ``durable`` once the store holds its manifest (``snapshot_copies``, shown in our API listing).
* Every restore goes through :meth:`DurableSnapshots.use`: it pins the snapshot's local copy and
  fetches what this node lacks first (the memory image whole, each missing disk layer by its
  chunks, the template root file system if the node has no such build).
* ``POST /sandboxes`` naming a snapshot this node never had finds its manifest in the store and
  adopts it (a database row, no local copy yet): the cross-node case.
* Past ``cache_max_mib`` the least recently used durable, unpinned copies are evicted, and the
  runtimes' layer collection frees the layers nothing else stands on (a running or paused
  sandbox's layers are named by the sandbox itself, so they are never freed).
* Deleting a snapshot deletes it from the store too (its chunks go when no manifest names them).

Without a store configured the rows are kept (state ``local``) and nothing is uploaded or evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from forkyard.config import S3Settings
from forkyard.errors import Gone, Unavailable
from forkyard.orchestrator.background import Background
from forkyard.storage import snapshots as storage
from forkyard.storage.atomic import fsync_path, write_json_atomic
from forkyard.storage.db import Database
from forkyard.storage.layers import tree_bytes
from forkyard.storage.objectstore import (
    Manifest,
    SnapshotObjects,
    StoreUnavailable,
    TemplateRef,
    UploadReport,
    template_build,
)
from forkyard.storage.objectstore_cache import CopyRow, SnapshotCopies
from forkyard.storage.snapshots import SnapshotRow, SnapshotStore

log = logging.getLogger(__name__)

#: Kinds that go to the store; pause and fork snapshots are private to their node and short-lived.
STORED_KINDS = frozenset({"snapshot", "template"})
SNAPSHOT_ID = re.compile(r"snap[0-9a-f]{16}\Z")
#: The gVisor runtime's layer store (``RootDisks``) and a snapshot's meta naming its chain.
LAYERS_DIR = "disk-layers"
META_FILE = "meta.json"
#: Concurrent uploads: each hashes and compresses on the CPU (two cores here).
UPLOAD_SLOTS = 2
#: An upload the store refused (out of reach) is tried again after this, doubling up to the max (s).
UPLOAD_RETRY_FIRST_S = 1.0
UPLOAD_RETRY_MAX_S = 30.0


def row_json(row: SnapshotRow) -> dict[str, Any]:
    return {
        "snapshot_id": row.snapshot_id,
        "kind": row.kind,
        "source_sandbox_id": row.source_sandbox_id,
        "runtime": row.runtime,
        "template_id": row.template_id,
        "created_at": row.created_at.timestamp(),
        "parent_id": row.parent_id,
        "name": row.name,
        "info": row.info,
    }


def _row_of(doc: dict[str, Any], info: dict[str, Any]) -> SnapshotRow:
    import datetime as dt

    return SnapshotRow(
        snapshot_id=str(doc["snapshot_id"]),
        kind=doc["kind"],
        source_sandbox_id=str(doc["source_sandbox_id"]),
        runtime=str(doc["runtime"]),
        template_id=str(doc["template_id"]),
        created_at=dt.datetime.fromtimestamp(float(doc["created_at"]), dt.UTC),
        parent_id=doc.get("parent_id"),
        name=doc.get("name"),
        info=info,
    )


def meta_layers(snapshot_dir: Path) -> list[str]:
    """The disk layers (newest first) a snapshot's meta names; [] when it names none."""
    try:
        meta = json.loads((snapshot_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [str(x) for x in meta.get("layers") or []] if isinstance(meta, dict) else []


class DurableSnapshots:
    def __init__(
        self,
        data_dir: Path,
        settings: S3Settings,
        *,
        templates_dir: Path,
        objects: SnapshotObjects | None,
        background: Background,
    ) -> None:
        self.data_dir = data_dir
        self.settings = settings
        self.templates_dir = templates_dir
        self.objects = objects
        self.background = background
        self.layers_dir = data_dir / LAYERS_DIR
        #: Template root file systems fetched from the store (a build this node never had).
        self.fetched_templates = data_dir / "store-templates"
        self.tmp_dir = data_dir / ".store-tmp"
        #: The runtimes' layer collection, set by the catalog.
        self.collect: Callable[[], Awaitable[None]] | None = None
        self._copies: SnapshotCopies | None = None
        self._store: SnapshotStore | None = None
        self._uploads: dict[str, asyncio.Task[None]] = {}
        self._upload_slots = asyncio.Semaphore(UPLOAD_SLOTS)
        self._locks: dict[str, asyncio.Lock] = {}
        self._cap_lock = asyncio.Lock()

    @property
    def copies(self) -> SnapshotCopies:
        if self._copies is None:
            raise RuntimeError("the snapshot catalog is not open")
        return self._copies

    @property
    def store(self) -> SnapshotStore:
        if self._store is None:
            raise RuntimeError("the snapshot catalog is not open")
        return self._store

    async def open(self, db: Database, store: SnapshotStore) -> None:
        self._copies = SnapshotCopies(db)
        self._store = store
        await self._copies.open()

    def _lock(self, snapshot_id: str) -> asyncio.Lock:
        return self._locks.setdefault(snapshot_id, asyncio.Lock())

    # -- start-up --------------------------------------------------------------------------------

    async def evicted(self) -> set[str]:
        """Snapshots whose local copy may be missing: durable ones (the sweep keeps their rows)."""
        return {c.snapshot_id for c in await self.copies.all() if c.durable}

    async def recover(self) -> None:
        """After the start-up sweep: forget copies of vanished rows, note evicted ones, resume
        uploads a restart cut short, and sweep the store of what crashed uploads left."""
        await asyncio.to_thread(shutil.rmtree, self.tmp_dir, True)
        known = {c.snapshot_id: c for c in await self.copies.all()}
        for row in await self.store.rows(mine=True):  # other nodes' uploads are theirs
            if row.kind not in STORED_KINDS:
                continue
            copy = known.pop(row.snapshot_id, None)
            if copy is None:  # taken before the store was configured, or by an older forkyard
                await self.committed(row)
                continue
            present = storage.final_path(self.data_dir, row.snapshot_id).is_dir()
            if copy.cached != present:
                await self.copies.update(row.snapshot_id, cached=int(present))
            if self.objects is not None and not copy.durable:
                self._start_upload(row)
        for gone in known:
            await self.copies.remove(gone)
        if self.objects is not None:
            self.background.spawn(self._collect_store(), name="snapshot-store-collect")
        self.background.spawn(self.enforce_cap(), name="snapshot-cache-cap")

    async def _collect_store(self) -> None:
        assert self.objects is not None
        try:
            removed = await asyncio.to_thread(
                self.objects.collect, grace_seconds=max(self.settings.gc_grace_seconds, 3600.0)
            )
        except StoreUnavailable as exc:
            log.warning("sweeping the snapshot store failed: %s", exc)
            return
        if removed:
            log.info("snapshot store: swept %d unnamed objects", len(removed))

    # -- uploading --------------------------------------------------------------------------------

    async def committed(self, row: SnapshotRow) -> None:
        """A snapshot was committed on this node: record its copy and upload it."""
        if row.kind not in STORED_KINDS:
            return
        size = await asyncio.to_thread(tree_bytes, storage.final_path(self.data_dir, row.snapshot_id))
        await self.copies.put(CopyRow(row.snapshot_id, "local", True, size, time.time()))
        if self.objects is not None:
            self._start_upload(row)

    def _start_upload(self, row: SnapshotRow) -> None:
        sid = row.snapshot_id
        task = self.background.spawn(self._upload(row), name=f"upload-{sid}")
        self._uploads[sid] = task
        task.add_done_callback(lambda _t: self._uploads.pop(sid, None))

    async def _upload(self, row: SnapshotRow) -> None:
        """Upload ``row``; while the store is out of reach, again after a pause that doubles up
        to ``UPLOAD_RETRY_MAX_S`` (the snapshot stays queued, ``failed`` with the reason, until
        the store is back or the snapshot is deleted). Other failures are final."""
        sid = row.snapshot_id
        pause = UPLOAD_RETRY_FIRST_S
        while True:
            async with self._upload_slots:
                if await self.copies.get(sid) is None:
                    return  # deleted while it waited
                await self.copies.update(sid, state="uploading", error=None)
                try:
                    report = await asyncio.to_thread(self._upload_sync, row)
                    break
                except StoreUnavailable as exc:
                    log.warning("uploading snapshot %s failed, again in %.0f s: %s", sid, pause, exc)
                    await self.copies.update(sid, state="failed", error=str(exc)[:500])
                except Exception as exc:
                    log.warning("uploading snapshot %s failed: %s", sid, exc)
                    await self.copies.update(sid, state="failed", error=str(exc)[:500])
                    return
            await asyncio.sleep(pause)  # its slot free for others meanwhile
            pause = min(pause * 2, UPLOAD_RETRY_MAX_S)
        await self.copies.update(
            sid, state="durable", uploaded_at=time.time(), upload_ms=round(report.seconds * 1000)
        )
        log.info(
            "snapshot %s is durable: %d chunks sent (%d bytes), %d reused, layers new %s reused %s, %.0f ms",
            sid,
            report.sent_chunks,
            report.sent_bytes,
            report.reused_chunks,
            report.new_layers,
            report.reused_layers,
            report.seconds * 1000,
        )
        await self.enforce_cap()

    def _upload_sync(self, row: SnapshotRow) -> UploadReport:
        assert self.objects is not None
        path = storage.final_path(self.data_dir, row.snapshot_id)
        template, rootfs = self._template_of(row)
        return self.objects.upload(
            path,
            row_json(row),
            layers=meta_layers(path),
            layer_path=lambda lid: self.layers_dir / lid,
            template=template,
            template_rootfs=rootfs,
            name=row.name if row.kind == "snapshot" else None,
        )

    def _template_of(self, row: SnapshotRow) -> tuple[TemplateRef | None, Path | None]:
        """The template build the snapshot stands on (its ``template.json`` beside the rootfs)."""
        recorded = row.info.get("template_rootfs")
        if not recorded:
            return None, None
        rootfs = Path(str(recorded))
        try:
            meta = (rootfs.parent / "template.json").read_bytes()
        except OSError:
            return None, None
        build = template_build(meta)
        # The build's own record names its template: the directory is a build id since builds
        # are kept (templates/<id>/builds/<build>/rootfs), the template's id before that.
        try:
            template_id = str(json.loads(meta).get("template_id") or rootfs.parent.name)
        except (ValueError, AttributeError):
            template_id = rootfs.parent.name
        key = f"templates/{template_id}-{build}.json" if self.settings.upload_templates else None
        return TemplateRef(template_id, build, key), rootfs

    # -- adopting and fetching -----------------------------------------------------------------

    async def adopt(self, name_or_id: str) -> SnapshotRow | None:
        """The user snapshot ``name_or_id`` from the store, when this node has no row of it: its
        row is added (no local copy yet; :meth:`use` fetches it). None when the store has none."""
        if self.objects is None:
            return None
        key = name_or_id.split("/")[-1].split(":")[0]
        # Creates from a template must not pay a store round trip: only snapshot ids and names
        # that are no local template are looked up.
        if not SNAPSHOT_ID.match(key) and (self.templates_dir / key).exists():
            return None
        try:
            manifest = await asyncio.to_thread(self.objects.find, key)
        except StoreUnavailable as exc:
            log.warning("looking up %s in the snapshot store failed: %s", key, exc)
            return None
        if manifest is None or manifest.row.get("kind") != "snapshot":
            return None
        async with self._lock(manifest.snapshot_id):
            existing = await self.store.get(manifest.snapshot_id)
            if existing is not None:
                return existing
            info = dict(manifest.row.get("info") or {})
            info["template_rootfs"] = await asyncio.to_thread(self._local_template, manifest)
            row = _row_of(manifest.row, info)
            await self.copies.put(
                CopyRow(row.snapshot_id, "durable", False, 0, time.time(), uploaded_at=manifest.uploaded_at)
            )
            await self.store.add(row)
        log.info("adopted snapshot %s from the snapshot store", row.snapshot_id)
        return row

    def _local_template(self, manifest: Manifest) -> str | None:
        """Where this node has (or will fetch) the template build the snapshot stands on."""
        recorded = manifest.row.get("info", {}).get("template_rootfs")
        ref = manifest.template

        def matches(rootfs: Path) -> bool:
            if not rootfs.is_dir():
                return False
            if ref is None:
                return True
            try:
                return template_build((rootfs.parent / "template.json").read_bytes()) == ref.build
            except OSError:
                return False

        if recorded and matches(Path(recorded)):
            return str(recorded)
        if ref is not None:
            local = self.templates_dir / ref.template_id / "rootfs"
            if matches(local):
                return str(local)
            if ref.key:
                return str(self.fetched_templates / f"{ref.template_id}-{ref.build}" / "rootfs")
        return str(recorded) if recorded else None

    @contextlib.asynccontextmanager
    async def use(self, row: SnapshotRow) -> AsyncIterator[None]:
        """Hold the snapshot's local copy for a restore: pinned (never evicted meanwhile) and
        complete (what is missing fetched from the store first)."""
        if self.objects is None or self._copies is None or row.kind not in STORED_KINDS:
            yield  # node-local only: nothing is ever evicted or fetched
            return
        sid = row.snapshot_id
        self.copies.pin(sid)
        fetched = False
        try:
            async with self._lock(sid):
                fetched = await self._ensure_local(row)
            await self.copies.touch(sid)
            yield
        finally:
            self.copies.unpin(sid)
            if fetched:  # the cache grew while the copy was pinned: bring it back under its cap
                self.background.spawn(self.enforce_cap(), name="snapshot-cache-cap")

    def _missing(self, row: SnapshotRow) -> bool:
        path = storage.final_path(self.data_dir, row.snapshot_id)
        if not path.is_dir():
            return True
        if any(not (self.layers_dir / lid).is_dir() for lid in meta_layers(path)):
            return True
        rootfs = row.info.get("template_rootfs")
        return bool(rootfs) and not Path(str(rootfs)).is_dir()

    async def _ensure_local(self, row: SnapshotRow) -> bool:
        """Fetch what this node lacks of the snapshot; whether anything was fetched."""
        if self.objects is None or not await asyncio.to_thread(self._missing, row):
            return False
        sid = row.snapshot_id
        try:
            manifest = await asyncio.to_thread(self.objects.manifest, sid)
        except StoreUnavailable as exc:
            raise Unavailable(f"snapshot {sid} is not on this node and {exc.message}") from exc
        if manifest is None:
            raise Gone(f"snapshot {sid} is neither on this node nor in {self.objects.backend.location}")
        if row.node_id not in ("", self.copies.db.node_id):  # taken on another node of a shared database
            rootfs = await asyncio.to_thread(self._local_template, manifest)
            row = dataclasses.replace(row, info={**row.info, "template_rootfs": rootfs})
        started = time.monotonic()
        fetched = await asyncio.to_thread(self._fetch_sync, row, manifest)
        size = await asyncio.to_thread(tree_bytes, storage.final_path(self.data_dir, sid))
        if await self.copies.get(sid) is None:  # another node's snapshot (a shared database)
            await self.copies.put(
                CopyRow(sid, "durable", True, size, time.time(), uploaded_at=manifest.uploaded_at)
            )
        else:
            await self.copies.update(sid, cached=1, bytes=size)
        log.info(
            "fetched snapshot %s from the snapshot store: %d bytes in %.0f ms",
            sid,
            fetched,
            (time.monotonic() - started) * 1000,
        )
        return True

    def _fetch_sync(self, row: SnapshotRow, manifest: Manifest) -> int:
        """Memory image and meta first (committed by rename: the meta then names the layers, so a
        layer collection keeps them), then the missing layers, then the template."""
        assert self.objects is not None
        fetched = 0
        final = storage.final_path(self.data_dir, row.snapshot_id)
        if not final.is_dir():
            temp = storage.temp_ref(self.data_dir, row.snapshot_id)
            try:
                fetched += self.objects.fetch(manifest, temp.path).fetched_bytes
                self._localise_meta(temp.path, row)
                storage.commit_dir(self.data_dir, temp)
            except BaseException:
                shutil.rmtree(temp.path, ignore_errors=True)
                raise
        objects = self.objects
        for layer_id in manifest.layers:
            if not (self.layers_dir / layer_id).is_dir():
                fetched += self._fetch_into(
                    self.layers_dir / layer_id, partial(objects.fetch_layer, layer_id)
                )
        rootfs = row.info.get("template_rootfs")
        ref = manifest.template
        if rootfs and not Path(str(rootfs)).is_dir():
            if ref is None or ref.key is None:
                raise Gone(f"snapshot {row.snapshot_id} stands on template {rootfs}, which this node lacks")
            fetched += self._fetch_into(Path(str(rootfs)), lambda dest: objects.fetch_template(ref, dest))
        return fetched

    def _fetch_into(self, final: Path, fetch: Callable[[Path], int]) -> int:
        """Fetch a tree into a temp directory on the same file system, then rename it into place
        (a reader never sees half a layer)."""
        tmp = self.tmp_dir / f"{final.name}-{secrets.token_hex(6)}"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            fetched = fetch(tmp)
            os.sync()  # the tree's files (tar does not fsync) before its name appears
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_path(final.parent)
        return fetched

    @staticmethod
    def _localise_meta(path: Path, row: SnapshotRow) -> None:
        """Point the runtime's meta at this node's template root file system."""
        meta_path = path / META_FILE
        rootfs = row.info.get("template_rootfs")
        if not rootfs or not meta_path.is_file():
            return
        meta = json.loads(meta_path.read_text())
        if isinstance(meta, dict) and "template_rootfs" in meta and meta["template_rootfs"] != rootfs:
            meta["template_rootfs"] = rootfs
            write_json_atomic(meta_path, meta, indent=2)

    # -- the cache cap ----------------------------------------------------------------------------

    def _local_bytes(self) -> int:
        return tree_bytes(storage.snapshots_dir(self.data_dir)) + tree_bytes(self.layers_dir)

    async def enforce_cap(self) -> list[str]:
        """Evict least recently used durable copies until this node's snapshots and layers fit
        ``cache_max_mib``; returns the evicted snapshot ids."""
        cap = self.settings.cache_max_mib << 20
        evicted: list[str] = []
        if self.objects is None or cap <= 0:
            return evicted
        async with self._cap_lock:
            while True:
                over = await asyncio.to_thread(self._local_bytes) - cap
                if over <= 0:
                    return evicted
                victims = self.copies.victims(await self.copies.all(), over)
                if not victims or not await self._evict(victims[0]):
                    log.warning("snapshot cache is %d bytes over its cap; nothing more can be evicted", over)
                    return evicted
                evicted.append(victims[0].snapshot_id)
                if self.collect is not None:
                    await self.collect()

    async def _evict(self, copy: CopyRow) -> bool:
        async with self._lock(copy.snapshot_id):
            if self.copies.pinned(copy.snapshot_id):
                return False
            await self.copies.update(copy.snapshot_id, cached=0)
            await asyncio.to_thread(storage.remove_dir, storage.final_path(self.data_dir, copy.snapshot_id))
        log.info("evicted the local copy of durable snapshot %s (%d bytes)", copy.snapshot_id, copy.bytes)
        return True

    # -- deleting ---------------------------------------------------------------------------------

    async def delete(self, snapshot_id: str) -> None:
        """Before the row goes: wait for its upload, then delete it from the store. The store
        being unreachable fails the delete (the snapshot stays, everywhere)."""
        if self._copies is None or await self.copies.get(snapshot_id) is None:
            return
        task = self._uploads.get(snapshot_id)
        if task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(task)
        if self.objects is not None:
            removed = await asyncio.to_thread(
                self.objects.delete, snapshot_id, grace_seconds=self.settings.gc_grace_seconds
            )
            log.info("deleted snapshot %s from the snapshot store (%d objects)", snapshot_id, len(removed))
        await self.copies.remove(snapshot_id)

    async def info(self, snapshot_id: str) -> dict[str, object] | None:
        copy = await self.copies.get(snapshot_id) if self._copies is not None else None
        return copy.json() if copy else None
