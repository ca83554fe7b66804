"""Zombie reaping when envd is the sandbox's PID 1.

Orphaned grandchildren (``cmd &`` whose shell exited) are re-parented to PID 1, which must wait()
for them. A blanket waitpid(-1) would steal exit statuses asyncio waits for, so only zombies that
are not envd's own managed children are reaped, by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator

_INTERVAL = 2.0


def _stat_fields() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name) of every process."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        yield int(name), fields


def _zombie_children(parent: int) -> list[int]:
    return [pid for pid, f in _stat_fields() if len(f) >= 2 and f[0] == "Z" and int(f[1]) == parent]


def session_members(session: int) -> list[int]:
    """Processes (zombies aside) still in ``session``: what a process left running behind it."""
    return [pid for pid, f in _stat_fields() if len(f) >= 4 and f[0] != "Z" and int(f[3]) == session]


def reap_once(managed: Callable[[], set[int] | None]) -> int:
    """``managed()`` (envd's own children, spawn.Spawner.live_pids) is None while a start is in
    flight (its pid is not known yet): skip then."""
    reaped = 0
    own = managed()
    if own is None:
        return 0
    for pid in _zombie_children(os.getpid()):
        if pid in own:
            continue
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped += 1
    return reaped


async def reap_orphans_forever(managed: Callable[[], set[int] | None]) -> None:
    if os.getpid() != 1:
        return
    while True:
        await asyncio.sleep(_INTERVAL)
        reap_once(managed)
