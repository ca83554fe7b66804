"""The sudo broker: ``sudo`` for the sandbox's users where set-uid programs cannot work.

gVisor runs a sandbox's processes with the "no new privileges" flag, so the set-uid bit of
/usr/bin/sudo is ignored and sudo refuses to run. E2B's default user has passwordless sudo
(templates and agent code use ``sudo apt-get install``, ``sudo systemctl ...``). envd is root, so
it starts those commands instead: the gVisor runtime mounts ``/.forkyard/bin/sudo`` (process/sudo_client.py)
over /usr/bin/sudo; that client connects to envd on an abstract Unix socket and hands over its
command line, environment, working directory and its stdin/stdout/stderr (SCM_RIGHTS: the
command writes to the caller's pipes or terminal directly). envd learns who asks from the
kernel (SCM_CREDENTIALS: the caller's uid, which no process can fake), allows root and members of
the ``sudo``/``wheel``/``admin`` groups (E2B's ``user`` is in ``sudo``; there are no passwords),
starts the command as the target user, relays the caller's signals to it and answers its exit
code, which the client exits with. A caller that dies (SIGKILL) takes the command with it, as
killing sudo's process group would.

The broker listens only when envd is PID 1 (in a sandbox): an envd run on a host for tests must not
offer root to the host's users.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import grp
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
from typing import Any

from forkyard.envd.process import sudo_args
from forkyard.envd.process.spawn import Identity, Spawner, Stdio
from forkyard.envd.process.sudo_args import SudoCommandLine, SudoUsageError

logger = logging.getLogger("forkyard.envd")

#: Abstract socket (no file: nothing in the sandbox can replace it); the client knows the name.
SOCKET_NAME = b"\0forkyard-envd-sudo"
SUDO_GROUPS = ("sudo", "wheel", "admin")
#: What the client catches and envd passes on to the command's process group.
RELAYED_SIGNALS = frozenset(
    {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}
    | {signal.SIGWINCH, signal.SIGCONT}
)
_MAX_REQUEST = 1 << 20
#: struct ucred: pid, uid, gid.
_UCRED = struct.Struct("3i")
_RECEIVE_TIMEOUT_S = 10.0


class SudoRefusal(Exception):
    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def may_sudo(uid: int) -> bool:
    """Root, or a member of a group that sudoers of E2B-style templates give sudo to."""
    if uid == 0:
        return True
    try:
        entry = pwd.getpwuid(uid)
        groups = set(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except (KeyError, OSError):
        return False
    for name in SUDO_GROUPS:
        with contextlib.suppress(KeyError):
            if grp.getgrnam(name).gr_gid in groups:
                return True
    return False


def receive_request(conn: socket.socket) -> tuple[dict[str, object], list[int], int]:
    """The client's request (4-byte length, JSON), the fds it sent along and the uid it proved
    (blocking). The uid comes from SCM_CREDENTIALS, which the kernel checks (a process may only
    claim its own ids unless it has CAP_SETUID); SO_PEERCRED cannot be used: gVisor answers it
    with the asking process's own credentials (envd's: root), not the peer's."""
    conn.settimeout(_RECEIVE_TIMEOUT_S)
    fds = array.array("i")
    uids: list[int] = []
    space = socket.CMSG_SPACE(3 * fds.itemsize) + socket.CMSG_SPACE(_UCRED.size)
    data, ancdata, _flags, _addr = conn.recvmsg(65536, space)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
            uids.append(_UCRED.unpack(payload[: _UCRED.size])[1])
    if len(uids) != 1:
        for fd in fds:
            os.close(fd)
        raise SudoRefusal("sudo: the request did not carry its sender's credentials")
    if len(data) < 4:
        raise SudoRefusal("sudo: truncated request")
    size = int.from_bytes(data[:4], "big")
    if size > _MAX_REQUEST:
        raise SudoRefusal("sudo: request too large")
    body = bytearray(data[4:])
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise SudoRefusal("sudo: truncated request")
        body += chunk
    request = json.loads(body)
    if not isinstance(request, dict):
        raise SudoRefusal("sudo: malformed request")
    return request, list(fds), uids[0]


