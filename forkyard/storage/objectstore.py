"""The snapshot and template store: content-addressed chunks and one manifest per snapshot, in a
bucket of any S3-compatible service or a directory (a distributed file system mount).

Layout under the store's prefix::

    chunks/<sha256>               lz4-framed bytes of one chunk (the hash is of the raw bytes)
    layers/<layer_id>.json        a disk layer: the chunks of its tar archive, in order
    templates/<id>-<build>.json   a template root file system, the same way
    snapshots/<snapshot_id>.json  a snapshot: its database row, its files (memory image,
                                  meta.json) cut into chunks, the layers and template it names
    names/<name>.json             the newest user snapshot of that name

Files are cut at fixed offsets (``chunk_bytes``); an all-zero chunk is a hole and never stored, so
sparse memory files cost what they hold. A layer is immutable and named by id, so a child snapshot
uploads only the layers its parent did not, and equal chunks (the unchanged parts of two memory
images, two identical files) are stored once. Deleting a snapshot removes its manifest and then
every chunk and layer no other manifest names (mark and sweep over the manifests), on the store.

Concurrency: an upload writes its chunks first and its manifest last. Within one process a sweep
and an upload exclude each other exactly: an upload pins every key it stores or reuses before it
looks at it, and a sweep takes its final look at the manifests and the pins under the same lock as
its delete. Across nodes there is no such lock on S3: an upload refreshes the modification time of
every chunk and tree it reuses, a sweep deletes only what is older than ``gc_grace_seconds`` (a
tree kept for its age keeps its chunks), and an upload checks after writing its manifest that the
reused chunks are still there (re-storing any that a racing sweep took). The grace must outlast an
upload: with 0, a sweep elsewhere can still take a chunk just after that check. Imports nothing
above ``storage``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import lz4.frame

from forkyard.config import S3Settings
from forkyard.errors import Failed, Gone, Invalid, NotFound, Unavailable
from forkyard.storage.atomic import fsync_path, write_atomic

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
LAYER_ID = re.compile(r"l[0-9a-f]{16}\Z")
TEMPLATE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
BUILD = re.compile(r"[0-9a-f]{16}\Z")
LAST_MODIFIED_RESOLUTION = 1.0  # seconds; S3 gives modification times in whole seconds
#: A chunk reference: (sha256 hex of the raw bytes, length); the hash is None for a hole.
Chunk = tuple[str | None, int]
#: tar flags that keep what an overlay layer is made of: owners by number, every xattr (the
#: ``trusted.overlay.*`` opaque and whiteout markers), device nodes (0:0 whiteouts), holes.
TAR_CREATE = ["tar", "--create", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--sparse"]
TAR_EXTRACT = [
    "tar",
    "--extract",
    "--numeric-owner",
    "--xattrs",
    "--xattrs-include=*",
    "--preserve-permissions",
    "--same-owner",
]


class StoreUnavailable(Unavailable):
    """The store did not answer or refused a request."""


# -- backends -------------------------------------------------------------------------------------


class Backend(Protocol):
    """Keys to immutable blobs. Every method may raise :class:`StoreUnavailable`."""

    #: Shown in logs and listings: ``s3://bucket/prefix`` or a directory.
    location: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes:
        """The blob; :class:`NotFound` when there is none."""
        ...

    def age(self, key: str) -> float | None:
        """Seconds since the blob was written or refreshed; None when there is none."""
        ...

    def refresh(self, key: str) -> bool:
        """Set the blob's modification time to now; False when there is none."""
        ...

    def delete(self, keys: list[str]) -> None: ...
    def list(self, prefix: str) -> Iterator[str]: ...


