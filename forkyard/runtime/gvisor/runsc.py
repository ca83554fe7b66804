"""Driving one runsc binary: its command lines, detached starts, container state, the platform it
runs sandboxes on, and the host processes that serve a container.

forkyard drives the runsc release it pins (scripts/bootstrap.sh installs it; :data:`MIN_RELEASE`):
older builds lack what the runtime relies on (``--compression``, ``--leave-running`` that works,
``--net-disconnect-ok``, systrap) and :meth:`Runsc.unsupported_reason` refuses them.

forkyard stops containers itself (SIGKILL of the sandbox and gofer processes, then removal of
runsc's state files and control socket): ``runsc delete --force`` does the same but costs
1.3-1.6 s, most of it polling processes that are already gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from forkyard.config import GvisorSettings
from forkyard.errors import Failed
from forkyard.runtime.base import log_tail
from forkyard.runtime.gvisor import control, platforms
from forkyard.runtime.gvisor.paths import SandboxPaths

log = logging.getLogger(__name__)

#: Seconds a ``runsc run`` or ``runsc restore`` may take to report the container started.
START_TIMEOUT = 120.0
#: Seconds the sandbox and gofer processes of a killed container get to exit.
REAP_TIMEOUT = 10.0
#: The oldest runsc release (the date in ``runsc --version``) this runtime drives.
MIN_RELEASE = 20240729
#: Where runsc puts a sandbox's control socket ``runsc-<cid>.sock``: the first of these where it
#: can create one. A SIGKILLed sandbox leaves its socket behind, and a container id whose
#: sockets fill all of them cannot start again ("unable to find location to write socket file").
CONTROL_SOCKET_DIRS = (Path("/var/run"), Path("/run"), Path("/tmp"))

#: Platform chosen by ``auto``, per runsc binary and cache file (the file is read once per process).
_auto_platforms: dict[tuple[str, Path], str] = {}


class Runsc:
    """One runsc binary with one state directory (``--root``)."""

    def __init__(
        self,
        settings: GvisorSettings,
        root: Path,
        probe_dir: Path,
        platform_cache: Path = platforms.CACHE_FILE,
    ) -> None:
        self.binary = settings.runsc_path
        self.root = root
        self._platform = settings.platform
        #: Scratch state directory of the ``auto`` platform measurement.
        self._probe_dir = probe_dir
        self._platform_cache = platform_cache

    # -- version and platform ------------------------------------------------------------------

    def unsupported_reason(self) -> str | None:
        """None when the binary runs and is at least :data:`MIN_RELEASE`, else why not."""
        try:
            proc = subprocess.run([self.binary, "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{self.binary} --version failed: {exc}"
        output = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            return f"{self.binary} --version failed: {output[-500:]}"
        found = re.search(r"(\d{8})\.\d+", output)
        if found is None or int(found.group(1)) < MIN_RELEASE:
            return (
                f"{self.binary} is {output.splitlines()[0] if output else 'of no known version'}; forkyard "
                f"needs release {MIN_RELEASE} or later (scripts/bootstrap.sh installs the pinned build)"
            )
        return None

    def platform(self) -> str:
        """The configured platform, or for ``auto`` the one measured fastest here (see
        :mod:`~forkyard.runtime.gvisor.platforms`; cached on disk per binary and kernel)."""
        if self._platform != "auto":
            return self._platform
        key = (self.binary, self._platform_cache)
        if key not in _auto_platforms:
            probe = Runsc(
                GvisorSettings(runsc_path=self.binary, platform="ptrace"), self._probe_dir, self._probe_dir
            )
            _auto_platforms[key] = platforms.choose(probe, self._platform_cache)
        return _auto_platforms[key]

    @staticmethod
    def sandbox_flags(platform: str, *, network: str = "sandbox") -> list[str]:
        """Global flags of every command that starts a sandbox (run, restore)."""
        return [
            "--platform",
            platform,
            "--network",
            network,
            # The root is our host overlay (sealed layers, a private upper): no second overlay in
            # the sentry, whose upper (runsc's default, root:self) would hide every write from it.
            "--overlay2=none",
            # A checkpoint drops connected TCP endpoints instead of refusing to save them: a
            # sandbox with open connections (outbound ones included) can be paused.
            "--net-disconnect-ok",
            # nproc inside is the template's vCPUs (the cgroup's CPU quota), not the node's cores.
            "--cpu-num-from-quota",
        ]

    # -- commands ------------------------------------------------------------------------------

    def command(self, *args: str, log_file: Path | None = None) -> list[str]:
        cmd = [self.binary, "--root", str(self.root)]
        if log_file is not None:
            cmd += ["--log", str(log_file)]
        return [*cmd, *args]

    async def run(self, *args: str, check: bool = True, limit: float = 60.0) -> tuple[int, str]:
        """Run ``runsc <args>``: (exit code, stdout+stderr); a failure raises unless not ``check``."""
        proc = await asyncio.create_subprocess_exec(
            *self.command(*args),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), limit)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise Failed(f"runsc {' '.join(args[:2])} timed out after {limit:.0f}s") from None
        text = out.decode(errors="replace").strip()
        if check and proc.returncode != 0:
            raise Failed(f"runsc {' '.join(args[:2])} failed: {text[-2000:]}")
        return proc.returncode or 0, text

    async def start(self, paths: SandboxPaths, *, image: Path | None = None) -> None:
        """Start the container of ``paths``' OCI bundle detached (``runsc run``, or with ``image``
        ``runsc restore`` of that checkpoint); its output goes to envd.log.

        A start that failed because the container's control socket was still bound ("address
        already in use": a socket file left by a killed sandbox of the same id, or its process
        not yet gone) is retried once after the container is stopped and forgotten: nothing of
        the failed attempt ran, so trying again is safe."""
        try:
            await self._start(paths, image)
        except Failed as exc:
            if "address already in use" not in str(exc):
                raise
            log.warning("runsc start of %s: control socket in use; retrying once", paths.sandbox_id)
            await self.stop(paths)
            await self._start(paths, image)

    async def _start(self, paths: SandboxPaths, image: Path | None) -> None:
        verb = ["run"] if image is None else ["restore", "--image-path", str(image)]
        paths.sentry_pid_file.unlink(missing_ok=True)
        cmd = self.command(
            *self.sandbox_flags(self.platform()),
            *verb,
            "--detach",
            # The sentry's pid, so that watching the sandbox needs no `runsc state` (a CLI start,
            # ~20 ms wall and ~10 ms of CPU) after every start.
            "--pid-file",
            str(paths.sentry_pid_file),
            "--bundle",
            str(paths.bundle),
            paths.container_id,
            log_file=paths.runsc_log,
        )
        with paths.envd_log.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *hide_proc_sys_net(cmd),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
            try:
                code = await asyncio.wait_for(proc.wait(), START_TIMEOUT)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise Failed(
                    f"runsc {verb[0]} of sandbox {paths.sandbox_id} did not finish "
                    f"within {START_TIMEOUT:.0f}s"
                ) from None
        if code != 0:
            raise Failed(
                f"runsc {verb[0]} of sandbox {paths.sandbox_id} failed (exit {code}): "
                f"{log_tail(paths.runsc_log)}"
            )

    async def status(self, cid: str) -> str:
        """runsc's status of container ``cid`` (``running``, ``stopped``, ...), ``absent`` if none."""
        code, out = await self.run("state", cid, check=False)
        if code != 0:
            return "absent"
        try:
            return str(json.loads(out).get("status", "unknown"))
        except json.JSONDecodeError:
            return "unknown"

    async def sandbox_pid(self, cid: str) -> int | None:
        """The host pid of container ``cid``'s runsc sandbox process (the sentry), if any."""
        code, out = await self.run("state", cid, check=False)
        if code != 0:
            return None
        try:
            pid = json.loads(out).get("pid")
        except json.JSONDecodeError:
            return None
        return pid if isinstance(pid, int) and pid > 0 else None

    async def containers(self) -> list[str]:
        """Ids of the containers runsc knows under this root."""
        code, out = await self.run("list", "-quiet", check=False)
        return out.split() if code == 0 else []

    # -- pausing in the sentry ------------------------------------------------------------------

    async def pause(self, cid: str) -> None:
        """Stop every task of the container in the sentry (which keeps answering: a checkpoint
        may follow). Over the control socket; the CLI when the socket is not known."""
        await self._lifecycle_call(cid, control.PAUSE, "pause")

    async def resume(self, cid: str) -> None:
        """Undo :meth:`pause`."""
        await self._lifecycle_call(cid, control.RESUME, "resume")

    async def _lifecycle_call(self, cid: str, method: str, verb: str) -> None:
        socket = control.socket_path(self.state_file(cid))
        if socket is None:
            await self.run(verb, cid)
            return
        await control.call(socket, method)

    def state_file(self, cid: str) -> Path:
        return self.root / f"{cid}_sandbox:{cid}.state"

    # -- stopping ------------------------------------------------------------------------------

    async def stop(self, paths: SandboxPaths) -> None:
        """SIGKILL the container's processes, wait until they are gone, and drop runsc's record of
        it. The cgroups stay (a restore reuses them, a kill removes them)."""
        await self._reap(paths)
        self.forget(paths.container_id)

    def kill_all(self) -> None:
        """SIGKILL every runsc process under this root (the platform probe's clean-up)."""
        for pid in self._pids_under_root(()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def processes(self, paths: SandboxPaths) -> list[int]:
        """PIDs of the runsc processes (sandbox, gofer, ...) serving the container of ``paths``:
        the sandbox process names the container id, the gofer only its bundle (inside
        ``paths.root``). The gofer must be gone too before the sandbox's root overlay can be
        unmounted and its upper sealed."""
        return self._pids_under_root((paths.container_id, f"{paths.root}/"))

    def _pids_under_root(self, markers: tuple[str, ...]) -> list[int]:
        """runsc processes of this root with an argument naming one of ``markers`` (any if none)."""
        pids = []
        for pid, argv in _runsc_command_lines():
            in_root = f"--root={self.root}" in argv or str(self.root) in argv
            if in_root and (not markers or any(m in arg for arg in argv for m in markers)):
                pids.append(pid)
        return pids

    async def _reap(self, paths: SandboxPaths) -> None:
        deadline = time.monotonic() + REAP_TIMEOUT
        while pids := self.processes(paths):
            exited = await _kill_and_wait(pids, within=max(0.0, deadline - time.monotonic()))
            if exited:  # each pidfd said so: no second scan of /proc (5-10 ms) to confirm
                return
            if time.monotonic() > deadline:
                raise Failed(f"runsc processes {pids} of sandbox {paths.sandbox_id} do not exit")

    def forget(self, cid: str) -> None:
        """Remove what runsc keeps of a stopped container: its record and its control sockets."""
        files = [self.state_file(cid), self.root / f"{cid}_sandbox:{cid}.lock"]
        files += [d / f"runsc-{cid}.sock" for d in (self.root, *CONTROL_SOCKET_DIRS)]
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def hide_proc_sys_net(cmd: list[str]) -> list[str]:
    """Wrap a runsc command that starts a sandbox (run, create, restore) for this runsc.

    runsc (the 2022-12 and the 2024-07 builds alike) decides it was handed the root network
    namespace when ``/proc/sys/net/core/rmem_default`` exists, which on kernels >= 5.x it does in
    every namespace, so ``--network sandbox`` refuses all of them ("cannot run with network
    enabled in root network namespace"). In a private mount namespace
    with an empty, read-only /proc/sys/net the check sees no file; runsc reads nothing else
    there (gVisor's netstack has its own sysctls)."""
    script = 'mount -t tmpfs -o ro,size=4k forkyard-hide /proc/sys/net && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd]


async def _kill_and_wait(pids: list[int], within: float) -> bool:
    """SIGKILL ``pids`` and wait (at most ``within`` seconds) until all have exited; True if they did.

    Waits on pidfds, which become readable when their process exits, rather than polling: a
    sandbox's processes die in a few milliseconds, and a 50 ms sleep between scans of /proc was
    most of a kill's time. Each pidfd is opened before its signal, so a pid reused after the exit
    cannot be mistaken for the process."""
    loop = asyncio.get_running_loop()
    exits: list[asyncio.Future[None]] = []
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            fds.append(fd)
            exit_seen: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _resolve, exit_seen)
            exits.append(exit_seen)
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        if not exits:
            return True
        _, pending = await asyncio.wait(exits, timeout=within)
        return not pending
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _runsc_command_lines() -> list[tuple[int, list[str]]]:
    """(pid, argv) of every runsc process on the host."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        argv = [arg.decode(errors="replace") for arg in raw]
        if argv[0].startswith("runsc"):
            found.append((int(entry.name), argv))
    return found
