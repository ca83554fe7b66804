"""E2B volumes: named directories of this node (``<data_dir>/volumes/<id>``), their rows in the
database, and the file operations of E2B's volume content API (``/volumecontent/{id}/...``).

A volume is bound into gVisor sandboxes at the paths their ``volumeMounts`` name; every sandbox
that mounts it shares its files. Its entries belong to uid/gid 1000 with modes 0777/0666 unless
the caller says otherwise, as E2B's (the sandbox's ``user`` writes into it).

The content operations run as root on the host, on a tree the sandboxes write: every path is
walked component by component from the volume's root with ``O_NOFOLLOW`` (a symlink made inside
a sandbox is never followed out of the volume), and every operation acts relative to the
directory file descriptor so found.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import os
import posixpath
import re
import secrets
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, delete, insert, select
from sqlalchemy.exc import IntegrityError

from forkyard.errors import Conflict, Failed, Forbidden, InsufficientStorage, Invalid, NotFound
from forkyard.storage.db import Database
from forkyard.storage.db.schema import volumes

#: E2B's ``NewVolume.name`` pattern (openapi.yml); the length bound is ours.
VOLUME_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
#: E2B's defaults for what the content API creates (its orchestrator's volume service).
DEFAULT_UID = 1000
DEFAULT_GID = 1000
DEFAULT_DIR_MODE = 0o777
DEFAULT_FILE_MODE = 0o666
MAX_ID = 2**32 - 2
READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class VolumeRow:
    volume_id: str
    name: str
    token: str
    created_at: float
    node_id: str


def volumes_dir(data_dir: Path) -> Path:
    return data_dir / "volumes"


def check_volume_name(name: str) -> None:
    if not VOLUME_NAME.match(name):
        raise Invalid(
            f"invalid volume name {name!r}: use 1-128 letters, digits, '_' and '-' (pattern ^[a-zA-Z0-9_-]+$)"
        )


def _row(r: Any) -> VolumeRow:
    return VolumeRow(
        volume_id=r["volume_id"],
        name=r["name"],
        token=r["token"],
        created_at=r["created_at"],
        node_id=r["node_id"],
    )


class VolumeCatalog:
    """The volumes' rows (shared by a cluster's nodes) and this node's directories of them."""

    def __init__(self, db: Database, data_dir: Path) -> None:
        self.db = db
        self.root = volumes_dir(data_dir)

    def directory(self, volume_id: str) -> Path:
        return self.root / volume_id

    async def create(self, name: str) -> VolumeRow:
        check_volume_name(name)
        row = VolumeRow(
            volume_id=str(uuid.uuid4()),
            name=name,
            token=secrets.token_urlsafe(32),
            created_at=time.time(),
            node_id=self.db.node_id,
        )
        self._make_directory(row.volume_id)

        def add(conn: Connection) -> None:
            conn.execute(insert(volumes).values(**row.__dict__))

        try:
            await self.db.write(add)
        except IntegrityError:
            shutil.rmtree(self.directory(row.volume_id), ignore_errors=True)
            raise Conflict(f"a volume named {name!r} already exists") from None
        return row

    def _make_directory(self, volume_id: str) -> None:
        path = self.directory(volume_id)
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        path.mkdir(mode=DEFAULT_DIR_MODE)
        os.chown(path, DEFAULT_UID, DEFAULT_GID)
        path.chmod(DEFAULT_DIR_MODE)  # not narrowed by the umask: the sandbox's user writes here

    async def list(self) -> list[VolumeRow]:
        stmt = select(volumes).order_by(volumes.c.created_at)
        return await self.db.read(lambda conn: [_row(r) for r in conn.execute(stmt).mappings()])

    async def get(self, volume_id: str) -> VolumeRow:
        return await self._one(volumes.c.volume_id, volume_id)

    async def by_name(self, name: str) -> VolumeRow:
        return await self._one(volumes.c.name, name)

    async def _one(self, column: Any, value: str) -> VolumeRow:
        stmt = select(volumes).where(column == value)
        found = await self.db.read(lambda conn: conn.execute(stmt).mappings().first())
        if found is None:
            raise NotFound(f"volume {value!r} not found")
        return _row(found)

    async def delete(self, row: VolumeRow) -> None:
        stmt = delete(volumes).where(volumes.c.volume_id == row.volume_id)
        await self.db.write(lambda conn: conn.execute(stmt))
        shutil.rmtree(self.directory(row.volume_id), ignore_errors=True)

    def files(self, row: VolumeRow) -> VolumeFiles:
        if row.node_id != self.db.node_id:
            raise Invalid(f"volume {row.name!r} is stored on node {row.node_id!r}, not this one")
        path = self.directory(row.volume_id)
        if not path.is_dir():
            raise NotFound(f"the directory of volume {row.name!r} is missing on this node")
        return VolumeFiles(path)


