"""``GET /files`` (download) and ``POST /files`` (multipart or octet-stream upload), envd.yaml.

Uploads stream into a temporary file next to the target, which is renamed over it only once the
whole body arrived: a failed or aborted upload never leaves a half-written file behind.

Every path is opened, created and renamed with the rights of the request's user (filesystem/access.py):
what the user could not read or write is refused with 403, what they create is theirs.
"""

from __future__ import annotations

import asyncio
import errno
import gzip as gzip_module
import mimetypes
import os
import stat
import urllib.parse
import zlib
from collections.abc import AsyncIterator
from typing import Any, BinaryIO

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse

from forkyard.envd.filesystem.access import as_user
from forkyard.envd.filesystem.entries import METADATA_XATTR_PREFIX
from forkyard.envd.filesystem.metadata_store import default_store
from forkyard.envd.filesystem.service import chown_to, make_dirs
from forkyard.envd.filesystem.tempnames import parse_temp_upload_name, temp_upload_name
from forkyard.envd.http.common import json_object
from forkyard.envd.http.multipart import MultipartReader, boundary_from_content_type
from forkyard.envd.state import EnvdState
from forkyard.envd.users import User, resolve_path
from forkyard.errors import Failed, Forbidden, ForkyardError, InsufficientStorage, Invalid, NotFound

_WRITE_BATCH = 1024 * 1024
_READ_CHUNK = 256 * 1024
#: Most a file that reports size 0 (procfs, sysfs) is read into memory for a download.
_SIZELESS_LIMIT = 64 * 1024 * 1024
_METADATA_HEADER = "x-metadata-"
_MAX_METADATA_KEY = 246
_MAX_METADATA_TOTAL = 4096


def _state(request: Request) -> EnvdState:
    state: EnvdState = request.app.state.envd
    return state


def _user(request: Request) -> User:
    return _state(request).user(request.query_params.get("username") or None)


#: errnos that say the request named a path it cannot use as it asked (400), not that envd failed.
_BAD_PATH_ERRNOS = frozenset({errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST})


def os_failure(exc: OSError, doing: str) -> ForkyardError:
    """The error kind of a failed file operation: a full disk is 507 (the SDK's
    NotEnoughSpaceException), what the user has no right to 403, a path that cannot be used as
    asked 400 (404 when missing); only the rest is envd's own failure (500)."""
    where = f" '{_shown_path(exc.filename)}'" if exc.filename else ""
    message = f"{doing}{where}: {exc.strerror or exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage("not enough disk space available")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return Forbidden(message)
    if exc.errno == errno.ENOENT:
        return NotFound(message)
    if exc.errno in _BAD_PATH_ERRNOS:
        return Invalid(message)
    return Failed(message)


def _shown_path(filename: object) -> str:
    """The path a message names: an upload's temp file is envd's business, the target is the
    user's (``.x.envd-new-<hex>`` shows as ``x``)."""
    path = os.fsdecode(filename) if isinstance(filename, (str, bytes)) else str(filename)
    temp = parse_temp_upload_name(os.path.basename(path))
    return os.path.join(os.path.dirname(path), temp[0]) if temp else path


# --- download ------------------------------------------------------------------------------------
def _accepts_gzip(accept_encoding: str) -> bool:
    """True for gzip, False for identity; 406 when neither is acceptable.

    Identity is acceptable unless excluded (RFC 9110 12.5.3), so gzip is chosen only when it is
    asked for on its own (the SDK's ``gzip=True`` sends ``Accept-Encoding: gzip``) or identity is
    refused: HTTP clients' blanket default (``gzip, deflate``) must not cost a compression pass
    over every large download.
    """
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        if not name:
            continue
        q = 1.0
        key, _, value = params.strip().partition("=")
        if key == "q":
            try:
                q = float(value)
            except ValueError:
                q = 0.0
        weights[name.strip().lower()] = q
    gzip_ok = weights.get("gzip", weights.get("*", 0.0)) > 0
    identity_ok = weights.get("identity", weights.get("*", 1.0)) > 0
    others = {name for name, q in weights.items() if q > 0} - {"gzip", "identity"}
    if gzip_ok and (not identity_ok or not others):
        return "gzip" in weights or not identity_ok
    if identity_ok:
        return False
    # Content negotiation is HTTP's own business, not an error kind: answered like routing's 405.
    raise HTTPException(406, "no acceptable encoding found, supported: [identity, gzip]")


