"""The lifecycle's clock: every :data:`REAPER_INTERVAL_SECONDS` the reaper expires sandboxes past
their timeout, applies the frozen tier's policy and samples the running sandboxes' metrics. It
owns no state machine: it reports through callbacks, and the lifecycle owner runs each
transition under the sandbox's lock (it re-checks there: a ``set_timeout`` may win the race)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import psutil

from forkyard.config import Settings
from forkyard.orchestrator.background import Background
from forkyard.orchestrator.store import SandboxRecord, SandboxStore
from forkyard.orchestrator.timing import utcnow
from forkyard.types import SandboxState

log = logging.getLogger(__name__)

REAPER_INTERVAL_SECONDS = 0.5
METRICS_INTERVAL_SECONDS = 5.0


class FrozenTierPolicy:
    """When a frozen sandbox moves to disk: frozen longer than ``pause_disk_after_seconds``;
    while the node is short of memory, the longest-frozen one (one at a time: each checkpoint
    frees its memory before the next). ``move_to_disk(sandbox_id, reason)`` does the move."""

    def __init__(
        self,
        settings: Settings,
        background: Background,
        move_to_disk: Callable[[str, str], Coroutine[Any, Any, None]],
    ) -> None:
        self._settings = settings
        self._background = background
        self._move_to_disk = move_to_disk
        #: Frozen sandboxes whose move to disk is under way.
        self._moving: set[str] = set()

    def apply(self, frozen: list[SandboxRecord]) -> None:
        now = utcnow()
        idle = dt.timedelta(seconds=self._settings.pause_disk_after_seconds)
        for rec in frozen:
            if rec.paused_at is not None and now - rec.paused_at >= idle:
                self._start_move(rec.sandbox_id, "frozen for longer than pause_disk_after_seconds")
        available_mib = psutil.virtual_memory().available >> 20
        if frozen and available_mib < self._settings.pause_min_available_mib and not self._moving:
            oldest = min(frozen, key=lambda r: r.paused_at or now)
            self._start_move(oldest.sandbox_id, f"node memory short ({available_mib} MiB available)")

    def _start_move(self, sandbox_id: str, reason: str) -> None:
        if sandbox_id in self._moving:
            return
        self._moving.add(sandbox_id)
        task = self._background.spawn(self._move_to_disk(sandbox_id, reason), name=f"to-disk-{sandbox_id}")
        task.add_done_callback(lambda _: self._moving.discard(sandbox_id))


class Reaper:
    def __init__(
        self,
        store: SandboxStore,
        tier_policy: FrozenTierPolicy,
        *,
        expire: Callable[[str], Awaitable[None]],
        sample: Callable[[SandboxRecord], Awaitable[None]],
    ) -> None:
        self._store = store
        self.tier_policy = tier_policy
        self._expire = expire
        self._sample = sample
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._forever(), name="forkyard-reaper")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _forever(self) -> None:
        last_metrics = 0.0
        while True:
            try:
                await self._reap_expired()
                paused = await self._store.in_states((SandboxState.PAUSED,))
                self.tier_policy.apply([r for r in paused if r.pause_tier == "frozen"])
                if time.monotonic() - last_metrics >= METRICS_INTERVAL_SECONDS:
                    last_metrics = time.monotonic()
                    for rec in await self._store.in_states((SandboxState.RUNNING,)):
                        await self._sample(rec)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("timeout reaper iteration failed")  # the next iteration retries
            await asyncio.sleep(REAPER_INTERVAL_SECONDS)

    async def _reap_expired(self) -> None:
        ids = await self._store.expired(utcnow())
        if ids:
            await asyncio.gather(*(self._expire(i) for i in ids))
