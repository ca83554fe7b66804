"""Freezing a gVisor sandbox in place: the cgroup freezer of the sandbox's cgroup.

A frozen sandbox keeps its memory, its processes, its network namespace and address; only its
threads stop being scheduled. Freezing costs a write and a few reads of the cgroup file
(about a millisecond), where ``runsc pause`` costs a runsc start (25-60 ms here) for the same
write. runsc's own record keeps saying "running". Every runsc command that talks to the sentry
(``runsc state`` included) hangs on a frozen sandbox, so whether it is alive is read from its
cgroup (:func:`has_tasks`), and a checkpoint or a kill thaws it first (cgroup v1 delivers no
SIGKILL to a frozen task until it is thawed).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agentenv.errors import Failed, NotSupported
from agentenv.runtime.gvisor.cgroups import CGROUP_PARENT, CGROUP_V1_ROOT

#: How long the kernel may take to stop (or restart) every task of the cgroup.
SETTLE_SECONDS = 5.0


def _v1_state(sandbox_id: str) -> Path:
    return CGROUP_V1_ROOT / "freezer" / CGROUP_PARENT / sandbox_id / "freezer.state"


def _v2_freeze(sandbox_id: str) -> Path:
    return CGROUP_V1_ROOT / CGROUP_PARENT / sandbox_id / "cgroup.freeze"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def is_frozen(sandbox_id: str) -> bool:
    if _v1_state(sandbox_id).exists():
        return _read(_v1_state(sandbox_id)) == "FROZEN"
    events = _v2_freeze(sandbox_id).with_name("cgroup.events")
    return "frozen 1" in _read(events)


def has_tasks(sandbox_id: str) -> bool:
    """Whether the sandbox's freezer cgroup still holds processes (a frozen sandbox is alive)."""
    tasks = _v1_state(sandbox_id).with_name("tasks")
    if not tasks.exists():
        tasks = _v2_freeze(sandbox_id).with_name("cgroup.procs")
    return bool(_read(tasks))


async def freeze(sandbox_id: str) -> None:
    await _set(sandbox_id, frozen=True)


async def thaw(sandbox_id: str) -> None:
    """Idempotent: thawing a sandbox that is not frozen (or has no cgroup any more) does nothing."""
    if _v1_state(sandbox_id).exists() or _v2_freeze(sandbox_id).exists():
        await _set(sandbox_id, frozen=False)


async def _set(sandbox_id: str, *, frozen: bool) -> None:
    v1, v2 = _v1_state(sandbox_id), _v2_freeze(sandbox_id)
    if v1.exists():
        target, write, done = (
            v1,
            "FROZEN" if frozen else "THAWED",
            lambda: _read(v1) == ("FROZEN" if frozen else "THAWED"),
        )
    elif v2.exists():
        target, write, done = v2, "1" if frozen else "0", lambda: is_frozen(sandbox_id) == frozen
    else:
        raise NotSupported(f"sandbox {sandbox_id} has no freezer cgroup")
    try:
        target.write_text(write)
    except OSError as exc:
        raise Failed(f"{'freezing' if frozen else 'thawing'} sandbox {sandbox_id} failed: {exc}") from exc
    deadline = time.monotonic() + SETTLE_SECONDS
    delay = 0.0005
    while not done():
        if time.monotonic() > deadline:
            raise Failed(
                f"sandbox {sandbox_id} did not {'freeze' if frozen else 'thaw'} within {SETTLE_SECONDS:.0f}s"
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)
