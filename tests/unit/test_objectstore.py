"""The snapshot store against a real S3-protocol server (moto's server mode, a process started
here) and the directory backend: chunking and holes, dedupe between a parent and a child,
upload and fetch, disk layers with overlayfs markers, deletes that free unshared chunks, the
local cache's LRU eviction under a small cap (never a pinned copy), adoption by a second node.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import secrets
import stat
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from forkyard.config import S3Settings
from forkyard.errors import Invalid
from forkyard.orchestrator.background import Background
from forkyard.orchestrator.catalog import SnapshotCatalog
from forkyard.orchestrator.durable import DurableSnapshots
from forkyard.storage import snapshots as storage
from forkyard.storage.db import Database, open_database_at
from forkyard.storage.objectstore import (
    DirectoryBackend,
    Manifest,
    S3Backend,
    SnapshotObjects,
    UploadReport,
)
from forkyard.storage.snapshots import SnapshotRow
from tests.support.postgres import BACKENDS, PostgresCluster
from tests.support.s3 import S3Server, s3_server

ASYNC = pytest.mark.asyncio(loop_scope="session")

CHUNK = 64 << 10  # small chunks: the tests' files span several


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def snap_id() -> str:
    return "snap" + secrets.token_hex(8)


def layer_id() -> str:
    return "l" + secrets.token_hex(8)


def s3_objects(s3: S3Server, bucket: str) -> SnapshotObjects:
    return SnapshotObjects(S3Backend(s3.settings(bucket)), chunk_bytes=CHUNK, concurrency=4)


def write_snapshot(data_dir: Path, sid: str, memory: bytes, layers: list[str]) -> Path:
    """A committed snapshot directory shaped like the gVisor runtime's: memory image + meta."""
    path = storage.final_path(data_dir, sid)
    (path / "memory").mkdir(parents=True)
    (path / "memory" / "pages.img").write_bytes(memory)
    (path / "meta.json").write_text(f'{{"format": 2, "layers": {layers!r}}}'.replace("'", '"'))
    return path


