"""``filesystem.Filesystem``: Stat, MakeDir, Move, ListDir, Remove, WatchDir and polled watchers.

Every operation runs with the rights of the requesting user (filesystem/access.py): what they may not
see or change is PERMISSION_DENIED, what they create is theirs. E2B's envd acts as root and only
chowns what it creates (docs/HARDENING.md).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from forkyard.envd.filesystem.access import as_user
from forkyard.envd.filesystem.entries import entry_from_stat, entry_info, os_error_to_connect
from forkyard.envd.filesystem.inotify import QUEUE_OVERFLOW, DirectoryWatcher, WatchEvent
from forkyard.envd.filesystem.metadata_store import default_store
from forkyard.envd.proto.filesystem_pb import (
    CreateWatcherRequest,
    CreateWatcherResponse,
    EntryInfo,
    FilesystemEvent,
    GetWatcherEventsRequest,
    GetWatcherEventsResponse,
    ListDirRequest,
    ListDirResponse,
    MakeDirRequest,
    MakeDirResponse,
    MoveRequest,
    MoveResponse,
    RemoveRequest,
    RemoveResponse,
    RemoveWatcherRequest,
    RemoveWatcherResponse,
    StatRequest,
    StatResponse,
    WatchDirRequest,
    WatchDirResponse,
)
from forkyard.envd.rpc_common import keepalive_interval, request_user, with_keepalives
from forkyard.envd.state import EnvdState
from forkyard.envd.users import User, resolve_path
from forkyard.errors import Invalid

_KEEPALIVE_EVENT: Oneof[Literal["keepalive"], WatchDirResponse.KeepAlive] = Oneof(
    "keepalive", WatchDirResponse.KeepAlive()
)
_KEEPALIVE = WatchDirResponse(event=_KEEPALIVE_EVENT)
#: File systems whose change notifications are unreliable; watching them needs allow_network_mounts.
_NETWORK_FS_TYPES = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "fuse", "sshfs"})
#: Events a watcher holds for a client that does not collect them (the kernel's own queue holds
#: fs.inotify.max_queued_events, 16384 by default); one more and the watcher fails as on a kernel
#: overflow, rather than envd's memory growing or events being dropped unnoticed.
_MAX_PENDING_EVENTS = 16_384


def make_dirs(path: str, user: User) -> None:
    """``mkdir -p`` that hands every directory it creates to ``user``."""
    missing: list[str] = []
    current = path
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue
        chown_to(directory, user)


def _move(source: str, destination: str, user: User) -> None:
    try:
        os.lstat(source)
    except OSError as exc:
        raise os_error_to_connect(exc, source) from None
    try:
        make_dirs(os.path.dirname(destination), user)
        os.rename(source, destination)
    except OSError as exc:
        raise os_error_to_connect(exc, destination) from None


# The helpers below run as the request's user (fsaccess.as_user): the kernel decides what they
# may see and change. Entries are described afterwards, as envd, because their metadata lives
# where only envd may read it (metadata_store.py).


def _lstat(path: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except OSError as exc:
        raise os_error_to_connect(exc, path) from None


def _make_dir(path: str, user: User) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise os_error_to_connect(exc, path) from None
    else:
        # The SDK's make_dir returns False on ALREADY_EXISTS.
        if stat.S_ISDIR(st.st_mode):
            raise ConnectError(Code.ALREADY_EXISTS, f"directory '{path}' already exists")
        raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' already exists but it is not a directory")
    try:
        make_dirs(path, user)
    except OSError as exc:
        raise os_error_to_connect(exc, path) from None


def _scan(path: str, depth: int) -> list[tuple[str, os.stat_result]]:
    _require_directory(path)
    found: list[tuple[str, os.stat_result]] = []
    _walk(path, depth, found)
    return found


def _list(path: str, depth: int, user: User) -> list[EntryInfo]:
    return [entry_from_stat(child, st) for child, st in as_user(user, _scan, path, depth)]


def _remove(path: str) -> None:
    """Like Go's os.RemoveAll, which E2B's envd uses: removing what is not there succeeds."""
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise os_error_to_connect(exc, path) from None


def _require_readable(path: str) -> None:
    """Linux's inotify_add_watch wants read permission on the directory; gVisor's does not check
    it, so a watch checks it itself, by opening the directory for reading."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY))
    except OSError as exc:
        raise os_error_to_connect(exc, path) from None