class SudoBroker:
    def __init__(self, spawner: Spawner) -> None:
        self._spawner = spawner
        self._server: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._sessions: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(SOCKET_NAME)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            logger.warning("the sudo broker cannot listen: %s", exc)
            return
        sock.setblocking(False)
        self._server = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_forever(sock))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._server is not None:
            self._server.close()

    async def _accept_forever(self, server: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(server)
            task = loop.create_task(self._session(conn))
            self._sessions.add(task)
            task.add_done_callback(self._sessions.discard)

    async def _session(self, conn: socket.socket) -> None:
        with conn:
            fds: list[int] = []
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
                request, fds, uid = await asyncio.to_thread(receive_request, conn)
                code = await self._run(conn, uid, request, fds)
            except SudoRefusal as exc:
                code = exc.exit_code
                await self._answer(conn, {"exit": code, "message": str(exc)})
                return
            except (OSError, ValueError) as exc:
                logger.warning("sudo request failed: %s", exc)
                await self._answer(conn, {"exit": 1, "message": f"sudo: {exc}"})
                return
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            await self._answer(conn, {"exit": code})

    async def _answer(self, conn: socket.socket, answer: dict[str, object]) -> None:
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            await asyncio.get_running_loop().sock_sendall(conn, json.dumps(answer).encode() + b"\n")

    async def _run(self, conn: socket.socket, uid: int, request: dict[str, object], fds: list[int]) -> int:
        argv, env, cwd = _request_fields(request)
        if len(fds) != 3:
            raise SudoRefusal("sudo: the request did not carry stdin, stdout and stderr")
        try:
            line = sudo_args.parse(argv)
        except SudoUsageError as exc:
            raise SudoRefusal(str(exc).rstrip("\n")) from None
        informational = _informational(line)
        if informational is not None:
            message, code = informational
            if message:
                os.write(fds[1] if code == 0 else fds[2], message.encode())
            return code
        caller = _caller(uid)
        if not may_sudo(uid):
            raise SudoRefusal(f"{caller.pw_name} is not in the sudoers file.")
        target = _target(line.user)
        argv_run, run_cwd, run_env = _command(line, target, caller, env, cwd)
        identity = _identity(target, line.group)
        try:
            popen = await self._spawner.start(
                argv_run, cwd=run_cwd, env=run_env, user=identity, stdio=Stdio(fds[0], fds[1], fds[2])
            )
        except OSError as exc:
            raise SudoRefusal(f"sudo: unable to execute {argv_run[0]}: {exc.strerror or exc}") from None
        for fd in fds:  # the command has them now; the caller's end closes with its own
            os.close(fd)
        fds.clear()
        if line.has("background"):
            self._spawner.wait(popen)
            return 0
        return await self._supervise(conn, popen)

    async def _supervise(self, conn: socket.socket, popen: subprocess.Popen[bytes]) -> int:
        """Relay the caller's signals until the command exits; SIGKILL it if the caller goes."""
        done = self._spawner.wait(popen)
        relay: asyncio.Future[Any] = asyncio.ensure_future(_relay_signals(conn, popen.pid))
        try:
            waiting: set[asyncio.Future[Any]] = {done, relay}
            finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if done not in finished:  # the caller is gone (killed): so is its command
                _signal_group(popen.pid, signal.SIGKILL)
            code = await done
        finally:
            relay.cancel()
        return 128 - code if code < 0 else code


async def _relay_signals(conn: socket.socket, pid: int) -> None:
    """Signals the client caught (one JSON line each) go to the command's process group;
    returns when the client closes its end (it died)."""
    loop = asyncio.get_running_loop()
    conn.setblocking(False)
    pending = b""
    while True:
        chunk = await loop.sock_recv(conn, 4096)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            with contextlib.suppress(ValueError, TypeError):
                number = int(json.loads(line)["signal"])
                if number in RELAYED_SIGNALS:
                    _signal_group(pid, number)


def _signal_group(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, number)


def _request_fields(request: dict[str, object]) -> tuple[list[str], dict[str, str], str]:
    argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd")
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise SudoRefusal("sudo: malformed request (argv)")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise SudoRefusal("sudo: malformed request (env)")
    return argv, env, cwd if isinstance(cwd, str) and cwd else "/"


def _informational(line: SudoCommandLine) -> tuple[str, int] | None:
    """(text, exit code) of what prints something or nothing and runs no command."""
    if line.has("help"):
        return sudo_args.USAGE, 0
    if line.has("version"):
        return sudo_args.SUDO_VERSION + "\n", 0
    if line.has("list"):
        return "User may run the following commands on sandbox:\n    (ALL : ALL) NOPASSWD: ALL\n", 0
    if line.has("reset_timestamp") or line.has("remove_timestamp") or line.has("validate"):
        if not line.command:
            return "", 0
    if not line.command and not (line.has("login") or line.has("shell")):
        return sudo_args.USAGE, 1
    return None


def _caller(uid: int) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        raise SudoRefusal(f"sudo: you do not exist in the passwd database (uid {uid})") from None


def _target(name: str) -> pwd.struct_passwd:
    try:
        if name.startswith("#") and name[1:].isdigit():
            return pwd.getpwuid(int(name[1:]))
        return pwd.getpwnam(name)
    except (KeyError, ValueError):
        raise SudoRefusal(f"sudo: unknown user {name}") from None


def _identity(target: pwd.struct_passwd, group: str | None) -> Identity:
    gid = target.pw_gid
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise SudoRefusal(f"sudo: unknown group {group}") from None
    try:
        groups = tuple(os.getgrouplist(target.pw_name, gid))
    except OSError:
        groups = (gid,)
    return Identity(target.pw_uid, gid, groups)


def _command(
    line: SudoCommandLine, target: pwd.struct_passwd, caller: pwd.struct_passwd, env: dict[str, str], cwd: str
) -> tuple[list[str], str, dict[str, str]]:
    """argv, cwd and environment of the command to start."""
    shell = target.pw_shell or "/bin/sh"
    run_env = sudo_args.command_env(
        env,
        line,
        (target.pw_name, target.pw_dir or "/", shell),
        (caller.pw_name, caller.pw_uid, caller.pw_gid),
    )
    run_cwd = line.chdir or cwd
    if line.has("login"):
        argv = sudo_args.shell_command(shell, line.command, login=True)
        run_cwd = line.chdir or target.pw_dir or "/"
    elif line.has("shell"):
        argv = sudo_args.shell_command(env.get("SHELL") or shell, line.command, login=False)
    else:
        argv = [_resolve_program(line.command[0], run_env["PATH"]), *line.command[1:]]
    if not os.path.isdir(run_cwd):
        raise SudoRefusal(f"sudo: unable to change directory to {run_cwd}: No such file or directory")
    return argv, run_cwd, run_env


def _resolve_program(name: str, path: str) -> str:
    if "/" in name:
        return name
    found = shutil.which(name, path=path)
    if found is None:
        raise SudoRefusal(f"sudo: {name}: command not found")
    return found
