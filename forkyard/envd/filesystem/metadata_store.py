"""File metadata (``X-Metadata-*`` on upload) where the file system has no user xattrs.

E2B's envd keeps metadata as ``user.e2b.*`` xattrs on the file. gVisor's gofer answers every
user xattr call with EOPNOTSUPP, so on a gVisor root file system envd keeps the metadata here
instead: one small JSON file per path in a root-only directory of the sandbox's own root file
system (so it is in the writable upper layer: it survives pause/resume, snapshots, forks and a
filesystem-only pause like the files it describes). Where xattrs work (a microVM's ext4) they
are used, as E2B does, and this store stays empty.

An index of the entries is loaded on first use and kept in memory (envd's memory is part of
every checkpoint, and a fresh boot loads it again), so entries without metadata cost no system
call. Every file system access of the store runs on one thread of its own, started with envd's
identity: file operations run with the rights of the request's user (fsaccess.py), who may
neither read the store's directory nor tell whether a file it cannot see still exists.

Entries are keyed by path and follow the file through envd's own operations: an upload
replaces them, ``Move`` moves them (with everything below a moved directory), ``Remove`` drops
them. A file a process renames or deletes itself cannot be followed without xattrs: its entry is
dropped when the path is found missing, and a new file created at the same path by a process
(not an upload) shows the old metadata until the next upload there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Overridable for envd run on a host (tests); inside a sandbox it is on the root file system.
STORE_DIR_ENV = "FORKYARD_ENVD_METADATA_DIR"
DEFAULT_STORE_DIR = "/var/lib/forkyard-envd/file-metadata"


def _entry_name(path: str) -> str:
    return hashlib.sha256(os.fsencode(path)).hexdigest()[:40] + ".json"


def _below(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class MetadataStore:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._index: dict[str, dict[str, str]] | None = None
        # Uploads finish in worker threads (files_http), the RPCs in the event loop.
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="envd-metadata")

    def start(self) -> None:
        """Start the store's thread now: a thread inherits the credentials of the thread that
        creates it, so this must run as envd itself (at start-up), never inside a user's call."""
        self._loaded()

    def _on_own_thread(self, fn: Callable[..., T], *args: object) -> T:
        return self._io.submit(fn, *args).result()

    # -- reading --------------------------------------------------------------------------------
    def get(self, path: str) -> dict[str, str] | None:
        """The stored metadata of ``path``; None when the store has no entry for it."""
        index = self._loaded()
        if not index:
            return None
        found = index.get(path)
        if found is not None and not self._on_own_thread(os.path.lexists, path):
            self.drop(path)  # deleted behind envd's back
            return None
        return dict(found) if found is not None else None

    def _loaded(self) -> dict[str, dict[str, str]]:
        if self._index is None:
            with self._lock:
                if self._index is None:
                    self._index = self._on_own_thread(self._load)
        return self._index

    def _load(self) -> dict[str, dict[str, str]]:
        index: dict[str, dict[str, str]] = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return index
        for name in names:
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    entry = json.load(f)
                index[str(entry["path"])] = {str(k): str(v) for k, v in entry["metadata"].items()}
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                log.warning("skipping unreadable file metadata entry %s: %s", name, exc)
        return index

    # -- writing --------------------------------------------------------------------------------
    def set(self, path: str, metadata: dict[str, str]) -> None:
        """Replace ``path``'s metadata; an empty map removes its entry."""
        if not metadata:
            self.drop(path)
            return
        index = self._loaded()
        with self._lock:
            self._on_own_thread(self._write, path, metadata)
            index[path] = dict(metadata)

    def drop(self, path: str) -> None:
        """Forget ``path`` and every path below it (a removed directory)."""
        index = self._loaded()
        if not index:
            return
        with self._lock:
            for known in [p for p in index if _below(p, path)]:
                self._on_own_thread(self._unlink, known)
                index.pop(known, None)

    def move(self, source: str, destination: str) -> None:
        """Entries of ``source`` (and below it) now belong to ``destination``; whatever
        ``destination`` had is replaced, as a rename replaces the file."""
        index = self._loaded()
        if not index:
            return
        moved = {p: m for p, m in index.items() if _below(p, source)}
        self.drop(destination)
        if not moved:
            return
        self.drop(source)
        for old, metadata in moved.items():
            self.set(destination + old[len(source) :], metadata)

    def _unlink(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, _entry_name(path)))

    def _write(self, path: str, metadata: dict[str, str]) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        target = os.path.join(self.directory, _entry_name(path))
        temp = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temp, "w", encoding="utf-8") as f:
            json.dump({"path": path, "metadata": metadata}, f)
        os.replace(temp, target)


_store: MetadataStore | None = None


def default_store() -> MetadataStore:
    """envd's store (one per sandbox); its directory is read from the environment once."""
    global _store
    if _store is None:
        _store = MetadataStore(os.environ.get(STORE_DIR_ENV) or DEFAULT_STORE_DIR)
    return _store