class DirectoryBackend:
    """Blobs as files under a directory, written by rename (readers never see half a blob)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = str(root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise Invalid(f"invalid store key {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{key} is not in the snapshot store {self.location}") from None

    def age(self, key: str) -> float | None:
        try:
            return time.time() - self._path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def refresh(self, key: str) -> bool:
        try:
            os.utime(self._path(key))
        except FileNotFoundError:
            return False
        return True

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return
        for dirpath, _, files in os.walk(base):
            for name in files:
                if not name.startswith("."):
                    yield str(Path(dirpath, name).relative_to(self.root))


class S3Backend:
    """Blobs as objects of one bucket (boto3; any S3-compatible endpoint)."""

    def __init__(self, settings: S3Settings) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = settings.bucket
        self.prefix = settings.prefix.lstrip("/")
        self.location = f"s3://{self.bucket}/{self.prefix}"
        self._client = boto3.client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region,
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key,
            config=Config(
                max_pool_connections=max(10, settings.concurrency * 2),
                retries={"max_attempts": 4, "mode": "standard"},
                connect_timeout=10,
                read_timeout=120,
            ),
        )

    def _call(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                raise NotFound(f"{kwargs.get('Key', what)} is not in {self.location}") from None
            raise StoreUnavailable(f"snapshot store {self.location}: {what} failed: {exc}") from None
        except BotoCoreError as exc:
            raise StoreUnavailable(f"snapshot store {self.location}: {what} failed: {exc}") from None

    def put(self, key: str, data: bytes) -> None:
        self._call("put", self._client.put_object, Key=self.prefix + key, Body=data)

    def get(self, key: str) -> bytes:
        body = self._call("get", self._client.get_object, Key=self.prefix + key)["Body"]
        try:
            return bytes(body.read())
        finally:
            body.close()

    def age(self, key: str) -> float | None:
        try:
            head = self._call("head", self._client.head_object, Key=self.prefix + key)
        except NotFound:
            return None
        # Last-Modified travels as an HTTP date, whole seconds, cut down: the blob may have been
        # written up to a second after it says. Counting from the end of that second keeps a sweep
        # from taking as old what another node refreshed a moment ago.
        return time.time() - (head["LastModified"].timestamp() + LAST_MODIFIED_RESOLUTION)

    def refresh(self, key: str) -> bool:
        # A copy onto itself with new metadata is S3's only way to touch an object.
        full = self.prefix + key
        try:
            self._call(
                "refresh",
                self._client.copy_object,
                Key=full,
                CopySource={"Bucket": self.bucket, "Key": full},
                MetadataDirective="REPLACE",
                Metadata={"refreshed": str(int(time.time()))},
            )
        except NotFound:
            return False
        return True

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys at most
            batch = [{"Key": self.prefix + k} for k in keys[start : start + 1000]]
            self._call("delete", self._client.delete_objects, Delete={"Objects": batch, "Quiet": True})

    def list(self, prefix: str) -> Iterator[str]:
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = self._call("list", self._client.list_objects_v2, Prefix=self.prefix + prefix, **extra)
            for obj in page.get("Contents", []):
                yield str(obj["Key"])[len(self.prefix) :]
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]


def backend_for(settings: S3Settings) -> Backend | None:
    """The configured backend; None when snapshots stay on the node (the zero-config default)."""
    if settings.bucket:
        return S3Backend(settings)
    if settings.directory is not None:
        return DirectoryBackend(settings.directory)
    return None


# -- manifests --------------------------------------------------------------------------------------


@dataclass
class FileEntry:
    """One regular file of a snapshot directory, relative to it."""

    path: str
    size: int
    mode: int
    chunks: list[Chunk]

    def json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "mode": self.mode, "chunks": self.chunks}

    @classmethod
    def of(cls, d: dict[str, Any]) -> FileEntry:
        return cls(d["path"], int(d["size"]), int(d["mode"]), [(c[0], int(c[1])) for c in d["chunks"]])


@dataclass
class TemplateRef:
    """The template root file system a snapshot stands on, by build."""

    template_id: str
    build: str
    #: Key of the stored tree, None when templates are not uploaded.
    key: str | None = None


@dataclass
class Manifest:
    snapshot_id: str
    #: The database row (``SnapshotRow`` fields as JSON) and where the node took it.
    row: dict[str, Any]
    files: list[FileEntry]
    layers: list[str]
    template: TemplateRef | None
    uploaded_at: float = 0.0
    stored_bytes: int = 0

    def json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "snapshot_id": self.snapshot_id,
            "row": self.row,
            "files": [f.json() for f in self.files],
            "layers": self.layers,
            "template": self.template.__dict__ if self.template else None,
            "uploaded_at": self.uploaded_at,
            "stored_bytes": self.stored_bytes,
        }

    @classmethod
    def of(cls, d: dict[str, Any]) -> Manifest:
        if d.get("format") != MANIFEST_FORMAT:
            raise Gone(f"snapshot manifest format {d.get('format')}, this forkyard reads {MANIFEST_FORMAT}")
        tpl = d.get("template")
        layers = [str(x) for x in d["layers"]]
        template = TemplateRef(**tpl) if tpl else None
        # Both end up in paths on the node that fetches them.
        bad = [x for x in layers if not LAYER_ID.match(x)]
        if template is not None and not (
            TEMPLATE_ID.match(template.template_id) and BUILD.match(template.build)
        ):
            bad.append(f"{template.template_id}-{template.build}")
        if bad:
            raise Gone(f"snapshot manifest {d.get('snapshot_id')} names invalid layers or templates: {bad}")
        return cls(
            snapshot_id=d["snapshot_id"],
            row=dict(d["row"]),
            files=[FileEntry.of(f) for f in d["files"]],
            layers=layers,
            template=template,
            uploaded_at=float(d.get("uploaded_at", 0)),
            stored_bytes=int(d.get("stored_bytes", 0)),
        )

    def chunk_hashes(self) -> set[str]:
        return {h for f in self.files for h, _ in f.chunks if h}


@dataclass
class UploadReport:
    manifest: Manifest
    #: Bytes sent (compressed) and chunks sent vs reused (deduplicated).
    sent_bytes: int = 0
    sent_chunks: int = 0
    reused_chunks: int = 0
    #: Layers stored by this upload and layers an earlier one had stored.
    new_layers: list[str] = field(default_factory=list)
    reused_layers: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: Every key this upload stored or reused: a sweep in this process leaves them alone until
    #: the upload ends (its manifest names them by then).
    pinned: set[str] = field(default_factory=set)


@dataclass
class FetchReport:
    fetched_bytes: int = 0
    chunks: int = 0
    layers: list[str] = field(default_factory=list)
    template_fetched: bool = False
    seconds: float = 0.0


def snapshot_key(snapshot_id: str) -> str:
    return f"snapshots/{_safe(snapshot_id)}.json"


def layer_key(layer_id: str) -> str:
    return f"layers/{_safe(layer_id)}.json"


def chunk_key(digest: str) -> str:
    return f"chunks/{digest}"


def name_key(name: str) -> str:
    return f"names/{_safe(name)}.json"


def _safe(part: str) -> str:
    if not part or "/" in part or part.startswith(".") or len(part) > 200:
        raise Invalid(f"invalid snapshot store name {part!r}")
    return part


def template_build(template_meta: bytes) -> str:
    """A template build's identity: the hash of its ``template.json`` (written once per build)."""
    return hashlib.sha256(template_meta).hexdigest()[:16]