def write_layer(data_dir: Path, lid: str, files: dict[str, bytes]) -> Path:
    root = data_dir / "disk-layers" / lid
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, Any]:
    """Everything a layer is made of: type, mode, owner, size, content, device, xattrs."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            xattrs = {
                x: os.getxattr(p, x, follow_symlinks=False) for x in os.listxattr(p, follow_symlinks=False)
            }
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_rdev, data, xattrs)
    return out


def row_of(sid: str, name: str | None = None, kind: str = "snapshot") -> SnapshotRow:
    return SnapshotRow(
        snapshot_id=sid,
        kind=kind,  # type: ignore[arg-type]
        source_sandbox_id="sbx1",
        runtime="gvisor",
        template_id="base",
        created_at=dt.datetime.now(dt.UTC),
        name=name,
        info={},
    )


# -- the store itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["s3", "directory"])
def test_upload_and_fetch_round_trip_keeps_holes_out(s3: S3Server, tmp_path: Path, backend: str) -> None:
    if backend == "s3":
        bucket = s3.new_bucket()
        objects = s3_objects(s3, bucket)
    else:
        objects = SnapshotObjects(DirectoryBackend(tmp_path / "store"), chunk_bytes=CHUNK)
    sid = snap_id()
    # 3 chunks of data, 4 of zeros (a hole), half a chunk of data at the end.
    memory = os.urandom(3 * CHUNK) + bytes(4 * CHUNK) + os.urandom(CHUNK // 2)
    lid = layer_id()
    write_layer(tmp_path, lid, {"etc/hello": b"hello", "big": os.urandom(2 * CHUNK + 5)})
    src = write_snapshot(tmp_path, sid, memory, [lid])
    report = objects.upload(
        src,
        row_of(sid).__dict__ | {"created_at": 0},
        layers=[lid],
        layer_path=lambda x: tmp_path / "disk-layers" / x,
    )
    assert report.new_layers == [lid] and report.reused_layers == []
    pages = next(f for f in report.manifest.files if f.path == "memory/pages.img")
    assert [h is None for h, _ in pages.chunks] == [False] * 3 + [True] * 4 + [False]
    chunk_keys = list(objects.backend.list("chunks/"))
    assert len(chunk_keys) == report.sent_chunks and report.sent_chunks >= 4  # the hole is not stored

    manifest = objects.manifest(sid)
    assert manifest is not None and manifest.layers == [lid]
    dest = tmp_path / "fetched"
    fetched = objects.fetch(manifest, dest)
    assert (dest / "memory" / "pages.img").read_bytes() == memory
    assert (dest / "meta.json").read_bytes() == (src / "meta.json").read_bytes()
    # The hole came back as a hole, not as written zeros.
    assert os.stat(dest / "memory" / "pages.img").st_blocks * 512 < len(memory) - 3 * CHUNK
    # Only what is not a hole travelled (and was checked against its hash on the way).
    assert fetched.fetched_bytes == len(memory) - 4 * CHUNK + (src / "meta.json").stat().st_size
    layer_dest = tmp_path / "layer-fetched"
    objects.fetch_layer(lid, layer_dest)
    assert tree(layer_dest) == tree(tmp_path / "disk-layers" / lid)


@pytest.mark.requires_root("overlayfs whiteouts are 0:0 character devices and trusted.* xattrs")
def test_layer_keeps_overlay_markers_owners_and_modes(s3: S3Server, tmp_path: Path) -> None:
    objects = s3_objects(s3, s3.new_bucket())
    lid = layer_id()
    root = write_layer(tmp_path, lid, {"home/user/file": b"data", "etc/conf": b"x" * 1000})
    os.mknod(root / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    os.mkdir(root / "opaque")
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")
    os.chown(root / "home" / "user" / "file", 1000, 1000)
    os.chmod(root / "etc" / "conf", 0o4755)
    os.symlink("/etc/conf", root / "link")
    assert objects.upload_layer(lid, root, _report(objects))
    assert not objects.upload_layer(lid, root, _report(objects))  # stored once, by id
    dest = tmp_path / "fetched"
    objects.fetch_layer(lid, dest)
    assert tree(dest) == tree(root)
    assert stat.S_ISCHR(os.lstat(dest / "gone").st_mode) and os.lstat(dest / "gone").st_rdev == 0


def _report(objects: SnapshotObjects) -> Any:
    from forkyard.storage.objectstore import Manifest, UploadReport

    return UploadReport(Manifest("x", {}, [], [], None))


def test_child_shares_parent_chunks_and_layers_and_delete_frees_only_unshared(
    s3: S3Server, tmp_path: Path
) -> None:
    bucket = s3.new_bucket()
    objects = s3_objects(s3, bucket)
    layers = tmp_path / "disk-layers"
    base_layer, child_layer = layer_id(), layer_id()
    write_layer(tmp_path, base_layer, {"a": os.urandom(3 * CHUNK)})
    write_layer(tmp_path, child_layer, {"b": os.urandom(CHUNK // 3)})
    parent_mem = os.urandom(6 * CHUNK)
    child_mem = parent_mem[: 5 * CHUNK] + os.urandom(CHUNK)  # the last chunk differs
    parent, child = snap_id(), snap_id()
    p_dir = write_snapshot(tmp_path, parent, parent_mem, [base_layer])
    c_dir = write_snapshot(tmp_path, child, child_mem, [child_layer, base_layer])

    def upload(sid: str, path: Path, chain: list[str]) -> Any:
        row = row_of(sid).__dict__ | {"created_at": 0}
        return objects.upload(path, row, layers=chain, layer_path=lambda x: layers / x)

    p_report = upload(parent, p_dir, [base_layer])
    c_report = upload(child, c_dir, [child_layer, base_layer])
    assert c_report.reused_layers == [base_layer] and c_report.new_layers == [child_layer]
    # Five memory chunks are the parent's: only the changed one, meta and the new layer are sent.
    assert c_report.reused_chunks >= 5
    assert c_report.sent_bytes < p_report.sent_bytes / 2
    before = set(s3.keys(bucket))

    # Deleting the child frees its own chunks and layer, never the parent's.
    removed = objects.delete(child, grace_seconds=0)
    after = set(s3.keys(bucket))
    assert after == before - {"forkyard/" + k for k in removed}
    assert (
        f"forkyard/layers/{child_layer}.json" not in after and f"forkyard/layers/{base_layer}.json" in after
    )
    assert f"forkyard/snapshots/{child}.json" not in after
    assert len([k for k in removed if k.startswith("chunks/")]) >= 2  # the changed memory chunk, layer b
    manifest = objects.manifest(parent)
    assert manifest is not None
    objects.fetch(manifest, tmp_path / "p")
    assert (tmp_path / "p" / "memory" / "pages.img").read_bytes() == parent_mem
    objects.fetch_layer(base_layer, tmp_path / "pl")

    # The last snapshot gone, nothing is left of either.
    objects.delete(parent, grace_seconds=0)
    assert s3.keys(bucket) == []


def test_sweep_spares_young_unnamed_chunks(s3: S3Server, tmp_path: Path) -> None:
    """An upload elsewhere may be about to name a chunk: unnamed chunks younger than the grace
    period survive a collection; older ones go."""
    objects = s3_objects(s3, s3.new_bucket())
    objects.backend.put("chunks/" + "0" * 64, b"orphan")
    assert objects.collect(grace_seconds=3600) == []
    assert objects.collect(grace_seconds=0) == ["chunks/" + "0" * 64]


class _HeldAges(DirectoryBackend):
    """A directory backend whose ``age`` look-ups wait for ``go``: holds a sweep between its
    first look at the manifests and its delete (where a slow LIST on S3 leaves it)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hold = threading.Event()
        self.go = threading.Event()
        self.held = threading.Event()

    def age(self, key: str) -> float | None:
        if self.hold.is_set():
            self.held.set()
            assert self.go.wait(30)
        return super().age(key)


