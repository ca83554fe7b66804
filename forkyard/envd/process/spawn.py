"""Starting processes without copying envd: vfork, as any user.

CPython forks (copies envd's whole address space) whenever ``user``/``group``/``extra_groups`` is
given, and under gVisor that fork is most of a command's cost: the sentry marks every page of envd
copy-on-write and envd then takes a fault on each page it writes. Measured in a sandbox (ptrace,
67 MB Python): ``/bin/true`` as another user 36.7 ms forked, 10.9 ms vforked (docs/LATENCY.md).

So processes are started from one dedicated thread that takes on the target user's credentials
for itself only (raw ``setgroups``/``setresgid``/``setresuid`` syscalls: Linux and gVisor keep
credentials per thread; glibc's wrappers would change every thread of envd), keeping root as its
saved uid to switch back, and calls Popen without ``user=``, which vforks. ``execve`` sets the
child's saved uid to its effective one and, all ids being the user's, clears its capabilities:
the command ends up as with setuid in a forked child (uid, gid and groups of the user, no
capabilities), and, as in E2B's Go envd, it enters its cwd already as the user.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from forkyard.errors import Failed

if TYPE_CHECKING:
    import ctypes

#: x86-64 and aarch64 syscall numbers (the architectures the bundle is built for).
_SYSCALLS = {
    "x86_64": {"setgroups": 116, "setresuid": 117, "setresgid": 119},
    "aarch64": {"setgroups": 159, "setresuid": 147, "setresgid": 149},
}

_CLONE_FS = 0x200
StdioTarget = int | IO[Any] | None


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    groups: tuple[int, ...]

    @classmethod
    def current(cls) -> Identity:
        return cls(os.geteuid(), os.getegid(), tuple(os.getgroups()))


@dataclass(frozen=True)
class Stdio:
    """What the child's fds 0-2 are: fds (pipe ends, a PTY slave), ``subprocess.DEVNULL``."""

    stdin: StdioTarget
    stdout: StdioTarget
    stderr: StdioTarget
    #: further fds the child keeps, at the same numbers
    keep: tuple[int, ...] = ()


class ThreadCredentials:
    """Switches the calling thread's own credentials with raw syscalls (never the process's)."""

    def __init__(self) -> None:
        import ctypes  # only envd running as root and starting processes as others needs it

        self._ctypes = ctypes
        self._libc: ctypes.CDLL = ctypes.CDLL(None, use_errno=True)
        numbers = _SYSCALLS.get(os.uname().machine)
        if numbers is None:
            raise Failed(f"no credential syscalls known for {os.uname().machine}")
        self._nr = numbers
        # A cwd of this thread's own, so it can enter the command's cwd as root (as envd always
        # did) without moving envd's other threads.
        if self._libc.unshare(_CLONE_FS) != 0:
            err = self._ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_FS): {os.strerror(err)}")

    def _call(self, name: str, *args: Any) -> None:
        if self._libc.syscall(self._nr[name], *args) != 0:
            err = self._ctypes.get_errno()
            raise OSError(err, f"{name}: {os.strerror(err)}")

    def become(self, who: Identity, saved: Identity) -> None:
        """Act as ``who``, keeping ``saved``'s ids as saved ids (to come back)."""
        c = self._ctypes
        groups = (c.c_uint * max(1, len(who.groups)))(*who.groups)
        self._call("setgroups", c.c_long(len(who.groups)), groups)
        self._call("setresgid", c.c_long(who.gid), c.c_long(who.gid), c.c_long(saved.gid))
        # Last: leaving uid 0 clears the effective capabilities setgroups and setresgid need.
        self._call("setresuid", c.c_long(who.uid), c.c_long(who.uid), c.c_long(saved.uid))

    def restore(self, own: Identity) -> None:
        """Back to envd's ids; the uid first, which brings the capabilities back for the rest."""
        c = self._ctypes
        self._call("setresuid", c.c_long(own.uid), c.c_long(own.uid), c.c_long(own.uid))
        self._call("setresgid", c.c_long(own.gid), c.c_long(own.gid), c.c_long(own.gid))
        groups = (c.c_uint * max(1, len(own.groups)))(*own.groups)
        self._call("setgroups", c.c_long(len(own.groups)), groups)


