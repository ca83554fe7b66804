"""``bash -l``'s login environment, captured once and reused, so commands skip the profile.

The SDKs run every command as ``/bin/bash -l -c <cmd>``. In a sandbox the login part is most of a
command (Debian: 42 of 48 ms, ``$(id -u)`` and ``mesg`` each start a process under ptrace), and
for one (user, cwd, environment) it yields the same result every time until what it reads changes.
So envd runs the login once per such key (a *capture*) and starts each command as
``/bin/bash --login --noprofile -c <cmd>`` in the captured environment and cwd: still a fresh
process per command and a login shell (``login_shell``, ``~/.bash_logout`` on ``exit``), with
bash's own ``-c`` parsing, error messages and exec of the last command.

Exact, not assumed. A capture dumps the login shell's whole state after the profile (every
variable, exported or not, functions, shell options, ``$?``, umask, traps, limits, aliases, the
directory stack and cwd) and the environment its children get; envd then starts a
``--login --noprofile`` shell with the captured environment exactly as it will start commands and
compares the two dumps. Any difference, profile output, or a process the profile left running,
and the key is not served from the cache (its commands run ``bash -l`` as before).

Kept current. The capture runs with xtrace: every path the profile sourced, tested or expanded,
and bash's own startup files, is watched (inotify, by name in the busy directories, whole for the
ones the profile enumerated); a change drops every capture. ``/init`` follows every restore,
resume and fork: it watches anew and compares a stat signature of each of those paths with the
one taken after the captures, so a disk that changed behind envd's back drops them too. The
default user's login is captured when envd starts, so a template snapshot already holds it.

What it cannot keep (docs/LATENCY.md): side effects of the profile other than output and
processes (a file it writes) happen once per capture instead of once per command; bash's command
hash table starts empty; ``$_`` before the first command is ``/bin/bash``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import stat
import subprocess
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from forkyard.envd.filesystem.inotify import DirectoryWatcher, WatchEvent
from forkyard.envd.process.processes import child_pipe, close_all, read_chunk
from forkyard.envd.process.reaper import session_members
from forkyard.envd.process.spawn import Spawner, Stdio, identity_for
from forkyard.envd.proto.process_pb import ProcessConfig
from forkyard.envd.users import User

log = logging.getLogger("forkyard.envd.login")  # envd's handler: server.log_to_stderr

BASH = "/bin/bash"
_MARK_STATE = "__forkyard_login_state__"
_MARK_ENV = "__forkyard_login_env__"
#: Run right after the login (its first line sees the profile's ``$?``). The same text in the
#: capture and the verification, so the dumps compare byte for byte; variables that differ
#: between any two shells (counters, clocks, the -c string, the hash table) are unset first.
#: (``$_`` is not: by then it is the same in both, and its place in the children's environment
#: is compared.)
_STATE_SCRIPT = f"""__forkyard_status=$?
set +x
unset BASH_XTRACEFD
printf '%s\\n' {_MARK_STATE}
unset -v BASHPID BASH_ARGV0 BASH_COMMAND BASH_EXECUTION_STRING BASH_LINENO BASH_SOURCE BASH_CMDS \
EPOCHREALTIME EPOCHSECONDS LINENO RANDOM SRANDOM SECONDS HISTCMD FUNCNAME BASH_SUBSHELL PIPESTATUS \
BASH_ARGC BASH_ARGV 2>/dev/null
declare -p; declare -f; shopt -p; set +o; printf '%s\\n' "$-"; umask; trap -p
ulimit -a; ulimit -H -a; alias -p; dirs -l -p; pwd; jobs -l
printf '%s\\n' {_MARK_ENV}
exec {BASH} --noprofile --norc -c 'mapfile -d "" -t e </proc/self/environ && printf "%s\\0" "${{e[@]}}"'
"""
#: Bash counts it up at start-up itself: commands get the value envd would have passed.
_SHLVL = "SHLVL"
#: Bash sets ``_`` for every child itself (appending it to the environment): passed on, an
#: inherited one would only move it in the children's ``env``.
_UNDERSCORE = "_"
#: What bash creates at start-up when its environment lacks it: never added.
_STARTUP_VARS = frozenset({_SHLVL, _UNDERSCORE, "PWD", "OLDPWD"})
_PSEUDO_FS = ("/proc/", "/sys/", "/dev/")
_RUN_TIMEOUT_S = 10.0
#: After the shell exited its pipes must close at once: something holding them is a leftover.
_EOF_TIMEOUT_S = 0.5
_OUTPUT_LIMIT = 4 * 1024 * 1024
_MAX_PATHS = 512
_MAX_WATCHED_DIRS = 64
_MAX_ENTRIES = 16
#: A capture refused only because it did not end in time is tried again (by a later command of
#: its key) this many times: on a busy node one slow run must not cost the key its cache for
#: good (it did: a standby's /init capture ran beside a restore, and every later command of the
#: sandbox ran ``bash -l``, 20 ms more each).
_TIMEOUT_RETRIES = 3
TIMED_OUT = "it did not end in time"


@dataclass(frozen=True)
class LoginKey:
    """What a login's result depends on (besides the files it reads)."""

    user: User
    groups: tuple[int, ...]
    cwd: str
    env: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, user: User, cwd: str, env: Mapping[str, str]) -> LoginKey:
        return cls(user, tuple(user.groups), cwd, tuple(env.items()))


