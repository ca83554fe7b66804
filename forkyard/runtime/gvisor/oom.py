"""A sandbox's memory limit kills the hog inside, not the sandbox.

Left to the host, a sandbox over its memory cgroup's limit loses the whole sandbox: the host
OOM killer picks the host process with the most memory, the ptrace stub of the hog's address
space, and the sentry kills itself when one of its stubs dies by SIGKILL (gVisor's
``subprocess.go``: "The ptrace stub process ... has been killed by SIGKILL"; measured here with
a Python allocation loop in a 256 MiB sandbox). Or it picks the sentry itself, whose memory
holds /tmp and the page cache.

So while a sandbox runs, its cgroup's OOM killer is off (``memory.oom_control`` = 1: at the
limit its tasks wait instead) and an eventfd on ``memory.oom_control`` wakes its :class:`Guard`
when the cgroup is out of memory. The guard lends the cgroup :data:`SLACK_BYTES` (or its limit) above its
limit, kills the process inside with the largest resident set (never envd, pid 1) through
``runsc exec`` of the envd bundle's Python (the same choice Linux's OOM killer makes inside a
VM), and takes the loan back. The sandbox sees MemTotal = its limit (runsc reports the cgroup
limit), the hog dies by SIGKILL (exit 137, as under Linux), envd and the rest live on. If the kill cannot
run (the hog ate the loan first: ``runsc exec`` times out), the kernel's OOM killer is let back
in rather than leave the sandbox hanging at its limit. When the
guard is not running (between operations, a server that is down) the kernel's OOM killer is
back on: the sandbox may die then, and that death is noticed like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from forkyard.errors import Failed
from forkyard.runtime.gvisor.cgroups import CGROUP_PARENT, CGROUP_V1_ROOT
from forkyard.runtime.gvisor.paths import SandboxPaths
from forkyard.runtime.gvisor.runsc import Runsc
from forkyard.storage.envd_bundle import envd_argv

log = logging.getLogger(__name__)

#: Memory lent to an out-of-memory sandbox so that the kill inside can run (a Python start):
#: at least this, or the whole limit. The loan wakes the hog too, which keeps allocating until
#: the kill lands (100-200 ms of ``runsc exec`` under ptrace, more under systrap, whose process
#: starts cost twice as much here): a loan it eats up first leaves the exec stuck (then the
#: kernel's OOM killer is let back in, see :func:`_relieve`). Half the limit was seen eaten
#: first under systrap (the hog's command hung at the limit until its client gave up).
SLACK_BYTES = 256 << 20
#: Seconds the kill inside may take.
KILL_TIMEOUT = 10.0

#: Run inside as root: SIGKILL the process with the largest VmRSS, except envd (pid 1) and
#: itself; print "<pid> <rss kB> <name>" of the victim ("0 0 " when there was none).
KILL_LARGEST = """
import os
best = (0, 0, "")
for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) in (1, os.getpid()):
        continue
    try:
        with open("/proc/%s/status" % name) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        rss = int(fields.get("VmRSS", "0 kB").split()[0])
    except (OSError, ValueError):
        continue
    if rss > best[1]:
        best = (int(name), rss, fields.get("Name", "").strip())
if best[0]:
    os.kill(best[0], 9)