def _content_disposition(name: str) -> str:
    try:
        name.encode("ascii")
        if '"' not in name and "\\" not in name:
            return f'inline; filename="{name}"'
    except UnicodeEncodeError:
        pass
    return f"inline; filename*=utf-8''{urllib.parse.quote(name)}"


async def _gzip_stream(file: BinaryIO) -> AsyncIterator[bytes]:
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
    with file:
        while chunk := await asyncio.to_thread(file.read, _READ_CHUNK):
            if out := compressor.compress(chunk):
                yield out
    yield compressor.flush()


class _OpenedFileResponse(FileResponse):
    """A file the user opened (their rights checked by the kernel), served by Starlette (ranges,
    validators) through ``/proc/self/fd/<n>``: the same open file, never the path again, so a
    path swapped for a symlink meanwhile cannot point the download elsewhere."""

    # Each chunk is a worker-thread round trip; 64 KiB chunks make big downloads slow under gVisor.
    chunk_size = 1024 * 1024

    def __init__(self, file: BinaryIO, st: os.stat_result, **kwargs: Any) -> None:
        super().__init__(f"/proc/self/fd/{file.fileno()}", stat_result=st, **kwargs)
        self._file = file

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._file.close()


def _open_readable(path: str) -> tuple[BinaryIO, os.stat_result]:
    """The file to download, opened (as the request's user: see ``download``). Non-blocking, as
    this runs on the event loop: opening a FIFO for reading would wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"path '{path}' does not exist") from None
    except OSError as exc:
        raise os_failure(exc, "error opening file") from None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise Invalid(f"path '{path}' is a directory")
    os.set_blocking(fd, True)  # reads happen in worker threads
    return os.fdopen(fd, "rb"), st


def _read_to_eof(file: BinaryIO) -> bytes:
    """A file whose size is unknown (procfs, sysfs) read in full, up to ``_SIZELESS_LIMIT``."""
    content = file.read(_SIZELESS_LIMIT + 1)
    if len(content) > _SIZELESS_LIMIT:
        raise Invalid(f"file reports size 0 but holds more than {_SIZELESS_LIMIT} bytes")
    return content


async def download(request: Request) -> Response:
    user = _user(request)
    raw_path = request.query_params.get("path")
    if not raw_path:
        raise Invalid("path is required")
    path = resolve_path(raw_path, user)
    gzip = _accepts_gzip(request.headers.get("accept-encoding", ""))
    file, st = as_user(user, _open_readable, path)
    media_type = mimetypes.guess_type(path)[0] or "application/octet-stream"
    headers = {"Content-Disposition": _content_disposition(os.path.basename(path))}
    if st.st_size == 0 and stat.S_ISREG(st.st_mode):
        # /proc and /sys files say they are empty and have content (boot_id, status): read to EOF,
        # as Go's io.Copy in E2B's envd does. A truly empty file reads nothing here.
        with file:
            content = await asyncio.to_thread(_read_to_eof, file)
        if gzip:
            headers.update({"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
            content = gzip_module.compress(content, 6)
        return Response(content, media_type=media_type, headers=headers)
    if gzip:
        headers["Content-Encoding"] = "gzip"
        headers["Vary"] = "Accept-Encoding"
        return StreamingResponse(_gzip_stream(file), media_type=media_type, headers=headers)
    return _OpenedFileResponse(file, st, media_type=media_type, headers=headers)


# --- upload --------------------------------------------------------------------------------------
def _metadata(request: Request) -> dict[str, str]:
    """``X-Metadata-<key>`` headers (first value wins); empty when the request sent none, which
    clears an overwritten file's metadata."""
    found: dict[str, str] = {}
    for raw_key, raw_value in request.headers.raw:
        key = raw_key.decode("latin-1").lower()
        if not key.startswith(_METADATA_HEADER):
            continue
        name = key.removeprefix(_METADATA_HEADER)
        value = raw_value.decode("latin-1")
        if not name or not all(0x20 <= ord(c) <= 0x7E for c in name + value):
            raise Invalid(f"metadata key '{name}' or its value is not printable US-ASCII")
        if len(name) > _MAX_METADATA_KEY:
            raise Invalid(f"metadata key '{name[:32]}...' is longer than {_MAX_METADATA_KEY} bytes")
        found.setdefault(name, value)
    total = sum(len(METADATA_XATTR_PREFIX) + len(k) + len(v) for k, v in found.items())
    if total > _MAX_METADATA_TOTAL:
        raise Invalid(f"metadata is larger than {_MAX_METADATA_TOTAL} bytes")
    return found


