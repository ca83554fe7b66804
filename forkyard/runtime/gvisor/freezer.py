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
import contextlib
import time
from pathlib import Path

from forkyard.errors import Failed, NotSupported
from forkyard.runtime.gvisor.cgroups import CGROUP_PARENT, CGROUP_V1_ROOT

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
    """Freeze every task of the sandbox; on failure the sandbox is thawed again and left running
    (a cgroup stuck half-frozen would hang every later runsc command on it)."""
    try:
        await _set(sandbox_id, frozen=True)
    except Failed:
        with contextlib.suppress(Failed):
            await _set(sandbox_id, frozen=False)
        raise


async def thaw(sandbox_id: str) -> None:
    """Idempotent: thawing a sandbox that is not frozen (or has no cgroup any more) does nothing."""
    if _v1_state(sandbox_id).exists() or _v2_freeze(sandbox_id).exists():
        await _set(sandbox_id, frozen=False)


#: While a v1 freeze reads FREEZING, FROZEN is written again every poll, and every this many
#: polls the cgroup is thawed for a moment first. The v1 freezer signals the cgroup's tasks once
#: per write, and a task that misses it is left running with the cgroup in FREEZING (CI here saw
#: one freeze of a ptrace-platform sandbox stuck so for 5 s); runc and youki rewrite for the same
#: reason, with the same occasional thaw. cgroup v2 freezes reliably with one write.
REFREEZE_THAW_EVERY = 50


async def _set(sandbox_id: str, *, frozen: bool) -> None:
    v1, v2 = _v1_state(sandbox_id), _v2_freeze(sandbox_id)
    verb = "freeze" if frozen else "thaw"
    if v1.exists():
        wanted = "FROZEN" if frozen else "THAWED"
        target, write = v1, wanted

        def done() -> bool:
            return _read(v1) == wanted

    elif v2.exists():
        target, write = v2, "1" if frozen else "0"

        def done() -> bool:
            return is_frozen(sandbox_id) == frozen

    else:
        raise NotSupported(f"sandbox {sandbox_id} has no freezer cgroup")
    _write(target, write, sandbox_id, verb)
    deadline = time.monotonic() + SETTLE_SECONDS
    delay, polls = 0.0005, 0
    while not done():
        if time.monotonic() > deadline:
            raise Failed(f"sandbox {sandbox_id} did not {verb} within {SETTLE_SECONDS:.0f}s")
        await asyncio.sleep(delay)
        delay, polls = min(delay * 2, 0.02), polls + 1
        if target is v1 and frozen:
            if polls % REFREEZE_THAW_EVERY == 0:
                _write(v1, "THAWED", sandbox_id, verb)
                await asyncio.sleep(0.01)
            _write(v1, "FROZEN", sandbox_id, verb)


def _write(target: Path, value: str, sandbox_id: str, verb: str) -> None:
    try:
        target.write_text(value)
    except OSError as exc:
        raise Failed(f"{verb} of sandbox {sandbox_id} failed: {exc}") from exc