class Spawner:
    """Starts every process of envd (commands, login-shell captures) and knows which are alive."""

    def __init__(self) -> None:
        self._own = Identity.current()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="envd-spawn")
        self._credentials: ThreadCredentials | None = None
        self._broken: str | None = None
        self._live: set[int] = set()
        self._in_flight = 0
        self._waiting: dict[int, tuple[subprocess.Popen[bytes], asyncio.Future[int]]] = {}
        self._sigchld_loop: asyncio.AbstractEventLoop | None = None

    def live_pids(self) -> set[int] | None:
        """Pids of started processes not yet waited for; None while a start is in flight (its
        pid is not known yet), so the reaper (reaper.py) never takes an exit status from us."""
        return None if self._in_flight else set(self._live)

    async def start(
        self,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        user: Identity | None,
        stdio: Stdio,
        controlling_tty: Callable[[], None] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in a session of its own (it leads the process group signals go to).
        ``user`` None: as envd itself. ``controlling_tty`` runs in the child (a PTY needs it),
        which makes this one start a fork. Raises OSError when the program cannot start."""
        self._in_flight += 1
        try:
            started = asyncio.get_running_loop().run_in_executor(
                self._thread, self._start_here, list(argv), cwd, dict(env), user, stdio, controlling_tty
            )
            try:
                popen = await asyncio.shield(started)
            except asyncio.CancelledError:
                # The thread starts it anyway; nobody would supervise it: kill it once it runs.
                started.add_done_callback(self._abandon)
                raise
            self._live.add(popen.pid)
        finally:
            self._in_flight -= 1
        return popen

    def _abandon(self, started: asyncio.Future[subprocess.Popen[bytes]]) -> None:
        if started.cancelled() or started.exception() is not None:
            return
        popen = started.result()
        self._live.add(popen.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        self.wait(popen)

    def _start_here(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        user: Identity | None,
        stdio: Stdio,
        controlling_tty: Callable[[], None] | None,
    ) -> subprocess.Popen[bytes]:
        if self._broken:
            raise Failed(self._broken)
        common: dict[str, Any] = dict(
            cwd=cwd,
            env=env,
            stdin=stdio.stdin,
            stdout=stdio.stdout,
            stderr=stdio.stderr,
            pass_fds=stdio.keep,
            start_new_session=True,
        )
        if controlling_tty is not None:
            ids = _popen_ids(user) if user is not None and user != self._own else {}
            return subprocess.Popen(argv, preexec_fn=controlling_tty, **common, **ids)
        if user is None or user == self._own:
            return subprocess.Popen(argv, **common)
        self._thread_credentials()  # this thread's cwd is its own from here on
        os.chdir(cwd)  # as root, as a forked child did before its setuid
        with self._acting_as(user):
            return subprocess.Popen(argv, **{**common, "cwd": None})

    def _thread_credentials(self) -> ThreadCredentials:
        if self._credentials is None:
            self._credentials = ThreadCredentials()  # here, in the spawn thread (unshare)
        return self._credentials

    @contextlib.contextmanager
    def _acting_as(self, user: Identity) -> Iterator[None]:
        """This (spawn) thread runs as ``user`` inside the block; envd's other threads stay root."""
        credentials = self._thread_credentials()
        try:
            credentials.become(user, saved=self._own)  # inside: a half switch is undone too
            yield
        finally:
            self._restore(credentials)

    def _restore(self, credentials: ThreadCredentials) -> None:
        try:
            credentials.restore(self._own)
        except OSError as exc:
            # The thread would start the next process with the wrong identity: refuse from now on.
            self._broken = f"envd cannot start processes any more: restoring its identity failed: {exc}"
            raise Failed(self._broken) from exc

    def wait(self, popen: subprocess.Popen[bytes]) -> asyncio.Future[int]:
        """The child's return code (negative: killed by that signal) once it exited.

        Reaped on SIGCHLD in the event loop, by pid (never ``waitpid(-1)``: the reaper takes
        the orphans, reaper.py); a thread per child blocking in waitpid, as asyncio's
        ThreadedChildWatcher does, costs a thread start per command (1.1 ms in gVisor) and is
        only the fallback where the loop cannot take signals (not the main thread)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        if self._on_sigchld(loop):
            self._waiting[popen.pid] = (popen, done)
            self._reap(popen.pid)  # it may have exited before it was registered
        else:
            threading.Thread(target=self._wait_in_thread, args=(loop, popen, done), daemon=True).start()
        return done

    def _on_sigchld(self, loop: asyncio.AbstractEventLoop) -> bool:
        if self._sigchld_loop is not loop:
            try:
                loop.add_signal_handler(signal.SIGCHLD, self._reap_all)
            except (RuntimeError, ValueError):  # not the main thread
                return False
            self._sigchld_loop = loop
        return True

    def _reap_all(self) -> None:
        for pid in list(self._waiting):
            self._reap(pid)

    def _reap(self, pid: int) -> None:
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: its status is lost
            reaped, status = pid, 255 << 8
        if reaped:
            popen, done = self._waiting.pop(pid)
            self._exited(popen, done, os.waitstatus_to_exitcode(status))

    def _wait_in_thread(
        self, loop: asyncio.AbstractEventLoop, popen: subprocess.Popen[bytes], done: asyncio.Future[int]
    ) -> None:
        returncode = popen.wait()
        loop.call_soon_threadsafe(self._exited, popen, done, returncode)

    def _exited(self, popen: subprocess.Popen[bytes], done: asyncio.Future[int], returncode: int) -> None:
        # Popen must know: its own clean-up would otherwise waitpid a pid that may be reused.
        popen.returncode = returncode
        self._live.discard(popen.pid)
        if not done.done():
            done.set_result(returncode)

    def close(self) -> None:
        if self._sigchld_loop is not None and not self._sigchld_loop.is_closed():
            self._sigchld_loop.remove_signal_handler(signal.SIGCHLD)
            self._sigchld_loop = None
        self._thread.shutdown(wait=False, cancel_futures=True)


def _popen_ids(user: Identity) -> dict[str, Any]:
    """``Popen`` arguments that switch a forked child to ``user`` (the PTY path)."""
    return {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}


def identity_for(uid: int, gid: int, groups: Sequence[int]) -> Identity | None:
    """The identity to start a process with: None when envd may not switch (not root), so a
    non-root envd runs everything as itself."""
    if os.geteuid() != 0:
        return None
    return Identity(uid, gid, tuple(groups))