def _apply_metadata(path: str, metadata: dict[str, str]) -> None:
    """``metadata`` as the ``user.e2b.*`` xattrs of ``path``, a fresh upload temp file (nothing
    to remove: it has none yet)."""
    for key, value in metadata.items():
        os.setxattr(path, METADATA_XATTR_PREFIX + key, value.encode())


class _Upload:
    """One file being written: temp file beside the target, renamed into place by ``commit``."""

    def __init__(self, target: str, user: User) -> None:
        if os.path.islink(target):  # write through the link, as open(O_TRUNC) would
            target = os.path.realpath(target)
        self.target = target
        self.user = user
        if os.path.isdir(target):
            raise Invalid(f"path '{target}' is a directory")
        parent = os.path.dirname(target)
        try:
            make_dirs(parent, user)
        except NotADirectoryError:
            raise Invalid(f"a parent of '{target}' is not a directory") from None
        replacing = os.path.lexists(target)
        self.temp = os.path.join(parent, temp_upload_name(os.path.basename(target), replacing))
        self._file: BinaryIO = open(self.temp, "xb")
        self._pending = bytearray()

    async def write(self, chunk: bytes) -> None:
        self._pending += chunk
        if len(self._pending) >= _WRITE_BATCH:
            await self._flush()

    async def _flush(self) -> None:
        if self._pending:
            data, self._pending = bytes(self._pending), bytearray()
            await asyncio.to_thread(self._file.write, data)

    def fileno(self) -> int:
        return self._file.fileno()

    async def commit(self, metadata: dict[str, str]) -> None:
        await self._flush()
        self.finish(metadata)

    def finish(self, metadata: dict[str, str]) -> None:
        """Into place as the user; the metadata store (root's) is written as envd."""
        in_xattrs = as_user(self.user, self._place, metadata)
        default_store().set(self.target, {} if in_xattrs else metadata)

    def _place(self, metadata: dict[str, str]) -> bool:
        """Close; mode (kept from an overwritten file), owner and metadata; then the atomic
        rename. True when the metadata went into xattrs."""
        self._file.close()
        try:
            mode = stat.S_IMODE(os.stat(self.target).st_mode)
        except FileNotFoundError:
            mode = 0o644
        os.chmod(self.temp, mode)
        chown_to(self.temp, self.user)
        try:
            _apply_metadata(self.temp, metadata)
            in_xattrs = True
        except OSError as exc:
            if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            in_xattrs = False  # gVisor's gofer: the metadata store keeps it (filesystem/metadata_store.py)
        os.replace(self.temp, self.target)
        return in_xattrs

    def abort(self) -> None:
        self._file.close()
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass


async def _receive_into(upload: _Upload, body: AsyncIterator[bytes], metadata: dict[str, str]) -> None:
    try:
        async for chunk in body:
            await upload.write(chunk)
        await upload.commit(metadata)
    except BaseException:
        upload.abort()
        raise


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    decompressor = zlib.decompressobj(47)  # gzip or zlib header
    try:
        async for chunk in chunks:
            if out := decompressor.decompress(chunk):
                yield out
        if tail := decompressor.flush():
            yield tail
    except zlib.error as exc:
        raise Invalid(f"invalid gzip body: {exc}") from None
    if not decompressor.eof:
        raise Invalid("invalid gzip body: truncated")


def _written(path: str, metadata: dict[str, str]) -> dict[str, Any]:
    info: dict[str, Any] = {"name": os.path.basename(path), "type": "file", "path": path}
    if metadata:
        info["metadata"] = metadata
    return info


async def _upload_octet_stream(
    request: Request, user: User, metadata: dict[str, str]
) -> list[dict[str, Any]]:
    raw_path = request.query_params.get("path")
    if not raw_path:
        raise Invalid("the path query parameter is required for application/octet-stream uploads")
    body: AsyncIterator[bytes] = request.stream()
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "gzip":
        body = _gunzip(body)
    elif encoding not in ("", "identity"):
        raise Invalid(f"unsupported Content-Encoding '{encoding}', supported: [identity, gzip]")
    path = resolve_path(raw_path, user)
    file = as_user(user, _Upload, path, user)
    await _receive_into(file, body, metadata)
    return [_written(file.target, metadata)]