print(best[0], best[1], best[2])
"""


def _memory_group(sandbox_id: str) -> Path:
    return CGROUP_V1_ROOT / "memory" / CGROUP_PARENT / sandbox_id


def _under_oom(group: Path) -> bool:
    with contextlib.suppress(OSError):
        return "under_oom 1" in (group / "memory.oom_control").read_text()
    return False


class Guard:
    """The OOM guard of one running sandbox: armed synchronously (the kernel's OOM killer is off
    and the eventfd registered before the sandbox is handed out), then a task that waits."""

    def __init__(self, runsc: Runsc, paths: SandboxPaths, report: Path) -> None:
        self.runsc, self.paths, self.report = runsc, paths, report
        self.group = _memory_group(paths.sandbox_id)
        self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._ofd = os.open(self.group / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        self._woken = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        try:
            (self.group / "cgroup.event_control").write_text(f"{self._efd} {self._ofd}")
            (self.group / "memory.oom_control").write_text("1")
        except OSError:
            self._close_fds()
            raise
        self._loop.add_reader(self._efd, self._woken.set)
        self.task = asyncio.create_task(self._run(), name=f"oom-{paths.sandbox_id}")
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the OOM guard of sandbox %s failed: %r", self.paths.sandbox_id, task.exception())

    @classmethod
    def arm(cls, runsc: Runsc, paths: SandboxPaths, report: Path) -> Guard | None:
        """A guard for the sandbox, or None where it has no v1 memory cgroup (the kernel's OOM
        killer then stays in charge)."""
        if not (_memory_group(paths.sandbox_id) / "memory.oom_control").is_file():
            return None
        try:
            return cls(runsc, paths, report)
        except OSError as exc:
            log.warning("no OOM guard for sandbox %s: %s", paths.sandbox_id, exc)
            return None

    async def _run(self) -> None:
        while True:
            await self._woken.wait()
            self._woken.clear()
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._efd)
            while _under_oom(self.group):
                await _relieve(self.runsc, self.paths, self.group, self.report)

    def close(self) -> None:
        """Stop guarding: the kernel's OOM killer is back on for the cgroup (if it still exists)."""
        self.task.cancel()
        self._loop.remove_reader(self._efd)
        with contextlib.suppress(OSError):
            (self.group / "memory.oom_control").write_text("0")
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._ofd, self._efd):
            with contextlib.suppress(OSError):
                os.close(fd)


async def _relieve(runsc: Runsc, paths: SandboxPaths, group: Path, report: Path) -> None:
    """Lend the slack, kill the largest process inside, take the slack back."""
    limit_file = group / "memory.limit_in_bytes"
    limit = int(limit_file.read_text())
    limit_file.write_text(str(limit + max(SLACK_BYTES, limit)))
    try:
        argv = [*envd_argv()[:4], "-I", "-c", KILL_LARGEST]
        try:
            code, out = await runsc.run("exec", paths.container_id, *argv, check=False, limit=KILL_TIMEOUT)
        except Failed as exc:  # timed out
            code, out = -1, str(exc)
        victim = out.strip().splitlines()[-1] if out.strip() else ""
        message = f"out of memory: killed pid {victim.split(' ', 1)[0]} inside" if code == 0 else ""
        if code != 0 or victim.startswith("0 "):
            message = f"out of memory and no process to kill inside (runsc exec exit {code}: {out[-300:]})"
            # Never leave it hanging at its limit: the kernel's OOM killer takes over (the
            # sandbox may die of it, which is noticed like any death).
            with contextlib.suppress(OSError):
                (group / "memory.oom_control").write_text("0")
        log.warning("sandbox %s %s (%s)", paths.sandbox_id, message, victim)
        _append(report, f"forkyard: {message} ({victim} kB)\n")
    finally:
        await _restore_limit(limit_file, limit)


async def _restore_limit(limit_file: Path, limit: int) -> None:
    """Set the limit back; the kernel refuses while usage is above it (the victim's memory is
    still being freed): retry for a while, then keep the loan (logged) rather than fail."""
    for _ in range(50):
        if _write(limit_file, str(limit)):
            return
        await asyncio.sleep(0.02)
    log.warning("%s: could not set the memory limit back to %d (usage above it)", limit_file, limit)


def _write(path: Path, text: str) -> bool:
    """Write a cgroup file (microseconds: no thread needed); False when the kernel refuses."""
    try:
        path.write_text(text)
    except OSError:
        return False
    return True


def _append(path: Path, line: str) -> None:
    with contextlib.suppress(OSError), open(path, "a") as f:
        f.write(line)
