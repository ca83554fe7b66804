"""The one owner of garbage collection: the disk layers no snapshot and no sandbox stands on any
more, and the roots of dropped template builds (:meth:`SnapshotCatalog.collect_garbage` does
the collecting).

Whoever frees something says so and goes on: the catalog after every snapshot delete, the
lifecycle after a kill released its sandbox, the template owner after a template delete. The
collector runs in the background and coalesces: the notices that come while a collection runs
are served by one more run after it, not one run each (a fork of 32 children deletes one
snapshot, a burst of kills releases many sandboxes). Who must see the space back before going on
(the snapshot cache's eviction loop, start-up recovery, a template delete's answer) awaits
:meth:`GarbageCollector.collect`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from forkyard.orchestrator.background import Background

log = logging.getLogger(__name__)


class GarbageCollector:
    def __init__(self, collect: Callable[[], Awaitable[None]], background: Background) -> None:
        self._collect = collect
        self._background = background
        #: A notice came that no collection started since has served.
        self._wanted = False
        self._running: asyncio.Task[None] | None = None

    def notify(self) -> None:
        """Something may have freed layers or a template root: collect soon, in the background."""
        self._wanted = True
        if self._running is None or self._running.done():
            self._running = self._background.spawn(self._run(), name="collect-garbage")

    async def collect(self) -> None:
        """Collect, and return once a collection that started after this call has ended."""
        self.notify()
        await self.settled()

    async def settled(self) -> None:
        """Return once every notice given so far has been served."""
        while self._running is not None and not self._running.done():
            await asyncio.wait({self._running})

    async def _run(self) -> None:
        while self._wanted:
            self._wanted = False
            try:
                await self._collect()
            except Exception:
                # Retried on the next notice; nothing that notified may fail because of it.
                log.exception("garbage collection failed")