@dataclass(frozen=True)
class LoginEnv:
    """How to start a command of the key without the profile: in this environment and cwd."""

    env: dict[str, str]
    cwd: str

    def argv(self, script: str) -> list[str]:
        return [BASH, "--login", "--noprofile", "-c", script]


def login_script(config: ProcessConfig, stdin: bool, pty: bool) -> str | None:
    """The command of an SDK-style ``/bin/bash -l -c <cmd>`` start, else None (run as asked).
    Only without stdin (a profile could read it) and without a PTY (an interactive login)."""
    if stdin or pty or config.cmd != BASH or len(config.args) != 3:
        return None
    login, dash_c, script = config.args
    return script if (login, dash_c) == ("-l", "-c") else None


@dataclass
class _Run:
    returncode: int
    stdout: bytes
    stderr: bytes
    left_behind: bool
    #: It did not end (or its pipes did not close) within the deadlines: maybe only a busy node.
    timed_out: bool = False


class _Watches:
    """inotify on the directories of the paths logins read; ``on_change`` when one changes."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        #: directory -> names in it that matter (None: all, the profile enumerated it)
        self.relevant: dict[str, set[str] | None] = {}
        self._watchers: dict[str, DirectoryWatcher] = {}
        #: a watched directory went away or could not be watched: start over at the next add
        self._stale = False
        #: path -> stat signature, taken after the last capture (see unchanged)
        self._signatures: dict[str, tuple[int, ...] | None] = {}

    def add(self, paths: Iterable[str], enumerated: Iterable[str]) -> bool:
        """Watch ``paths`` (by name) and the directories ``enumerated`` (whole); True when a
        directory was added, i.e. a login may have read it while it was not watched."""
        if self._stale:
            self._stale = False
            self.close()
            self.relevant.clear()
        before = set(self.relevant)
        for path in paths:
            self._note(path, whole=False)
        for directory in enumerated:
            self._note(directory, whole=True)
        added = set(self.relevant) - before
        for directory in added:
            self._watch(directory)
        return bool(added)

    def incomplete(self) -> bool:
        """Not everything a login read is watched: its capture must not be used."""
        return self._stale or len(self.relevant) > _MAX_WATCHED_DIRS

    def _note(self, path: str, whole: bool) -> None:
        directory, name = _existing_parent(path, whole)
        names = self.relevant.setdefault(directory, set())
        if names is None:
            return
        if name is None:
            self.relevant[directory] = None
        else:
            names.add(name)

    def _watch(self, directory: str) -> None:
        if directory in self._watchers or self.incomplete():
            return
        try:
            self._watchers[directory] = DirectoryWatcher(
                directory,
                recursive=False,
                on_event=lambda event: self._event(directory, event),
                on_failure=lambda reason: self._lost(directory, reason),
            )
        except OSError as exc:
            log.info("cannot watch %s for logins: %s", directory, exc)
            self._stale = True
            self._on_change()

    def _event(self, directory: str, event: WatchEvent) -> None:
        names = self.relevant.get(directory)
        head = event.name.split("/", 1)[0]
        if not head:  # the directory itself was removed or moved: its watch is gone
            self._stale = True
        if names is None or not head or head in names:
            self._on_change()

    def _lost(self, directory: str, reason: str) -> None:
        self._watchers.pop(directory, None)
        log.info("login watch on %s failed (%s): watching it again", directory, reason)
        self._on_change()
        self._watch(directory)

    def rebuild(self) -> None:
        """Fresh watches on every known directory (after a restore nothing is assumed)."""
        self.close()
        for directory in list(self.relevant):
            self._watch(directory)

    def sign(self) -> None:
        """Remember how every watched path looks now (a capture just ended under the watches)."""
        self._signatures = self._current_signatures()

    def unchanged(self) -> bool:
        """Whether every signed path still looks as it did: also changes no inotify saw (a
        restore onto a different disk, a mount). Paths of a capture still under way are not
        signed yet; it signs them when it ends."""
        current = self._current_signatures()
        changed = [path for path, sig in self._signatures.items() if current.get(path) != sig]
        if changed or self._stale:
            stale = " (a watch went stale)" if self._stale else ""
            log.info("captured logins dropped: changed %s%s", changed[:5], stale)
        return not self._stale and not changed

    def _current_signatures(self) -> dict[str, tuple[int, ...] | None]:
        """A signature of each relevant path: of a file, its identity, size and times; of a
        directory, its identity, and its times only when the profile enumerated it (its listing is
        what they reflect). A file written next to ``~/.profile``, a shim added to a directory on
        PATH, change their directory's times, not what a login reads: they must not drop the
        captures (they did: every standby restored from a snapshot of a sandbox that had written a
        file in its home ran its first commands with the profile, beside a new capture)."""
        listed: dict[str, bool] = {}  # path -> whether its listing matters
        for directory, names in self.relevant.items():
            listed[directory] = listed.get(directory, False) or names is None
            if names is None:
                with contextlib.suppress(OSError):
                    names = set(os.listdir(directory))
            for name in names or ():
                listed.setdefault(os.path.join(directory, name), False)
        return {path: _signature(path, listing=listing) for path, listing in listed.items()}

    def close(self) -> None:
        for watcher in self._watchers.values():
            watcher.close()
        self._watchers.clear()


def _signature(path: str, *, listing: bool) -> tuple[int, ...] | None:
    """How ``path`` looks (None: it does not exist); see ``_Watches._current_signatures``. Not
    its device and inode numbers: gVisor numbers a restored sandbox's overlay anew (a standby of a
    user snapshot saw every file of the profile "replaced", and dropped the captures); a file put
    in place of another has its own times (``ctime`` is set by every change, rename included)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode) and not listing:
        return (st.st_mode,)
    return st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _existing_parent(path: str, whole: bool) -> tuple[str, str | None]:
    """The nearest existing directory holding ``path`` (or being it, for ``whole``), and the name
    in it that leads to ``path`` (None: every name)."""
    if whole and os.path.isdir(path):
        return path, None
    child, parent = path, os.path.dirname(path)
    while parent != child and not os.path.isdir(parent):
        child, parent = parent, os.path.dirname(parent)
    return parent, os.path.basename(child) or None


