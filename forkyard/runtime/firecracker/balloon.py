"""The balloon of a microVM about to freeze: idle guest memory given back to the host.

A frozen sandbox (the first pause tier) keeps its VMM, and with it every guest page it ever
touched, resident on the host. Before the vCPUs stop, :func:`inflate_for_freeze` asks the guest's
balloon driver for all of its available memory (free pages and the page cache the guest can drop)
but a reserve; Firecracker discards each page the driver hands over (``madvise(MADV_DONTNEED)``),
so the VMM's resident set shrinks by that much. The thaw deflates the balloon (:func:`deflate`);
meanwhile ``deflate_on_oom`` (set at boot, :func:`forkyard.runtime.firecracker.api.balloon`) lets
the guest take pages back rather than OOM-kill a process. Pages come back zero-filled (anonymous
memory) or from the snapshot file (a File-backed restore), on first touch.

Releases with free page reporting (v1.14+) also return pages a running guest frees; this covers
frozen guests on every supported release.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from forkyard.runtime.firecracker import api

#: Seconds between looks at the balloon while it inflates, and without progress (once the guest
#: has started giving) before giving up: a guest short of free memory stops short of the target.
POLL_SECONDS = 0.25
STALL_SECONDS = 2.0


@dataclass(frozen=True)
class Inflation:
    """What a freeze asked of the balloon and what the guest gave (MiB)."""

    target_mib: int
    actual_mib: int
    available_mib: int | None

    def summary(self) -> str:
        if self.available_mib is None:
            return "balloon not inflated (no memory report from the guest yet)"
        return (
            f"balloon {self.actual_mib} of {self.target_mib} MiB asked ({self.available_mib} MiB available)"
        )


async def inflate_for_freeze(client: api.FirecrackerClient, *, keep_mib: int, within: float) -> Inflation:
    """Inflate the balloon by the guest's available memory but ``keep_mib``; wait until the guest
    has given that much, stopped giving for :data:`STALL_SECONDS` after it started, or ``within``
    seconds passed (a busy guest takes a while to start)."""
    stats = await client.send(api.balloon_statistics())
    actual = int(stats.get("actual_mib", 0))
    available = stats.get("available_memory")
    if available is None:
        return Inflation(actual, actual, None)
    available_mib = int(available) >> 20
    target = actual + max(0, available_mib - keep_mib)
    if target <= actual:
        return Inflation(target, actual, available_mib)
    await client.send(api.balloon_update(target))
    deadline = time.monotonic() + within
    started = actual
    progress_at = time.monotonic()
    while actual < target and time.monotonic() < deadline:
        await asyncio.sleep(POLL_SECONDS)
        now = int((await client.send(api.balloon_statistics())).get("actual_mib", 0))
        if now > actual:
            actual, progress_at = now, time.monotonic()
        elif actual > started and time.monotonic() - progress_at > STALL_SECONDS:
            break
    return Inflation(target, actual, available_mib)


async def deflate(client: api.FirecrackerClient) -> None:
    """Give the guest its memory back (it deflates on its own time; deflate-on-OOM meanwhile)."""
    await client.send(api.balloon_update(0))