def test_a_sweep_of_this_process_never_takes_what_an_upload_just_named(tmp_path: Path) -> None:
    """Snapshot b reuses a's memory chunk. a is deleted with no grace while b uploads: the sweep
    saw the manifests before b's existed, b's upload ends (its check after the manifest finds
    the chunk there), then the sweep deletes. It must look again: b restores whole."""
    backend = _HeldAges(tmp_path / "store")
    objects = SnapshotObjects(backend, chunk_bytes=CHUNK, concurrency=2)
    memory = os.urandom(CHUNK) * 2
    a, b = snap_id(), snap_id()
    for sid in (a, b):
        path = write_snapshot(tmp_path, sid, memory, [])
        objects.upload(path, row_of(sid).__dict__ | {"created_at": 0}, layers=[], layer_path=Path)
    objects.backend.delete([f"snapshots/{b}.json"])  # b is about to be uploaded again
    backend.hold.set()
    sweep = threading.Thread(target=objects.delete, args=(a,), kwargs={"grace_seconds": 0})
    sweep.start()
    assert backend.held.wait(30)
    backend.hold.clear()
    objects.upload(
        storage.final_path(tmp_path, b), row_of(b).__dict__ | {"created_at": 0}, layers=[], layer_path=Path
    )
    backend.go.set()
    sweep.join(30)
    manifest = objects.manifest(b)
    assert manifest is not None
    objects.fetch(manifest, tmp_path / "b")
    assert (tmp_path / "b" / "memory" / "pages.img").read_bytes() == memory