# -- the volume content API's file operations -----------------------------------------------------


def normalise(path: str) -> str:
    """A volume path as E2B reads it: relative to the volume's root, ``..`` never above it."""
    if not path or "\0" in path:
        raise Invalid("path must be a non-empty string without NUL bytes")
    return posixpath.normpath("/" + path.strip().lstrip("/")) if path.strip() else "/"


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


def os_error(exc: OSError, path: str) -> Exception:
    """An OS error of an operation on ``path`` as the error vocabulary's kind."""
    code = exc.errno
    if code in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
        return NotFound(f"path {path} not found")
    if code == errno.EEXIST:
        return Conflict(f"path {path} already exists")
    if code == errno.EISDIR:
        return Conflict(f"path {path} is a directory")
    if code == errno.ENOTEMPTY:
        return Conflict(f"directory {path} is not empty")
    if code in (errno.EACCES, errno.EPERM):
        return Forbidden(f"not permitted on {path}: {exc.strerror}")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(f"no space left for {path}")
    if code in (errno.ENAMETOOLONG, errno.EINVAL):
        return Invalid(f"invalid path {path}: {exc.strerror}")
    return Failed(f"{path}: {exc.strerror or exc}")


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat()


def _entry_type(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "unknown"


def check_owner(uid: int | None, gid: int | None, mode: int | None) -> None:
    for what, value in (("uid", uid), ("gid", gid)):
        if value is not None and not 0 <= value <= MAX_ID:
            raise Invalid(f"{what} must be between 0 and {MAX_ID}")
    if mode is not None and not 0 <= mode <= 0o7777:
        raise Invalid("mode must be between 0 and 0o7777")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class VolumeFiles:
    """The file operations on one volume's directory (synchronous: callers run them in a thread)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @contextlib.contextmanager
    def _parent(self, path: str, *, make: tuple[int, int, int] | None = None) -> Iterator[tuple[int, str]]:
        """The directory fd holding ``path``'s last component, and that name ('' for the root).
        ``make``: (uid, gid, mode) of the missing parents to create on the way (``force``)."""
        parts = _parts(path)
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in parts[:-1]:
                if make is not None:
                    self._mkdir_at(fd, part, *make, exist_ok=True)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
            yield fd, parts[-1] if parts else ""
        finally:
            os.close(fd)

    @staticmethod
    def _mkdir_at(fd: int, name: str, uid: int, gid: int, mode: int, *, exist_ok: bool) -> None:
        try:
            os.mkdir(name, mode, dir_fd=fd)
        except FileExistsError:
            if not exist_ok:
                raise
            return
        os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
        os.chmod(name, mode, dir_fd=fd)  # a directory just made (not a symlink): exact mode

    def _entry(self, fd: int, name: str, path: str) -> dict[str, Any]:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False) if name else os.fstat(fd)
        entry: dict[str, Any] = {
            "name": name or "/",
            "type": _entry_type(st.st_mode),
            "path": path,
            "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode),
            "uid": st.st_uid,
            "gid": st.st_gid,
            "atime": _iso(st.st_atime),
            "mtime": _iso(st.st_mtime),
            "ctime": _iso(st.st_ctime),
        }
        if stat.S_ISLNK(st.st_mode):
            entry["target"] = os.readlink(name, dir_fd=fd)
        return entry

    def _run(self, path: str, op: Any) -> Any:
        try:
            return op()
        except OSError as exc:
            raise os_error(exc, path) from None

    def stat(self, path: str) -> dict[str, Any]:
        def op() -> dict[str, Any]:
            with self._parent(path) as (fd, name):
                return self._entry(fd, name, path)

        result: dict[str, Any] = self._run(path, op)
        return result

    def list_dir(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        if depth < 1:
            raise Invalid("depth must be at least 1")

        def walk(fd: int, base: str, level: int) -> list[dict[str, Any]]:
            entries = []
            for name in sorted(os.listdir(fd)):
                child = posixpath.join(base, name)
                entry = self._entry(fd, name, child)
                entries.append(entry)
                if level < depth and entry["type"] == "directory":
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    try:
                        entries.extend(walk(sub, child, level + 1))
                    finally:
                        os.close(sub)
            return entries

        def op() -> list[dict[str, Any]]:
            with self._parent(path) as (fd, name):
                if not name:
                    return walk(fd, "/", 1)
                if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise Invalid(f"path {path} is not a directory")
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                try:
                    return walk(sub, path, 1)
                finally:
                    os.close(sub)

        result: list[dict[str, Any]] = self._run(path, op)
        return result

    def make_dir(
        self, path: str, uid: int | None, gid: int | None, mode: int | None, force: bool
    ) -> dict[str, Any]:
        check_owner(uid, gid, mode)
        owner = (
            DEFAULT_UID if uid is None else uid,
            DEFAULT_GID if gid is None else gid,
            DEFAULT_DIR_MODE if mode is None else mode,
        )

        def op() -> dict[str, Any]:
            with self._parent(path, make=owner if force else None) as (fd, name):
                if not name:
                    raise Conflict("path / already exists")
                self._mkdir_at(fd, name, *owner, exist_ok=force)
                entry = self._entry(fd, name, path)
                if entry["type"] != "directory":
                    raise Conflict(f"path {path} already exists and is not a directory")
                return entry

        result: dict[str, Any] = self._run(path, op)
        return result

    def open_for_write(
        self, path: str, uid: int | None, gid: int | None, mode: int | None, force: bool
    ) -> int:
        """A write fd of the (new, or with ``force`` truncated) file at ``path``, owned and moded
        as asked; the caller writes the body and closes it."""
        check_owner(uid, gid, mode)

        def op() -> int:
            with self._parent(path) as (fd, name):
                if not name:
                    raise Conflict("path / is a directory")
                flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                flags |= os.O_TRUNC if force else os.O_EXCL
                out = os.open(name, flags, 0o600, dir_fd=fd)
                try:
                    os.fchown(out, DEFAULT_UID if uid is None else uid, DEFAULT_GID if gid is None else gid)
                    os.fchmod(out, DEFAULT_FILE_MODE if mode is None else mode)
                except BaseException:
                    os.close(out)
                    raise
                return out

        result: int = self._run(path, op)
        return result

    def open_for_read(self, path: str) -> int:
        def op() -> int:
            with self._parent(path) as (fd, name):
                if not name:
                    raise Invalid("path / is a directory")
                out = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                if not stat.S_ISREG(os.fstat(out).st_mode):
                    os.close(out)
                    raise Invalid(f"path {path} is not a regular file")
                return out

        result: int = self._run(path, op)
        return result

    def update_metadata(
        self, path: str, uid: int | None, gid: int | None, mode: int | None
    ) -> dict[str, Any]:
        check_owner(uid, gid, mode)

        def op() -> dict[str, Any]:
            with self._parent(path) as (fd, name):
                if uid is not None or gid is not None:
                    target = name or "."
                    os.chown(
                        target,
                        -1 if uid is None else uid,
                        -1 if gid is None else gid,
                        dir_fd=fd,
                        follow_symlinks=False,
                    )
                if mode is not None:
                    self._chmod(fd, name, mode, path)
                return self._entry(fd, name, path)

        result: dict[str, Any] = self._run(path, op)
        return result

    @staticmethod
    def _chmod(fd: int, name: str, mode: int, path: str) -> None:
        if not name:
            os.fchmod(fd, mode)
            return
        if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            raise Invalid(f"path {path} is a symlink: its mode cannot be changed")
        target = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
        try:
            os.fchmod(target, mode)
        finally:
            os.close(target)

    def remove(self, path: str) -> None:
        def op() -> None:
            with self._parent(path) as (fd, name):
                if not name:
                    raise Invalid("the root of a volume cannot be removed (delete the volume instead)")
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)

        self._run(path, op)
