"""Warm pools: sandboxes restored from a template's snapshot ahead of demand.

A create from a template whose pool holds a sandbox only claims it (a database row and envd's
``/init`` with the caller's env vars and access token) instead of restoring or booting. Each
pool has two watermarks: when a claim leaves fewer than ``low`` sandboxes, the pool is refilled,
one restore at a time, up to ``high``. ``high = 0`` turns pooling off.

A refill waits until no sandbox was claimed for ``quiet_seconds`` (at most
:data:`MAX_QUIET_WAITS` times that): a restore wants both cores of a small node for a few hundred
milliseconds, and right after a claim the client sends its first commands. Measured on a 2-core
machine: a claim's first command took 50-150 ms while a refill ran, 25-35 ms without one.

Pooled sandboxes are runtime instances without a database row, so a crashed server's start-up
clean-up (``Runtime.cleanup_orphans``) removes them like any other leak; a clean shut-down kills
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from forkyard.types import SandboxInstance

log = logging.getLogger(__name__)

#: Makes one pooled sandbox for a pool key (a restore of that template's snapshot).
Maker = Callable[[str], Awaitable[SandboxInstance]]
#: Destroys a pooled sandbox that is not wanted any more.
Killer = Callable[[SandboxInstance], Awaitable[None]]
#: The high watermark of one pool key, read before each sandbox a refill makes (a pool whose
#: demand grows is filled further by the refill already running).
HighFor = Callable[[str], int]
#: After a failed refill, wait this long before trying again (the failure is logged).
RETRY_SECONDS = 5.0
#: A refill waits for a quiet moment at most this many ``quiet_seconds`` (claims that never stop
#: must not leave the pool empty).
MAX_QUIET_WAITS = 5


@dataclass
class _Pool:
    ready: list[SandboxInstance] = field(default_factory=list)
    filler: asyncio.Task[None] | None = None


class WarmPool:
    def __init__(
        self,
        low: int,
        high: int,
        make: Maker,
        kill: Killer,
        quiet_seconds: float = 0.0,
        high_for: HighFor | None = None,
    ) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"warm pool watermarks must satisfy 0 <= low <= high, got {low}, {high}")
        self.low = low
        self.high = high
        self._high_for = high_for
        self.quiet_seconds = quiet_seconds
        self._last_claim = -float("inf")
        self._make = make
        self._kill = kill
        self._pools: dict[str, _Pool] = {}
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.high > 0

    def ready(self, key: str) -> int:
        """How many sandboxes of ``key`` wait to be claimed."""
        pool = self._pools.get(key)
        return len(pool.ready) if pool else 0

    def take(self, key: str) -> SandboxInstance | None:
        """A ready sandbox for ``key`` (removed from the pool), or None; refills below ``low``."""
        pool = self._pools.setdefault(key, _Pool())
        instance = pool.ready.pop(0) if pool.ready else None
        if instance is not None:
            self._last_claim = time.monotonic()
        if len(pool.ready) < self.low or not pool.ready:
            self.fill(key)
        return instance

    def high_of(self, key: str) -> int:
        """The high watermark of ``key`` (``high`` unless the pool was given ``high_for``)."""
        return self._high_for(key) if self._high_for is not None else self.high

    def fill(self, key: str) -> None:
        """Start filling ``key``'s pool up to ``high`` in the background (no-op if running)."""
        if not self.enabled or self._closed:
            return
        pool = self._pools.setdefault(key, _Pool())
        if pool.filler is None or pool.filler.done():
            pool.filler = asyncio.create_task(self._fill(key, pool), name=f"warm-pool-{key}")

    async def _fill(self, key: str, pool: _Pool) -> None:
        while not self._closed and len(pool.ready) < self.high_of(key):
            await self._quiet()
            started = time.monotonic()
            try:
                instance = await self._made(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("warm pool %s: making a sandbox failed: %s", key, exc)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if self._closed:
                await self._kill(instance)
                return
            pool.ready.append(instance)
            log.info(
                "warm pool %s: %s ready in %.0f ms (%d/%d)",
                key,
                instance.sandbox_id,
                (time.monotonic() - started) * 1000,
                len(pool.ready),
                self.high_of(key),
            )

    async def _made(self, key: str) -> SandboxInstance:
        """``make(key)``, carried to its end even when the refill is cancelled meanwhile (a
        shut-down, a dropped key): the sandbox it was making is then killed, not left running
        with no owner. Seen: a standby restored during a server's shut-down outlived the server
        (a cancel in its warm-up command lost the instance)."""
        making = asyncio.ensure_future(self._make(key))
        try:
            return await asyncio.shield(making)
        except asyncio.CancelledError:
            try:
                instance = await making
            except Exception:  # a make that failed has nothing to kill (it cleans up after itself)
                raise asyncio.CancelledError from None
            await self._kill(instance)
            raise

    async def _quiet(self) -> None:
        """Until ``quiet_seconds`` have passed since the last claim (bounded)."""
        deadline = time.monotonic() + MAX_QUIET_WAITS * self.quiet_seconds
        while (wait := self._last_claim + self.quiet_seconds - time.monotonic()) > 0:
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(wait, deadline - time.monotonic()))

    async def drop(self, key: str) -> None:
        """Kill every ready sandbox of ``key`` (its template snapshot is stale)."""
        pool = self._pools.pop(key, None)
        if pool is None:
            return
        if pool.filler is not None:
            pool.filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # its failures were logged by _fill
                await pool.filler
        for instance in pool.ready:
            try:
                await self._kill(instance)
            except Exception:
                # The others must still go; a pooled sandbox left behind has no database row, so the
                # next start-up's orphan clean-up removes it.
                log.exception("warm pool %s: killing pooled sandbox %s failed", key, instance.sandbox_id)

    async def close(self) -> None:
        """Stop refilling and kill every pooled sandbox."""
        self._closed = True
        for key in list(self._pools):
            await self.drop(key)
