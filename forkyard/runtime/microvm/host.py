"""Host-side helpers of the microVM runtimes: their VM processes and the wait for envd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil

from forkyard.errors import Failed
from forkyard.runtime.base import envd_healthy, log_tail

#: Whether the VM process is still there (checked while waiting for envd).
Alive = Callable[[], Awaitable[bool]]


def pid_alive(pid: int | None, name_part: str, owner: str | None = None) -> bool:
    """Whether ``pid`` is a live ``name_part`` process (and, with ``owner``, one whose command
    line mentions it: a recycled pid of another sandbox's VM is not ours).

    A VM started as ``nsenter --net=... -- <vmm> ...`` is ``nsenter`` until it has entered the
    namespace and exec'd the VMM in place: that counts as the VMM. (On a busy host this took long
    enough that the wait for a VMM's API socket saw "no VMM" and gave up, and the clean-up after
    it left the VMM running: found by the emulated KVM host's tests under load.)"""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        argv = proc.cmdline()
    except psutil.Error:
        return False
    starting = bool(argv) and os.path.basename(argv[0]) == "nsenter" and any(name_part in a for a in argv[1:])
    named = starting or any(name_part in a for a in argv[:1])
    return named and (owner is None or any(owner in a for a in argv))


async def kill_pid(pid: int | None, name_part: str, owner: str | None = None, limit_s: float = 10.0) -> None:
    """SIGKILL a VM process (it holds no state worth a graceful stop) and wait until it is gone."""
    if pid is None or not pid_alive(pid, name_part, owner):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + limit_s
    while pid_alive(pid, name_part, owner) and time.monotonic() < deadline:  # noqa: ASYNC110  # polling another process
        await asyncio.sleep(0.02)


async def wait_for_envd(url: str, limit_s: float, alive: Alive, console: Path, interval: float = 0.1) -> None:
    """Poll envd's /health until it answers 204/200; fail early when the VM died."""
    deadline = time.monotonic() + limit_s
    while not await envd_healthy(url):
        if not await alive():
            raise Failed(f"the VM exited before envd answered; console:\n{log_tail(console)}")
        if time.monotonic() > deadline:
            raise Failed(f"envd did not answer within {limit_s:.0f}s; console:\n{log_tail(console)}")
        await asyncio.sleep(interval)