async def _upload_multipart(
    request: Request, user: User, metadata: dict[str, str], content_type: str
) -> list[dict[str, Any]]:
    reader = MultipartReader(request.stream(), boundary_from_content_type(content_type))
    path_param = request.query_params.get("path")
    written: list[dict[str, Any]] = []
    async for part, body in reader.parts():
        if part.name != "file":
            continue
        raw_path = path_param or part.filename
        if not raw_path:
            raise Invalid("a file part has no filename and no path query parameter was given")
        file = as_user(user, _Upload, resolve_path(raw_path, user), user)
        await _receive_into(file, body, metadata)
        written.append(_written(file.target, metadata))
    if not written:
        raise Invalid("the multipart body has no 'file' part")
    return written


async def upload(request: Request) -> Response:
    user = _user(request)
    metadata = _metadata(request)
    content_type = request.headers.get("content-type", "")
    kind = content_type.split(";")[0].strip().lower()
    if kind not in ("multipart/form-data", "application/octet-stream", ""):
        raise Invalid(
            f"unsupported Content-Type '{kind}', use multipart/form-data or application/octet-stream"
        )
    try:
        if kind == "multipart/form-data":
            written = await _upload_multipart(request, user, metadata, content_type)
        else:
            written = await _upload_octet_stream(request, user, metadata)
    except ClientDisconnect:
        raise Invalid("the client went away before the upload completed") from None
    except OSError as exc:
        raise os_failure(exc, "error writing file") from exc
    return JSONResponse(written)


# --- compose -------------------------------------------------------------------------------------
def _compose(sources: list[str], destination: str, user: User) -> None:
    """Every file operation as the user; ``finish`` writes the metadata store as envd."""
    as_user(user, _check_sources, sources)
    _copy_into(sources, destination, user)
    as_user(user, _remove_sources, sources, destination)


def _check_sources(sources: list[str]) -> None:
    for source in sources:
        if not os.path.lexists(source):
            raise NotFound(f"path '{source}' does not exist")
        if os.path.isdir(source):
            raise Invalid(f"path '{source}' is a directory")


def _remove_sources(sources: list[str], destination: str) -> None:
    kept = os.path.realpath(destination)
    for source in dict.fromkeys(sources):
        if os.path.realpath(source) != kept:
            os.unlink(source)


def _copy_into(sources: list[str], destination: str, user: User) -> None:
    """Concatenate ``sources`` into a temp file beside ``destination``, then rename it into place.

    copy_file_range lets the file system share or copy extents in the kernel (zero-copy on
    reflink-capable file systems); it falls back to a plain copy where it is unsupported.
    """
    upload = as_user(user, _Upload, destination, user)
    try:
        as_user(user, _copy_sources, sources, upload.fileno())
        upload.finish({})
    except BaseException:
        upload.abort()
        raise


def _copy_sources(sources: list[str], destination_fd: int) -> None:
    for source in sources:
        with open(source, "rb") as src:
            _copy_fd(src.fileno(), destination_fd)  # straight to the fd: nothing left to flush


def _copy_fd(src: int, dst: int) -> None:
    try:
        while os.copy_file_range(src, dst, 1 << 30):
            pass
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        while chunk := os.read(src, _READ_CHUNK):
            os.write(dst, chunk)


async def compose(request: Request) -> Response:
    """``POST /files/compose``: concatenate files in order; the sources are deleted afterwards."""
    body = json_object(await request.body(), "compose")
    sources_raw, destination_raw = body.get("source_paths"), body.get("destination")
    if not (isinstance(sources_raw, list) and sources_raw and all(isinstance(s, str) for s in sources_raw)):
        raise Invalid("source_paths must be a non-empty list of paths")
    if not isinstance(destination_raw, str) or not destination_raw:
        raise Invalid("destination is required")
    username = body.get("username")
    user = _state(request).user(username if isinstance(username, str) and username else None)
    sources = [resolve_path(s, user) for s in sources_raw]
    destination = resolve_path(destination_raw, user)
    try:
        await asyncio.to_thread(_compose, sources, destination, user)
    except OSError as exc:
        raise os_failure(exc, "error composing files") from exc
    return JSONResponse(_written(destination, {}))
