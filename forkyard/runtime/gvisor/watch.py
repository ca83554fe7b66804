"""Noticing that a gVisor sandbox died: a pidfd on its runsc sandbox process (the sentry).

Whatever ends a sandbox (the host OOM killer, a sentry panic, ``kill -9``, its init envd
exiting) ends that process, and a pidfd becomes readable the moment it does: one file
descriptor in the event loop per running sandbox, no polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from forkyard.runtime.gvisor import cgroups


def sentry_pid(container_id: str, pid: int | None) -> int | None:
    """``pid`` when it is the live runsc sandbox process of ``container_id`` (runsc state's pid),
    else None."""
    if not pid:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    names_it = any(container_id.encode() in arg for arg in argv)
    return pid if names_it and argv[0].startswith(b"runsc") else None


def read_pid(path: Path) -> int | None:
    """The pid in a pid file runsc wrote, or None (no file, not a number)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def find_sentry(container_id: str) -> int | None:
    """The pid of ``container_id``'s runsc sandbox process, found by its command line: for a
    frozen sandbox, whose ``runsc state`` would hang on the frozen sentry."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].startswith(b"runsc-sandbox") and container_id.encode() in argv:
            return int(entry.name)
    return None


async def wait_pid(pid: int) -> None:
    """Return once process ``pid`` has exited (at once when it is gone already)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def death_reason(sandbox_id: str, pid: int, oom_kills_before: int, output_tail: str) -> str:
    """What is known of why the sandbox process ``pid`` ended."""
    reason = f"its runsc sandbox process (pid {pid}) exited"
    kills = cgroups.oom_kills(sandbox_id) - oom_kills_before
    if kills > 0:
        reason += f"; the host OOM killer killed {kills} of its processes (memory limit reached)"
    if "panic" in output_tail:
        with contextlib.suppress(ValueError):
            reason += "; runsc: " + output_tail[output_tail.index("panic") :][:300]
    elif output_tail.strip():
        reason += "; last output: " + output_tail.strip().splitlines()[-1][:300]
    return reason