# -- the store --------------------------------------------------------------------------------------


class SnapshotObjects:
    """Uploads, fetches and deletes snapshots on a :class:`Backend`. Synchronous (boto3 is):
    the catalog calls it in a thread. Thread-safe."""

    def __init__(self, backend: Backend, *, chunk_bytes: int = 8 << 20, concurrency: int = 8) -> None:
        if chunk_bytes < 4096:
            raise Invalid("snapshot store chunks must be at least 4 KiB")
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.concurrency = max(1, concurrency)
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="objectstore")
        #: Manifests are immutable once written: each is read from the store once.
        self._manifests: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        #: Held by a sweep from its last look at the in-flight uploads to its delete, and by an
        #: upload while it pins a key: a key is either pinned before the sweep looks (kept) or
        #: deleted before the upload's refresh (which then finds it gone and stores it again).
        self._sweeping = threading.Lock()
        self._uploads: list[UploadReport] = []

    @classmethod
    def from_settings(cls, settings: S3Settings) -> SnapshotObjects | None:
        backend = backend_for(settings)
        if backend is None:
            return None
        return cls(backend, chunk_bytes=settings.chunk_mib << 20, concurrency=settings.concurrency)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- chunks ------------------------------------------------------------------------------

    def _store_chunk(self, digest: str, data: bytes, report: UploadReport) -> None:
        """Store one chunk unless it is there already (then refresh it: a sweep elsewhere must
        not take it while this upload is about to name it)."""
        key = chunk_key(digest)
        self._pin(report, key)
        if self.backend.refresh(key):
            with self._lock:
                report.reused_chunks += 1
            return
        packed = lz4.frame.compress(data)
        self.backend.put(key, packed)
        with self._lock:
            report.sent_chunks += 1
            report.sent_bytes += len(packed)

    def _pin(self, report: UploadReport, *keys: str) -> None:
        with self._sweeping, self._lock:
            report.pinned.update(keys)

    def _pin_tree(self, report: UploadReport, key: str) -> None:
        """Pin a tree and, when it is stored, its chunks (before the refresh that decides reuse)."""
        self._pin(report, key, *self._stored_tree_chunks(key))

    @contextlib.contextmanager
    def _in_flight(self, report: UploadReport) -> Iterator[None]:
        with self._lock:
            self._uploads.append(report)
        try:
            yield
        finally:
            with self._lock:
                self._uploads.remove(report)

    def _load_chunk(self, digest: str, length: int) -> bytes:
        data = lz4.frame.decompress(self.backend.get(chunk_key(digest)))
        if len(data) != length or hashlib.sha256(data).hexdigest() != digest:
            raise Failed(f"chunk {digest} of the snapshot store is corrupt")
        return data

    def _upload_stream(self, stream: IO[bytes], report: UploadReport) -> list[Chunk]:
        """Cut ``stream`` into chunks and store them, ``concurrency`` at a time."""
        chunks: list[Chunk] = []
        pending: list[Future[None]] = []
        while True:
            data = _read_full(stream, self.chunk_bytes)
            if not data:
                break
            if data.count(0) == len(data):
                chunks.append((None, len(data)))
                continue
            digest = hashlib.sha256(data).hexdigest()
            chunks.append((digest, len(data)))
            pending.append(self._pool.submit(self._store_chunk, digest, data, report))
            if len(pending) >= self.concurrency:  # at most this many chunks in memory
                pending.pop(0).result()
        for fut in pending:
            fut.result()
        return chunks

    def _fetch_chunks(self, chunks: list[Chunk], sink: Callable[[int, bytes | None, int], None]) -> int:
        """Fetch ``chunks`` (in parallel, a bounded window ahead) and hand each to ``sink(offset,
        data or None for a hole, length)`` in order. Returns the bytes fetched."""
        window: list[tuple[int, int, Future[bytes] | None]] = []
        fetched = 0
        offset = 0

        def drain(keep: int) -> None:
            nonlocal fetched
            while len(window) > keep:
                off, length, fut = window.pop(0)
                data = fut.result() if fut else None
                fetched += len(data) if data else 0
                sink(off, data, length)

        for digest, length in chunks:
            fut = self._pool.submit(self._load_chunk, digest, length) if digest else None
            window.append((offset, length, fut))
            offset += length
            drain(self.concurrency)
        drain(0)
        return fetched

    # -- trees (disk layers, template root file systems) --------------------------------------

    def _upload_tree(self, key: str, root: Path, extra: dict[str, Any], report: UploadReport) -> None:
        """Archive ``root`` with tar, store its chunks, then its manifest under ``key``."""
        proc = subprocess.Popen(
            [*TAR_CREATE, "--file=-", "-C", str(root), "."],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            chunks = self._upload_stream(proc.stdout, report)
        finally:
            proc.stdout.close()
            err = proc.stderr.read().decode(errors="replace")
            proc.stderr.close()
            code = proc.wait()
        if code != 0:
            raise Failed(f"archiving {root} for the snapshot store failed ({code}): {err.strip()[:500]}")
        doc = {"format": MANIFEST_FORMAT, **extra, "chunks": chunks}
        self.backend.put(key, json.dumps(doc).encode())

    def _fetch_tree(self, key: str, dest: Path) -> int:
        """Extract the tree stored under ``key`` into the new directory ``dest``."""
        doc = self._read_json(key)
        chunks = [(c[0], int(c[1])) for c in doc["chunks"]]
        dest.mkdir(parents=True)
        proc = subprocess.Popen(
            [*TAR_EXTRACT, "--file=-", "-C", str(dest)],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stderr is not None
        stdin = proc.stdin

        def sink(_off: int, data: bytes | None, length: int) -> None:
            stdin.write(data if data is not None else bytes(length))

        try:
            fetched = self._fetch_chunks(chunks, sink)
        except BaseException:
            proc.kill()
            raise
        finally:
            with contextlib.suppress(BrokenPipeError):
                stdin.close()
            err = proc.stderr.read().decode(errors="replace")
            proc.stderr.close()
            code = proc.wait()
        if code != 0:
            raise Failed(f"extracting {key} from the snapshot store failed ({code}): {err.strip()[:500]}")
        return fetched

    def has_layer(self, layer_id: str) -> bool:
        return self.backend.age(layer_key(layer_id)) is not None

    def upload_layer(self, layer_id: str, root: Path, report: UploadReport) -> bool:
        """Store a sealed disk layer unless stored already; True when this call stored it."""
        key = layer_key(layer_id)
        self._pin_tree(report, key)
        if self.backend.refresh(key):
            return False
        self._upload_tree(key, root, {"layer_id": layer_id}, report)
        return True

    def fetch_layer(self, layer_id: str, dest: Path) -> int:
        return self._fetch_tree(layer_key(layer_id), dest)

    def upload_template(self, ref: TemplateRef, rootfs: Path, report: UploadReport) -> None:
        assert ref.key is not None
        self._pin_tree(report, ref.key)
        if not self.backend.refresh(ref.key):
            self._upload_tree(ref.key, rootfs, {"template_id": ref.template_id, "build": ref.build}, report)

    def fetch_template(self, ref: TemplateRef, dest: Path) -> int:
        if ref.key is None:
            raise Gone(f"template {ref.template_id} (build {ref.build}) was not stored with the snapshot")
        return self._fetch_tree(ref.key, dest)

    # -- snapshots ----------------------------------------------------------------------------

    def upload(
        self,
        snapshot_dir: Path,
        row: dict[str, Any],
        *,
        layers: list[str],
        layer_path: Callable[[str], Path],
        template: TemplateRef | None = None,
        template_rootfs: Path | None = None,
        name: str | None = None,
    ) -> UploadReport:
        """Store the committed snapshot in ``snapshot_dir``: its files, the layers it names (those
        not stored yet, read from ``layer_path(id)``), its template when given, then its manifest."""
        started = time.monotonic()
        snapshot_id = str(row["snapshot_id"])
        manifest = Manifest(snapshot_id, row, [], list(layers), template)
        report = UploadReport(manifest)
        with self._in_flight(report):
            self._upload_snapshot(snapshot_dir, report, layers, layer_path, template, template_rootfs, name)
        report.seconds = time.monotonic() - started
        return report

    def _upload_snapshot(
        self,
        snapshot_dir: Path,
        report: UploadReport,
        layers: list[str],
        layer_path: Callable[[str], Path],
        template: TemplateRef | None,
        template_rootfs: Path | None,
        name: str | None,
    ) -> None:
        manifest = report.manifest
        snapshot_id = manifest.snapshot_id
        for path in _regular_files(snapshot_dir):
            st = path.stat()
            with open(path, "rb") as f:
                chunks = self._upload_stream(f, report)
            manifest.files.append(
                FileEntry(str(path.relative_to(snapshot_dir)), st.st_size, st.st_mode & 0o7777, chunks)
            )
        for layer_id in layers:
            if self.upload_layer(layer_id, layer_path(layer_id), report):
                report.new_layers.append(layer_id)
            else:
                report.reused_layers.append(layer_id)
        if template is not None and template.key is not None and template_rootfs is not None:
            self.upload_template(template, template_rootfs, report)
        manifest.uploaded_at = time.time()
        manifest.stored_bytes = report.sent_bytes
        self.backend.put(snapshot_key(snapshot_id), json.dumps(manifest.json()).encode())
        self._restore_swept(manifest, snapshot_dir)
        if name:
            self.backend.put(name_key(name), json.dumps({"snapshot_id": snapshot_id}).encode())

    def _restore_swept(self, manifest: Manifest, snapshot_dir: Path) -> None:
        """Put back any chunk of the manifest a racing sweep elsewhere deleted meanwhile."""
        for entry in manifest.files:
            offset = 0
            for digest, length in entry.chunks:
                if digest and self.backend.age(chunk_key(digest)) is None:
                    with open(snapshot_dir / entry.path, "rb") as f:
                        f.seek(offset)
                        data = _read_full(f, length)
                    self.backend.put(chunk_key(digest), lz4.frame.compress(data))
                    log.warning("snapshot store: chunk %s was swept during the upload; stored again", digest)
                offset += length

    def manifest(self, snapshot_id: str) -> Manifest | None:
        """The stored manifest of ``snapshot_id``, None when there is none."""
        try:
            return Manifest.of(self._read_json(snapshot_key(snapshot_id)))
        except NotFound:
            return None

    def find(self, name_or_id: str) -> Manifest | None:
        """By id, else by name (the newest user snapshot of that name)."""
        with contextlib.suppress(Invalid, NotFound):
            found = self.manifest(name_or_id)
            if found is not None:
                return found
            ref = json.loads(self.backend.get(name_key(name_or_id)))
            return self.manifest(str(ref["snapshot_id"]))
        return None

    def fetch(self, manifest: Manifest, dest: Path) -> FetchReport:
        """Write the snapshot's files into the new directory ``dest`` (its layers and template are
        fetched by :meth:`fetch_layer` / :meth:`fetch_template`)."""
        started = time.monotonic()
        report = FetchReport()
        dest.mkdir(parents=True, exist_ok=True)
        for entry in manifest.files:
            path = dest / entry.path
            if path.parent != dest and not path.resolve().is_relative_to(dest.resolve()):
                raise Failed(f"snapshot {manifest.snapshot_id}: file {entry.path} lies outside it")
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, entry.mode or 0o600)
            try:

                def sink(off: int, data: bytes | None, _length: int, fd: int = fd) -> None:
                    if data is not None:  # a hole stays a hole
                        os.pwrite(fd, data, off)

                report.fetched_bytes += self._fetch_chunks(entry.chunks, sink)
                report.chunks += sum(1 for h, _ in entry.chunks if h)
                os.ftruncate(fd, entry.size)
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_path(dest)
        report.seconds = time.monotonic() - started
        return report

    # -- deleting ------------------------------------------------------------------------------

    def delete(self, snapshot_id: str, *, grace_seconds: float) -> list[str]:
        """Remove the snapshot's manifest (and its name, if it still points at it), then sweep:
        what no remaining manifest names goes. Returns the deleted keys."""
        manifest = self.manifest(snapshot_id)
        if manifest is None:
            return []
        removed = [snapshot_key(snapshot_id)]
        self.backend.delete(removed)
        with self._lock:
            self._manifests.pop(snapshot_key(snapshot_id), None)
        name = manifest.row.get("name")
        if name:
            with contextlib.suppress(NotFound, Invalid):
                if json.loads(self.backend.get(name_key(name))).get("snapshot_id") == snapshot_id:
                    self.backend.delete([name_key(name)])
                    removed.append(name_key(name))
        candidates = {chunk_key(h) for h in manifest.chunk_hashes()} | {layer_key(x) for x in manifest.layers}
        for layer_id in manifest.layers:
            with contextlib.suppress(NotFound):
                candidates |= {chunk_key(h) for h in self._tree_hashes(layer_key(layer_id))}
        return removed + self._sweep(candidates, grace_seconds)

    def collect(self, *, grace_seconds: float) -> list[str]:
        """Mark and sweep the whole store: chunks and layers no manifest names (crash leftovers,
        uploads cut short) older than ``grace_seconds`` go."""
        candidates = set(self.backend.list("chunks/")) | set(self.backend.list("layers/"))
        return self._sweep(candidates, grace_seconds)

    def _sweep(self, candidates: set[str], grace_seconds: float) -> list[str]:
        """Delete the candidates no manifest names, that are older than the grace (an upload on
        another node refreshes what it reuses) and that no upload of this process has pinned."""
        unnamed = candidates - self._named()
        aged = {k for k in unnamed if self._older_than(k, grace_seconds)}
        # A tree kept for its age (a reused layer: its upload refreshed only the tree's manifest)
        # keeps its chunks.
        for tree in unnamed - aged:
            if not tree.startswith("chunks/"):
                aged -= self._stored_tree_chunks(tree)
        with self._sweeping:
            # Looked at again under the lock: an upload of this process that ended meanwhile has
            # its manifest listed now, one still running has its keys pinned.
            with self._lock:
                pinned = set().union(*(r.pinned for r in self._uploads))
            keep = self._named() | pinned
            # Layer manifests first: a layer whose chunks are gone must not look stored.
            doomed = sorted(aged - keep, key=lambda k: (not k.startswith("layers/"), k))
            self.backend.delete(doomed)
        with self._lock:
            for key in doomed:
                self._manifests.pop(key, None)
        return doomed

    def _older_than(self, key: str, grace_seconds: float) -> bool:
        """Stored and older than the grace; with no grace, every stored key is."""
        age = self.backend.age(key)
        return age is not None and (grace_seconds <= 0 or age >= grace_seconds)

    def _named(self) -> set[str]:
        """Every key some snapshot manifest names, directly or through its layers and template."""
        named: set[str] = set()
        for key in self.backend.list("snapshots/"):
            try:
                manifest = Manifest.of(self._read_json(key))
            except (NotFound, Gone, ValueError, KeyError):
                continue
            named |= {chunk_key(h) for h in manifest.chunk_hashes()}
            trees = [layer_key(x) for x in manifest.layers]
            if manifest.template and manifest.template.key:
                trees.append(manifest.template.key)
            for tree in trees:
                named.add(tree)
                with contextlib.suppress(NotFound):
                    named |= {chunk_key(h) for h in self._tree_hashes(tree)}
        return named

    def _tree_hashes(self, key: str) -> set[str]:
        return {c[0] for c in self._read_json(key)["chunks"] if c[0]}

    def _stored_tree_chunks(self, key: str) -> set[str]:
        """The chunk keys of the tree stored under ``key``; none when it is missing or unreadable."""
        with contextlib.suppress(NotFound, Gone, ValueError, KeyError):
            return {chunk_key(h) for h in self._tree_hashes(key)}
        return set()

    def _read_json(self, key: str) -> dict[str, Any]:
        with self._lock:
            cached = self._manifests.get(key)
        if cached is not None:
            return cached
        doc: dict[str, Any] = json.loads(self.backend.get(key))
        with self._lock:
            self._manifests[key] = doc
        return doc


def _read_full(stream: IO[bytes], size: int) -> bytes:
    """Up to ``size`` bytes; fewer only at the end of the stream (pipes return short reads)."""
    parts: list[bytes] = []
    left = size
    while left:
        data = stream.read(left)
        if not data:
            break
        parts.append(data)
        left -= len(data)
    return b"".join(parts)


def _regular_files(root: Path) -> Iterable[Path]:
    """The files of a snapshot directory, sorted; anything but files and directories is refused
    (a snapshot directory holds only what its runtime wrote)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise Failed(f"snapshot directory {root} holds a symbolic link {name}")
        for name in filenames:
            path = Path(dirpath, name)
            if not path.is_file() or path.is_symlink():
                raise Failed(f"snapshot directory {root} holds {path}, which is not a regular file")
            found.append(path)
    return sorted(found)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


__all__ = [
    "Backend",
    "DirectoryBackend",
    "FetchReport",
    "Manifest",
    "S3Backend",
    "SnapshotObjects",
    "StoreUnavailable",
    "TemplateRef",
    "UploadReport",
    "backend_for",
    "template_build",
]
