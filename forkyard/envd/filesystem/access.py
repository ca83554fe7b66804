"""File system operations as root (E2B's default) or with the rights of the user a request names.

envd runs as root. E2B's Go envd does every file operation as root and only chowns what it
creates to the user (``permissions.EnsureDirs``, ``processFile`` in packages/envd/internal), so
``files.write("/root/x")`` or ``files.make_dir("/workspace")`` work for the default user ``user``
(who has passwordless sudo anyway). That is the default here too (issue 24): the operations run
as envd, and what they create is chowned to the user (``chown_to`` in filesystem_service.py).

``FORKYARD_ENVD_FILES_AS_USER=1`` (``--files-as-user``; ours, docs/HARDENING.md) does them *as*
the user instead (issue 15, item 4): the calling thread takes on the user's uid, gid and groups
for the operation, so the kernel checks every path the way it checks the user's own processes,
and what is created belongs to the user (uid and primary gid, as E2B's chown gives it).

The switch is per thread (raw syscalls, never glibc's process-wide wrappers; spawn.py explains),
keeping root as the saved uid to come back. It happens on whichever thread runs the operation:
the event loop's for short synchronous steps (nothing else runs on it meanwhile), a worker
thread's for long ones (``asyncio.to_thread(access.call, ...)``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from forkyard.envd.process.spawn import Identity, ThreadCredentials
from forkyard.envd.users import User

logger = logging.getLogger("forkyard.envd")

P = ParamSpec("P")
T = TypeVar("T")


class FileAccess:
    """``call(user, fn, ...)`` runs ``fn`` with ``user``'s file system rights."""

    def __init__(self, as_the_user: bool = False) -> None:
        self._own = Identity.current()
        self._local = threading.local()
        self.as_the_user = as_the_user

    def _switches(self, user: User) -> bool:
        """Only root can act as another user; acting as envd's own user needs no switch."""
        return self.as_the_user and self._own.uid == 0 and user.uid != self._own.uid

    def _credentials(self) -> ThreadCredentials:
        credentials: ThreadCredentials | None = getattr(self._local, "credentials", None)
        if credentials is None:
            credentials = ThreadCredentials()
            self._local.credentials = credentials
        return credentials

    def call(self, user: User, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        acting: User | None = getattr(self._local, "acting", None)
        if acting is not None:
            if acting.uid != user.uid:
                raise RuntimeError(f"file access as {user.name} inside one as {acting.name}")
            return fn(*args, **kwargs)  # nested: the thread is the user already
        if not self._switches(user):
            return fn(*args, **kwargs)
        credentials = self._credentials()
        try:
            credentials.become(Identity(user.uid, user.gid, user.groups), saved=self._own)
            self._local.acting = user
            return fn(*args, **kwargs)
        finally:
            self._local.acting = None
            self._restore(credentials)

    def _restore(self, credentials: ThreadCredentials) -> None:
        try:
            credentials.restore(self._own)
        except OSError:
            # This thread (maybe the event loop's) would go on as the user with root's duties,
            # or as root where a user was meant: neither is safe to continue from.
            logger.critical("restoring envd's identity after a file operation failed", exc_info=True)
            os._exit(70)


_ACCESS: FileAccess | None = None


def configure(as_the_user: bool) -> None:
    """Whether file operations take on the request's user's rights (envd's start-up setting)."""
    global _ACCESS
    _ACCESS = FileAccess(as_the_user)


def as_user(user: User, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` with ``user``'s file system rights (with envd's own unless
    ``configure(as_the_user=True)``), on the calling thread."""
    global _ACCESS
    if _ACCESS is None:
        _ACCESS = FileAccess()
    return _ACCESS.call(user, fn, *args, **kwargs)