def test_a_reused_layer_kept_for_its_age_keeps_its_chunks(s3: S3Server, tmp_path: Path) -> None:
    """A snapshot on another node reuses layer L (its upload refreshes L's manifest, not L's
    chunks, which are old) while the last snapshot naming L is deleted: the young manifest is
    spared by the grace, and so must its chunks be."""
    bucket = s3.new_bucket()
    here, there = s3_objects(s3, bucket), s3_objects(s3, bucket)
    lid = layer_id()
    layers = tmp_path / "disk-layers"
    write_layer(tmp_path, lid, {"etc/data": os.urandom(3 * CHUNK)})
    a = snap_id()
    path = write_snapshot(tmp_path, a, os.urandom(CHUNK), [lid])
    here.upload(path, row_of(a).__dict__ | {"created_at": 0}, layers=[lid], layer_path=lambda x: layers / x)
    grace = 2.0
    # S3 dates are whole seconds and ages count from the end of that second: one more second
    # makes the layer's chunks older than the grace for sure.
    time.sleep(grace + 1.2)
    report = UploadReport(Manifest(snap_id(), {}, [], [lid], None))
    assert not there.upload_layer(lid, layers / lid, report)  # reused: its manifest refreshed
    chunk_ages = [here.backend.age(k) for k in here.backend.list("chunks/")]
    assert chunk_ages and all(age is not None and age >= grace for age in chunk_ages)
    here.delete(a, grace_seconds=grace)
    there.fetch_layer(lid, tmp_path / "fetched")
    fetched = (tmp_path / "fetched" / "etc" / "data").read_bytes()
    assert fetched == (layers / lid / "etc" / "data").read_bytes()


def test_bad_names_are_refused(tmp_path: Path) -> None:
    objects = SnapshotObjects(DirectoryBackend(tmp_path))
    with pytest.raises(Invalid):
        objects.manifest("../../etc/passwd")
    assert objects.find("../x") is None
    with pytest.raises(Invalid):
        SnapshotObjects(DirectoryBackend(tmp_path), chunk_bytes=10)


# -- the catalog on the store: cache cap, pins, adoption -------------------------------------------


class Node:
    """One node's snapshot catalog on its own data dir and registry, sharing ``bucket``."""

    def __init__(self, data_dir: Path, settings: S3Settings, database_url: str = "") -> None:
        self.data_dir = data_dir
        #: Empty: the node's own SQLite file; else a shared database (the node's id is its dir's name).
        self.database_url = database_url
        self.background = Background()
        objects = SnapshotObjects.from_settings(settings)
        assert objects is not None
        objects.chunk_bytes = CHUNK
        self.durable = DurableSnapshots(
            data_dir,
            settings,
            templates_dir=data_dir / "templates",
            objects=objects,
            background=self.background,
        )
        self.catalog = SnapshotCatalog(data_dir, durable=self.durable)
        self.db: Database | None = None

    async def open(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        url = self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'db.sqlite3'}"
        self.db = await open_database_at(url, self.data_dir.name, shared=bool(self.database_url))
        await self.catalog.open(self.db)
        await self.catalog.sweep({})

    async def commit(
        self, sid: str, memory: bytes, layers: dict[str, dict[str, bytes]], kind: str = "snapshot"
    ) -> SnapshotRow:
        for lid, files in layers.items():
            write_layer(self.data_dir, lid, files)
        write_snapshot(self.data_dir, sid, memory, list(layers))
        row = row_of(sid, name=f"name-{sid}", kind=kind)
        await self.catalog.store.add(row)
        await self.durable.committed(row)
        return row

    async def settle(self) -> None:
        await self.background.drain(60)

    async def close(self) -> None:
        await self.settle()
        assert self.db is not None
        await self.db.close()