def _resolve(path: str, user: User) -> str:
    try:
        return resolve_path(path, user)
    except Invalid as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, exc.message) from None


def chown_to(path: str, user: User) -> None:
    if os.geteuid() == 0:
        os.chown(path, user.uid, user.gid, follow_symlinks=False)


def _require_directory(path: str) -> None:
    """``path`` must be a directory, or a symlink to one (which stands for the directory)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise os_error_to_connect(exc, path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")


def _fs_type(path: str) -> str:
    """Type of the mount holding ``path`` (longest mount point prefix in /proc/self/mountinfo)."""
    best, best_type = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) < 5 or not rfields:
                    continue
                mount_point = fields[4].replace("\\040", " ")
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, rfields[0]
    except OSError:
        return ""
    return best_type


class _Watch:
    """One inotify watcher feeding either a WatchDir stream (``queue``, ended by None) or a polled
    event buffer.

    Once events are lost the watcher stops and ``failure`` says why, worded as E2B's envd words
    fsnotify's errors: a WatchDir stream ends with it after the events from before the loss,
    GetWatcherEvents answers it from then on; both as INTERNAL."""

    def __init__(self, root: str, recursive: bool, include_entry: bool) -> None:
        self.queue: asyncio.Queue[FilesystemEvent | None] = asyncio.Queue()
        self.buffer: list[FilesystemEvent] = []
        self.polled = False
        self.failure: str | None = None
        self._include_entry = include_entry
        self.watcher = DirectoryWatcher(root, recursive, self._on_event, self._on_failure)

    def _on_event(self, event: WatchEvent) -> None:
        pending = len(self.buffer) if self.polled else self.queue.qsize()
        if pending >= _MAX_PENDING_EVENTS:
            self._on_failure(QUEUE_OVERFLOW)
            return
        fs_event = FilesystemEvent(name=event.name, type=event.type)
        if self._include_entry:
            try:
                fs_event.entry = entry_from_stat(event.path, os.lstat(event.path))
            except OSError:
                pass  # removed or renamed away: no entry to describe
        if self.polled:
            self.buffer.append(fs_event)
        else:
            self.queue.put_nowait(fs_event)

    def _on_failure(self, reason: str) -> None:
        self.failure = f"watcher error: {reason}"
        self.close()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise ConnectError(Code.INTERNAL, self.failure)

    def close(self) -> None:
        self.watcher.close()
        self.queue.put_nowait(None)


class FilesystemService:
    def __init__(self, state: EnvdState) -> None:
        self._state = state
        self._watchers: dict[str, _Watch] = {}

    def _path(self, path: str, ctx: RequestContext[Any, Any]) -> tuple[str, User]:
        if not path:
            raise ConnectError(Code.INVALID_ARGUMENT, "path is required")
        user = request_user(self._state, ctx)
        return _resolve(path, user), user

    async def stat(
        self, request: StatRequest, ctx: RequestContext[StatRequest, StatResponse]
    ) -> StatResponse:
        path, user = self._path(request.path, ctx)
        return StatResponse(entry=entry_from_stat(path, as_user(user, _lstat, path)))

    async def make_dir(
        self, request: MakeDirRequest, ctx: RequestContext[MakeDirRequest, MakeDirResponse]
    ) -> MakeDirResponse:
        path, user = self._path(request.path, ctx)
        as_user(user, _make_dir, path, user)
        return MakeDirResponse(entry=entry_info(path))

    async def move(
        self, request: MoveRequest, ctx: RequestContext[MoveRequest, MoveResponse]
    ) -> MoveResponse:
        source, user = self._path(request.source, ctx)
        if not request.destination:
            raise ConnectError(Code.INVALID_ARGUMENT, "destination is required")
        destination = _resolve(request.destination, user)
        as_user(user, _move, source, destination, user)
        default_store().move(source, destination)  # metadata follows, as xattrs would
        return MoveResponse(entry=entry_info(destination))

    async def list_dir(
        self, request: ListDirRequest, ctx: RequestContext[ListDirRequest, ListDirResponse]
    ) -> ListDirResponse:
        path, user = self._path(request.path, ctx)
        # Big trees must not stall the loop: listed in a worker thread (as the user there).
        entries = await asyncio.to_thread(_list, path, request.depth or 1, user)
        return ListDirResponse(entries=entries)

    async def remove(
        self, request: RemoveRequest, ctx: RequestContext[RemoveRequest, RemoveResponse]
    ) -> RemoveResponse:
        path, user = self._path(request.path, ctx)
        await asyncio.to_thread(as_user, user, _remove, path)  # a big tree takes a while
        default_store().drop(path)
        return RemoveResponse()

    # --- watching ------------------------------------------------------------------------------
    def _open_watch(
        self, path: str, recursive: bool, include_entry: bool, allow_network_mounts: bool
    ) -> _Watch:
        _require_directory(path)
        _require_readable(path)
        fs_type = _fs_type(os.path.realpath(path))
        if not allow_network_mounts and fs_type.split(".")[0] in _NETWORK_FS_TYPES:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"path '{path}' is on a network file system ({fs_type}); "
                "set allow_network_mounts to watch it",
            )
        try:
            return _Watch(path, recursive, include_entry)
        except OSError as exc:
            raise os_error_to_connect(exc, path) from None

    def _watch_as_user(
        self, request: WatchDirRequest | CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> _Watch:
        """Open the watch a WatchDir or CreateWatcher request asks for, with the request user's
        rights (gVisor checks none when a watch is added: opening the directory as them does)."""
        path, user = self._path(request.path, ctx)
        return as_user(
            user,
            self._open_watch,
            path,
            request.recursive,
            request.include_entry,
            request.allow_network_mounts,
        )

    async def watch_dir(
        self, request: WatchDirRequest, ctx: RequestContext[WatchDirRequest, WatchDirResponse]
    ) -> AsyncIterator[WatchDirResponse]:
        watch = self._watch_as_user(request, ctx)
        try:
            started: Oneof[Literal["start"], WatchDirResponse.StartEvent] = Oneof(
                "start", WatchDirResponse.StartEvent()
            )
            yield WatchDirResponse(event=started)
            events = with_keepalives(watch.queue, keepalive_interval(ctx), None)
            async for event in events:
                if event is None:
                    yield _KEEPALIVE
                else:
                    happened: Oneof[Literal["filesystem"], FilesystemEvent] = Oneof("filesystem", event)
                    yield WatchDirResponse(event=happened)
            watch.raise_failure()
        finally:
            watch.close()

    async def create_watcher(
        self, request: CreateWatcherRequest, ctx: RequestContext[CreateWatcherRequest, CreateWatcherResponse]
    ) -> CreateWatcherResponse:
        watch = self._watch_as_user(request, ctx)
        watch.polled = True
        watcher_id = uuid.uuid4().hex
        self._watchers[watcher_id] = watch
        return CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self,
        request: GetWatcherEventsRequest,
        ctx: RequestContext[GetWatcherEventsRequest, GetWatcherEventsResponse],
    ) -> GetWatcherEventsResponse:
        watch = self._watcher(request.watcher_id)
        watch.raise_failure()  # until RemoveWatcher; the events it still holds are lost
        events, watch.buffer = watch.buffer, []
        return GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self, request: RemoveWatcherRequest, ctx: RequestContext[RemoveWatcherRequest, RemoveWatcherResponse]
    ) -> RemoveWatcherResponse:
        self._watcher(request.watcher_id).close()
        del self._watchers[request.watcher_id]
        return RemoveWatcherResponse()

    def _watcher(self, watcher_id: str) -> _Watch:
        watch = self._watchers.get(watcher_id)
        if watch is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher '{watcher_id}' not found")
        return watch

    def close(self) -> None:
        for watch in self._watchers.values():
            watch.close()
        self._watchers.clear()


def _walk(directory: str, depth: int, out: list[tuple[str, os.stat_result]]) -> None:
    """Entries below ``directory`` down to ``depth`` levels, sorted by name (like filepath.WalkDir)."""
    try:
        with os.scandir(directory) as it:
            children = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        raise os_error_to_connect(exc, directory) from None
    for child in children:
        try:
            st = child.stat(follow_symlinks=False)
        except OSError:
            continue  # vanished while listing
        out.append((child.path, st))
        if depth > 1 and stat.S_ISDIR(st.st_mode):
            try:
                _walk(child.path, depth - 1, out)
            except ConnectError:
                continue  # an unreadable subdirectory is listed, just not descended into