class LoginEnvironments:
    """Captured logins by key; see the module docstring."""

    def __init__(self, spawner: Spawner) -> None:
        self._spawner = spawner
        self._epoch = 0
        self._entries: OrderedDict[LoginKey, asyncio.Task[LoginEnv | None]] = OrderedDict()
        #: captures under way, also forgotten ones (they end by themselves, their result unused)
        self._running: set[asyncio.Task[LoginEnv | None]] = set()
        self._seen: OrderedDict[LoginKey, None] = OrderedDict()
        #: captures of a key that did not end in time (see _TIMEOUT_RETRIES)
        self._timeouts: dict[LoginKey, int] = {}
        self._watches = _Watches(self._invalidate)
        #: ``/init`` calls so far: a capture that spans one spanned a snapshot and restore
        self._inits = 0

    def lookup(self, key: LoginKey) -> LoginEnv | None:
        """The key's captured login, or None: run ``bash -l``. Never waits for a capture under
        way (a login of its own is quicker than the rest of one). A key's second command starts
        its capture (one-off environments are never captured)."""
        task = self._entries.get(key)
        if task is None:
            if key in self._seen:
                self._capture(key)
            else:
                _remember(self._seen, key)
            return None
        self._entries.move_to_end(key)
        return task.result() if task.done() and not task.cancelled() else None

    def prewarm(self, key: LoginKey) -> None:
        if key not in self._entries:
            self._capture(key)

    def revalidate(self) -> None:
        """``/init``, after a restore, resume or fork: watch anew, and forget every capture if
        anything they depend on changed meanwhile."""
        self._inits += 1
        self._watches.rebuild()
        if not self._watches.unchanged():
            self._invalidate()

    async def settled(self, limit_s: float) -> None:
        """Wait (at most ``limit_s`` seconds) for the captures under way: envd's start-up does,
        so a template snapshot taken once envd answers holds a finished capture."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=limit_s)

    def close(self) -> None:
        self._invalidate()
        self._watches.close()
        for task in self._running:
            task.cancel()

    def _invalidate(self) -> None:
        self._epoch += 1
        self._entries.clear()

    def _capture(self, key: LoginKey) -> None:
        task = asyncio.create_task(self._captured(key, self._epoch), name="envd-login-capture")
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        self._entries[key] = task
        while len(self._entries) > _MAX_ENTRIES:
            self._entries.popitem(last=False)

    async def _captured(self, key: LoginKey, epoch: int) -> LoginEnv | None:
        inits = self._inits
        try:
            found = await self._capture_and_verify(key)
        except asyncio.CancelledError:
            raise
        except _Transient:
            current = asyncio.current_task()
            if self._inits != inits and epoch == self._epoch and self._entries.get(key) is current:
                # A snapshot was taken mid-capture and restored later: the clock jumped past the
                # deadline of a login that ran fine. Capture again at once, not counted.
                log.info("login capture of %s spanned a restore: capturing again", key.user.name)
                del self._entries[key]
                self._capture(key)
                return None
            if len(self._timeouts) > 4 * _MAX_ENTRIES:
                self._timeouts.clear()
            self._timeouts[key] = self._timeouts.get(key, 0) + 1
            if self._timeouts[key] <= _TIMEOUT_RETRIES and epoch == self._epoch:
                current = asyncio.current_task()
                if self._entries.get(key) is current:
                    del self._entries[key]  # the key's next command captures again
            return None
        except Exception as exc:  # a capture never fails a command: it runs bash -l instead
            log.warning("login capture for %s failed: %s", key.user.name, exc)
            return None
        return found if epoch == self._epoch else None

    async def _capture_and_verify(self, key: LoginKey) -> LoginEnv | None:
        """Watches go up before a login reads: a directory first seen in a capture's trace gets
        a second capture, which then ran under its watch."""
        self._watches.add(_startup_files(key), enumerated=())
        for _ in range(2):
            captured = await self._login(key)
            if captured is None:
                return None
            login_env, state, paths, enumerated = captured
            if not self._watches.add(paths, enumerated):
                break
        else:
            return None
        if self._watches.incomplete() or not await self._verified(key, login_env, state):
            return None
        self._watches.sign()
        return login_env

    async def _login(self, key: LoginKey) -> tuple[LoginEnv, bytes, set[str], set[str]] | None:
        """The traced login: how to start its commands, its state dump, what it read."""
        env = dict(key.env)
        if "BASH_XTRACEFD" in env:
            return None  # the trace needs it
        trace = os.memfd_create("envd-login-trace")
        try:
            env["BASH_XTRACEFD"] = str(trace)
            run = await self._run([BASH, "-l", "-x", "-c", _STATE_SCRIPT], key, key.cwd, env, keep=(trace,))
            traced = os.pread(trace, _OUTPUT_LIMIT + 1, 0)
        finally:
            os.close(trace)
        why = _refusal(run) or ("the trace is too long" if len(traced) > _OUTPUT_LIMIT else None)
        if why:
            log.info("not caching the login of %s: %s", key.user.name, why)
            if why == TIMED_OUT:
                raise _Transient(why)
            return None
        login_env = _login_env(run.stdout, key)
        paths, enumerated = _traced_paths(traced.decode(errors="replace"), key.cwd)
        if login_env is None or len(paths) > _MAX_PATHS:
            return None
        return login_env, run.stdout, paths, enumerated

    async def _verified(self, key: LoginKey, login_env: LoginEnv, state: bytes) -> bool:
        """Does a ``--login --noprofile`` shell started like a command see what the login saw?"""
        replay = await self._run(login_env.argv(_STATE_SCRIPT), key, login_env.cwd, login_env.env)
        if replay.timed_out:
            log.info("not verifying the login of %s: %s", key.user.name, TIMED_OUT)
            raise _Transient(TIMED_OUT)
        same = _refusal(replay) is None and replay.stdout == state
        if not same:
            log.info("not caching the login of %s: its state differs without the profile", key.user.name)
        return same

    async def _run(
        self, argv: list[str], key: LoginKey, cwd: str, env: dict[str, str], keep: tuple[int, ...] = ()
    ) -> _Run:
        """Run a login helper as the key's user to its end; its output and whether it left a
        process behind (killed then)."""
        ours: list[int] = []
        theirs: list[int] = []
        user = identity_for(key.user.uid, key.user.gid, key.groups)
        try:
            try:
                stdio = Stdio(
                    subprocess.DEVNULL, child_pipe(ours, theirs), child_pipe(ours, theirs), keep=keep
                )
                popen = await self._spawner.start(argv, cwd=cwd, env=env, user=user, stdio=stdio)
            finally:
                close_all(theirs)
            return await self._finish(popen, ours)
        finally:
            close_all(ours)

    async def _finish(self, popen: subprocess.Popen[bytes], fds: list[int]) -> _Run:
        exited = self._spawner.wait(popen)
        reading = asyncio.gather(*(_collect(fd) for fd in fds))
        try:
            returncode = await asyncio.wait_for(asyncio.shield(exited), timeout=_RUN_TIMEOUT_S)
            stdout, stderr = await asyncio.wait_for(reading, timeout=_EOF_TIMEOUT_S)
            left_behind = bool(session_members(popen.pid))
        except TimeoutError:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading  # the readers let go of the fds before they are closed
            returncode, stdout, stderr, left_behind = -1, b"", b"", True
            timed_out = True
        else:
            timed_out = False
        if left_behind:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
        return _Run(returncode, stdout, stderr, left_behind, timed_out)


class _Transient(Exception):
    """A capture failed in a way that may not happen again (it ran out of time)."""


def _remember(seen: OrderedDict[LoginKey, None], key: LoginKey) -> None:
    seen[key] = None
    while len(seen) > 4 * _MAX_ENTRIES:
        seen.popitem(last=False)


async def _collect(fd: int) -> bytes:
    out = bytearray()
    while chunk := await read_chunk(fd):
        if len(out) <= _OUTPUT_LIMIT:
            out += chunk
    return bytes(out)


def _refusal(run: _Run) -> str | None:
    """Why a login run cannot stand for its commands, or None."""
    if run.timed_out:
        return TIMED_OUT
    if run.left_behind:
        return "it left a process running"
    if run.returncode != 0:
        return f"it exited with {run.returncode}"
    if run.stderr:
        return "its profile wrote to stderr"
    if not run.stdout.startswith(_MARK_STATE.encode() + b"\n"):
        return "its profile wrote to stdout"
    if len(run.stdout) > _OUTPUT_LIMIT:
        return "its state is too large"
    return None


def _login_env(stdout: bytes, key: LoginKey) -> LoginEnv | None:
    """The environment the login shell's children got, and its cwd.

    In the order the login shell took its variables in (the environment envd passed, then the
    profile's new ones): bash's export order follows its variable table's insertion order, and
    the children of a command's shell must see the same ``env`` as under ``bash -l``. What bash
    sets for itself at start-up (``_STARTUP_VARS``) is passed only as envd would pass it, or not
    at all (``_``)."""
    _, found, raw = stdout.partition(b"\n" + _MARK_ENV.encode() + b"\n")
    if not found:
        return None
    captured: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, equals, value = os.fsdecode(entry).partition("=")
        if equals:
            captured[name] = value
    env: dict[str, str] = {}
    for name, value in key.env:
        if name == _SHLVL:
            env[name] = value
        elif name in captured and name != _UNDERSCORE:
            env[name] = captured[name]
    for name, value in captured.items():
        if name not in env and name not in _STARTUP_VARS:
            env[name] = value
    pwd = captured.get("PWD", "")
    return LoginEnv(env, pwd if os.path.isabs(pwd) and os.path.isdir(pwd) else key.cwd)


def _startup_files(key: LoginKey) -> list[str]:
    """What bash itself reads for ``-l -c`` (the rest shows in the trace)."""
    home = key.user.home
    files = ["/etc/profile", f"{home}/.bash_profile", f"{home}/.bash_login", f"{home}/.profile"]
    bash_env = dict(key.env).get("BASH_ENV")
    if bash_env:
        files.append(os.path.join(key.cwd, os.path.expanduser(bash_env)))
    return files


def _traced_paths(trace: str, cwd: str) -> tuple[set[str], set[str]]:
    """Paths in an xtrace of the login (sourced, tested, expanded), and the directories it
    enumerated (``for x in dir/*``, globs that matched nothing)."""
    paths: set[str] = set()
    enumerated: set[str] = set()
    for line in trace.splitlines():
        words = _words(line.lstrip("+").strip())
        listed = words[:1] == ["for"]
        for word in words:
            for path in _path_parts(word, cwd):
                paths.add(path)
                if listed or any(c in path for c in "*?["):
                    enumerated.add(os.path.dirname(path))
    return paths, enumerated


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:  # bash's $'...' quoting, a multi-line value: good enough split
        return line.split()


def _path_parts(word: str, cwd: str) -> Iterable[str]:
    for part in word.replace("=", ":").split(":"):
        if part.startswith(("./", "../")):
            part = os.path.join(cwd, part)
        if part.startswith("/"):
            path = os.path.normpath(part)
            if not path.startswith(_PSEUDO_FS) and path != "/":
                yield path
