"""Directory watching with inotify through ctypes (no extra dependency; gVisor implements inotify).

One inotify instance per watcher. Recursive watchers add a watch for every directory below the
root, and for directories created (or moved in) later. When the kernel's queue overflows
(``IN_Q_OVERFLOW``: more than ``fs.inotify.max_queued_events`` unread), events were lost: the
watcher stops and says so, as fsnotify reports ``ErrEventOverflow`` to E2B's envd; so it does
when reading the queue fails.
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forkyard.envd.filesystem.tempnames import parse_temp_upload_name
from forkyard.envd.proto.filesystem_pb import EventType

if TYPE_CHECKING:
    import ctypes

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

#: fsnotify's ErrEventOverflow, which E2B's envd hands its clients on IN_Q_OVERFLOW.
QUEUE_OVERFLOW = "fsnotify: queue or buffer overflow"

_WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
_HEADER = struct.Struct("iIII")

# Same order of precedence as fsnotify, which Go's envd uses.
_EVENT_TYPES = (
    (IN_CREATE | IN_MOVED_TO, EventType.CREATE),
    (IN_MODIFY, EventType.WRITE),
    (IN_DELETE | IN_DELETE_SELF, EventType.REMOVE),
    (IN_MOVED_FROM | IN_MOVE_SELF, EventType.RENAME),
    (IN_ATTRIB, EventType.CHMOD),
)

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        # Imported on the first watch only: ctypes maps _ctypes and libffi into envd, which then
        # sit in every checkpoint image of sandboxes that never watch a directory.
        import ctypes

        # The interpreter already links libc: look the symbols up there rather than via
        # ctypes.util.find_library, which runs ldconfig/gcc (slow under gVisor, absent in templates).
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc.inotify_init1.argtypes = [ctypes.c_int]
        _libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    return _libc


def _check(result: int, what: str) -> int:
    if result < 0:
        import ctypes  # loaded by _lib() already

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _has_data(path: str) -> bool:
    try:
        return os.stat(path).st_size > 0
    except OSError:  # replaced or removed since: it was written, as far as anyone can tell
        return True


@dataclass(frozen=True)
class WatchEvent:
    """``name`` is relative to the watched root, as envd reports it."""

    name: str
    path: str
    type: EventType


class DirectoryWatcher:
    """Calls ``on_event`` for each change below ``root``. When events are lost (a queue overflow,
    a failed read) it closes itself and calls ``on_failure`` with the reason instead: nothing
    after a gap is worth reporting as if it were complete."""

    def __init__(
        self,
        root: str,
        recursive: bool,
        on_event: Callable[[WatchEvent], None],
        on_failure: Callable[[str], None],
    ) -> None:
        self.root = root
        self._recursive = recursive
        self._on_event = on_event
        self._on_failure = on_failure
        self._fd = _check(_lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
        self._dirs: dict[int, str] = {}
        #: rename cookie -> the upload temp file moved away under it (see tempnames)
        self._upload_moves: dict[int, tuple[str, bool]] = {}
        self._closed = False
        try:
            self._add_tree(root)
            asyncio.get_running_loop().add_reader(self._fd, self._read)
        except BaseException:
            os.close(self._fd)
            raise

    def _add(self, path: str) -> None:
        wd = _check(_lib().inotify_add_watch(self._fd, os.fsencode(path), _WATCH_MASK), f"watch '{path}'")
        self._dirs[wd] = path

    def _add_tree(self, path: str) -> None:
        self._add(path)
        if not self._recursive:
            return
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                sub = os.path.join(dirpath, name)
                if not os.path.islink(sub):
                    try:
                        self._add(sub)
                    except OSError:
                        pass  # gone already, or unreadable: nothing to watch there

    def _read(self) -> None:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno != errno.EBADF:  # EBADF: closed meanwhile, nobody waits for events
                self._fail(f"reading inotify events: {exc.strerror}")
            return
        offset = 0
        # An event's consumer may close the watcher mid-batch (see filesystem_service._Watch).
        while offset + _HEADER.size <= len(data) and not self._closed:
            wd, mask, cookie, length = _HEADER.unpack_from(data, offset)
            raw_name = data[offset + _HEADER.size : offset + _HEADER.size + length].rstrip(b"\0")
            offset += _HEADER.size + length
            if mask & IN_Q_OVERFLOW:
                self._fail(QUEUE_OVERFLOW)
                return
            self._handle(wd, mask, cookie, os.fsdecode(raw_name))

    def _fail(self, reason: str) -> None:
        self.close()
        self._on_failure(reason)

    def _handle(self, wd: int, mask: int, cookie: int, name: str) -> None:
        if mask & IN_IGNORED:
            self._dirs.pop(wd, None)
            return
        base = self._dirs.get(wd)
        if base is None:
            return
        path = os.path.join(base, name) if name else base
        if self._upload_event(mask, cookie, name, path):
            return
        if self._recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            try:
                self._add_tree(path)
            except OSError:
                pass
        if path == self.root and mask & (IN_DELETE_SELF | IN_MOVE_SELF) == 0:
            return
        for bits, event_type in _EVENT_TYPES:
            if mask & bits:
                rel = os.path.relpath(path, self.root)
                self._on_event(WatchEvent(name="" if rel == "." else rel, path=path, type=event_type))
                return

    def _upload_event(self, mask: int, cookie: int, name: str, path: str) -> bool:
        """Hide upload temp files; their rename into place reads as E2B's in-place write does.

        E2B's envd (upload.go) chowns an existing file, opens it ``O_CREAT|O_TRUNC`` and writes:
        ``chmod`` (the chown's IN_ATTRIB), ``write`` (the truncation and the data). A new file:
        ``create``, ``chmod``, then ``write`` only if it got data (a new file is not truncated)."""
        upload = parse_temp_upload_name(name) if name else None
        if upload is not None:
            if mask & IN_MOVED_FROM:
                self._upload_moves[cookie] = upload
                if len(self._upload_moves) > 1024:  # a rename whose other half we never saw
                    self._upload_moves.pop(next(iter(self._upload_moves)))
            return True
        if not mask & IN_MOVED_TO or cookie not in self._upload_moves:
            return False
        _, is_new = self._upload_moves.pop(cookie)
        rel = os.path.relpath(path, self.root)
        types = [EventType.CREATE, EventType.CHMOD] if is_new else [EventType.CHMOD]
        if not is_new or _has_data(path):
            types.append(EventType.WRITE)
        for event_type in types:
            self._on_event(WatchEvent(name=rel, path=path, type=event_type))
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.get_running_loop().remove_reader(self._fd)
        except RuntimeError:
            pass
        os.close(self._fd)