@pytest.fixture(params=BACKENDS)
def registry_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest_asyncio.fixture(loop_scope="session")
async def node_factory(
    s3: S3Server, tmp_path: Path, request: pytest.FixtureRequest, registry_kind: str
) -> AsyncIterator[Any]:
    """Nodes sharing a bucket, each with its own registry (a SQLite file, or its own PostgreSQL
    database); ``shared=True``: all such nodes share one PostgreSQL registry, as a cluster's do."""
    nodes: list[Node] = []
    bucket = s3.new_bucket()
    shared_url = ""

    def registry(shared: bool) -> str:
        nonlocal shared_url
        if registry_kind == "sqlite" and not shared:
            return ""
        cluster: PostgresCluster = request.getfixturevalue("postgres")
        if not shared:
            return cluster.new_database()
        shared_url = shared_url or cluster.new_database()
        return shared_url

    async def make(name: str, shared: bool = False, **settings: Any) -> Node:
        node = Node(tmp_path / name, s3.settings(bucket, gc_grace_seconds=0, **settings), registry(shared))
        await node.open()
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        await node.close()


@ASYNC
async def test_eviction_under_a_small_cap_never_takes_a_pinned_or_undurable_copy(node_factory: Any) -> None:
    node = await node_factory("a", cache_max_mib=0)
    mib = 1 << 20
    rows = []
    for _ in range(3):  # three durable snapshots of 0.6 MiB each: a 1 MiB cap holds one
        rows.append(await node.commit(snap_id(), os.urandom(6 * mib // 10), {layer_id(): {"f": b"x"}}))
        await node.settle()
    pinned, lru, newest = rows
    for r in rows:
        info = await node.catalog.storage_info(r.snapshot_id)
        assert info is not None and info["durable"] and info["cached"]
    node.durable.settings = node.durable.settings.model_copy(update={"cache_max_mib": 1})
    pause = await node.commit(snap_id(), os.urandom(mib // 2), {}, kind="pause")  # never uploaded
    async with node.catalog.use(pinned) as ref:
        await node.durable.copies.touch(pinned.snapshot_id)
        await node.durable.copies.update(pinned.snapshot_id, last_used=0)  # the LRU one, but pinned
        evicted = await node.durable.enforce_cap()
        assert ref.path.is_dir(), "a pinned copy was evicted"
    assert set(evicted) == {lru.snapshot_id, newest.snapshot_id}
    assert storage.final_path(node.data_dir, pause.snapshot_id).is_dir()
    assert not storage.final_path(node.data_dir, lru.snapshot_id).exists()
    info = await node.catalog.storage_info(lru.snapshot_id)
    assert info is not None and info["durable"] and not info["cached"]
    # An evicted copy comes back from the store on its next use, byte for byte.
    async with node.catalog.use(lru) as ref:
        assert (ref.path / "memory" / "pages.img").stat().st_size == 6 * mib // 10
    info = await node.catalog.storage_info(lru.snapshot_id)
    assert info is not None and info["cached"]
    # The row of an evicted copy survives a restart's sweep (its directory is missing on purpose).
    await node.settle()
    evicted = await node.durable.enforce_cap()
    await node.catalog.sweep({})
    for sid in evicted:
        assert await node.catalog.get(sid) is not None


@ASYNC
async def test_second_node_adopts_and_fetches_a_snapshot_it_never_had(node_factory: Any) -> None:
    a = await node_factory("a")
    b = await node_factory("b")
    lid = layer_id()
    files = {"home/user/notes.txt": b"from node a", "blob": os.urandom(3 * CHUNK)}
    memory = os.urandom(5 * CHUNK)
    row = await a.commit(snap_id(), memory, {lid: files})
    await a.settle()
    assert await b.catalog.find_user_snapshot("no-such-snapshot") is None
    adopted = await b.catalog.find_user_snapshot(f"team/{row.name}:default")  # by name, as the SDK sends it
    assert adopted is not None and adopted.snapshot_id == row.snapshot_id
    info = await b.catalog.storage_info(row.snapshot_id)
    assert info is not None and info["durable"] and not info["cached"]
    async with b.catalog.use(adopted) as ref:
        assert (ref.path / "memory" / "pages.img").read_bytes() == memory
        assert tree(b.data_dir / "disk-layers" / lid) == tree(a.data_dir / "disk-layers" / lid)
    # Deleting it on b deletes it from the store: a third node finds nothing.
    await b.catalog.delete(row.snapshot_id)
    c = await node_factory("c")
    assert await c.catalog.find_user_snapshot(row.snapshot_id) is None
    await asyncio.sleep(0)


def make_template(templates_dir: Path, built_at: str) -> Path:
    """A template directory as ``forkyard template build`` leaves it (a tiny root file system)."""
    tdir = templates_dir / "base"
    (tdir / "rootfs" / "etc").mkdir(parents=True)
    (tdir / "rootfs" / "etc" / "os-release").write_text("ID=debian\n")
    (tdir / "rootfs" / "bin").mkdir()
    (tdir / "rootfs" / "bin" / "sh").write_bytes(os.urandom(3 * CHUNK))
    (tdir / "template.json").write_text(f'{{"template_id": "base", "created_at": "{built_at}"}}')
    return tdir / "rootfs"


@ASYNC
async def test_a_node_without_the_template_build_fetches_it_once_per_build(node_factory: Any) -> None:
    a = await node_factory("a", upload_templates=True)
    rootfs = make_template(a.data_dir / "templates", "2026-12-03T13:53:02")
    sid = snap_id()
    write_snapshot(a.data_dir, sid, os.urandom(CHUNK), [])
    meta = a.data_dir / "snapshots" / sid / "meta.json"
    meta.write_text(f'{{"format": 2, "layers": [], "template_rootfs": "{rootfs}"}}')
    row = row_of(sid, name="tpl")
    row.info["template_rootfs"] = str(rootfs)
    await a.catalog.store.add(row)
    await a.durable.committed(row)
    await a.settle()
    assert (await a.catalog.storage_info(sid) or {})["durable"]

    # Other nodes are other machines: a's template directory is not there for them.
    original = rootfs.parent.parent.rename(a.data_dir / "templates-elsewhere") / "base" / "rootfs"

    # b has no template at all: the build comes from the store, and the meta points at it.
    b = await node_factory("b")
    adopted = await b.catalog.find_user_snapshot(sid)
    assert adopted is not None
    fetched_rootfs = Path(adopted.info["template_rootfs"])
    assert fetched_rootfs.is_relative_to(b.data_dir / "store-templates")
    async with b.catalog.use(adopted) as ref:
        assert tree(fetched_rootfs) == tree(original)
        assert f'"template_rootfs": "{fetched_rootfs}"' in (ref.path / "meta.json").read_text()

    # c has the same build in its own templates directory: that one is used, nothing fetched.
    c = await node_factory("c")
    local = make_template(c.data_dir / "templates", "2026-12-03T13:53:02")
    adopted = await c.catalog.find_user_snapshot(sid)
    assert adopted is not None and adopted.info["template_rootfs"] == str(local)
    async with c.catalog.use(adopted):
        assert not (c.data_dir / "store-templates").exists()

    # d has another build of "base": the snapshot's own build is fetched beside it.
    d = await node_factory("d")
    make_template(d.data_dir / "templates", "2027-01-01T00:00:00")
    adopted = await d.catalog.find_user_snapshot(sid)
    assert adopted is not None
    assert Path(adopted.info["template_rootfs"]).is_relative_to(d.data_dir / "store-templates")


@ASYNC
async def test_an_unreachable_store_leaves_the_snapshot_usable_here_and_refuses_its_delete(
    tmp_path: Path,
) -> None:
    from forkyard.errors import Unavailable
    from tests.support import free_port

    closed = S3Settings(
        bucket="nowhere",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        access_key_id="x",
        secret_access_key="y",
    )
    node = Node(tmp_path / "a", closed)
    await node.open()
    try:
        sid = snap_id()
        row = await node.commit(sid, os.urandom(CHUNK), {})
        await node.settle()
        info = await node.catalog.storage_info(sid)
        assert info is not None and info["state"] == "failed" and not info["durable"]
        assert "snapshot store s3://nowhere/" in str(info["error"])
        async with node.catalog.use(row) as ref:  # the local copy needs nothing from the store
            assert (ref.path / "memory" / "pages.img").is_file()
        with pytest.raises(Unavailable):
            await node.catalog.delete(sid)
        assert await node.catalog.get(sid) is not None
        # A typo'd snapshot id is not found, whatever the store says.
        assert await node.catalog.find_user_snapshot(snap_id()) is None
    finally:
        await node.close()


@ASYNC
@pytest.mark.parametrize("registry_kind", ["postgresql"], indirect=True)
async def test_nodes_sharing_a_registry_restore_each_others_snapshots_with_copies_of_their_own(
    node_factory: Any,
) -> None:
    """A cluster: one registry row per snapshot, one copy row per node that holds it."""
    a = await node_factory("a", shared=True)
    b = await node_factory("b", shared=True)
    lid = layer_id()
    memory = os.urandom(3 * CHUNK)
    row = await a.commit(snap_id(), memory, {lid: {"f": b"from a"}})
    await a.settle()
    found = await b.catalog.find_user_snapshot(row.snapshot_id)
    assert found is not None and found.snapshot_id == row.snapshot_id
    assert await b.catalog.storage_info(row.snapshot_id) is None  # no copy on b yet
    async with b.catalog.use(found) as ref:
        assert (ref.path / "memory" / "pages.img").read_bytes() == memory
    info_b = await b.catalog.storage_info(row.snapshot_id)
    info_a = await a.catalog.storage_info(row.snapshot_id)
    assert info_b is not None and info_b["durable"] and info_b["cached"]
    assert info_a is not None and info_a["durable"] and info_a["cached"]
    # A restart of b sweeps nothing of a's: the row stays, and so does b's copy.
    await b.catalog.sweep({})
    assert await a.catalog.get(row.snapshot_id) is not None
    assert (b.data_dir / "snapshots" / row.snapshot_id).is_dir()


@ASYNC
@pytest.mark.parametrize("registry_kind", ["postgresql"], indirect=True)
async def test_a_shared_row_restores_on_another_node_over_that_nodes_template_build(
    node_factory: Any,
) -> None:
    """The row names a's template directory; b, restoring it, fetches the build and its meta points
    at b's copy (the row stays a's)."""
    a = await node_factory("a", shared=True, upload_templates=True)
    rootfs = make_template(a.data_dir / "templates", "2026-12-03T13:53:02")
    sid = snap_id()
    write_snapshot(a.data_dir, sid, os.urandom(CHUNK), [])
    (a.data_dir / "snapshots" / sid / "meta.json").write_text(
        f'{{"format": 2, "layers": [], "template_rootfs": "{rootfs}"}}'
    )
    row = row_of(sid, name="tpl-shared")
    row.info["template_rootfs"] = str(rootfs)
    await a.catalog.store.add(row)
    await a.durable.committed(row)
    await a.settle()
    original = rootfs.parent.parent.rename(a.data_dir / "templates-elsewhere") / "base" / "rootfs"
    b = await node_factory("b", shared=True)
    found = await b.catalog.find_user_snapshot("tpl-shared")
    assert found is not None and found.node_id == "a" and found.info["template_rootfs"] == str(rootfs)
    async with b.catalog.use(found) as ref:
        meta = (ref.path / "meta.json").read_text()
        fetched = b.data_dir / "store-templates"
        assert f'"template_rootfs": "{fetched}' in meta
        assert tree(next(fetched.iterdir()) / "rootfs") == tree(original)
