"""QEMU processes started ahead of demand (``settings.qemu.prespawn``), waiting for a restore.

A restore otherwise pays a QEMU start (process, machine and device set-up: ~70-100 ms under TCG
here) before it can load anything. A spare is a QEMU started with ``-incoming defer`` and the
whole command line of a restore of one VM shape (guest artifacts, vCPUs, RAM size), on files of
its own:

    {data_dir}/qemu-spares/<token>/          qmp.sock, serial.log, qemu.log, qemu.pid
    {data_dir}/layers/qemu-spares/<token>/   upper.ext4, memory.ram (placeholders of full size)

and a persistent tap ``aeq<token>`` in the host's netns. QEMU opens every file, and the tap, at
start; a restore therefore fills the open placeholders *in place* (a reflink clone into the same
inode: :func:`forkyard.runtime.qemu.memory.clone_into`), moves the tap into the sandbox's netns
as ``tap0`` and renames the files into the sandbox's directories; QEMU keeps its descriptors
and mapping across both. Then only device state is loaded (``migrate-incoming``).

Spares are kept for the shape last started (one shape: a node mostly restores one template's
snapshots; another shape replaces them), refilled in the background after each use, killed on
:meth:`SparePool.close`; a crashed server's are found by their directories at start-up
(:meth:`QemuRuntime.cleanup_orphans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from forkyard.storage.images import GuestImages

log = logging.getLogger(__name__)

SPARES_DIR = "qemu-spares"
#: Host tap of a spare: ``aeq`` + 8 hex digits (under the 15 characters of an interface name).
TAP_PREFIX = "aeq"


@dataclass(frozen=True)
class Shape:
    """What a spare's command line is made of, besides its own files."""

    images: GuestImages
    vcpus: int
    memory_mb: int

    @property
    def key(self) -> str:
        return json.dumps([self.images.to_json(), self.vcpus, self.memory_mb], sort_keys=True)


@dataclass(frozen=True)
class Spare:
    token: str
    shape_key: str
    pid: int
    #: The spare's own directory and drive directory (``QemuPaths`` of the token).
    paths: Any

    @property
    def tap(self) -> str:
        return TAP_PREFIX + self.token


SpawnSpare = Callable[[Shape], Awaitable[Spare]]
DiscardSpare = Callable[[Spare], Coroutine[Any, Any, None]]
AliveSpare = Callable[[Spare], bool]


class SparePool:
    """Up to ``size`` spares of one shape; see the module docstring."""

    def __init__(self, size: int, spawn: SpawnSpare, discard: DiscardSpare, alive: AliveSpare) -> None:
        self.size = max(size, 0)
        self._spawn = spawn
        self._discard = discard
        self._alive = alive
        self._ready: list[Spare] = []
        self._shape: Shape | None = None
        self._refill: asyncio.Task[None] | None = None
        self._discards: set[asyncio.Task[None]] = set()
        #: Set whenever a spare is added (for :meth:`wait_ready`).
        self._added = asyncio.Event()

    def tokens(self) -> set[str]:
        return {s.token for s in self._ready}

    def ready(self, shape: Shape) -> int:
        """How many spares of ``shape`` wait now."""
        return sum(1 for s in self._ready if s.shape_key == shape.key)

    async def wait_ready(self, shape: Shape, count: int, limit_s: float) -> bool:
        """Wait until ``count`` spares of ``shape`` are ready (benches, tests): whether they are."""
        try:
            async with asyncio.timeout(limit_s):
                while self.ready(shape) < count:
                    self._added.clear()
                    await self._added.wait()
        except TimeoutError:
            return False
        return True

    def take(self, shape: Shape) -> Spare | None:
        """A live spare of ``shape``, now the caller's (it must adopt or discard it)."""
        while self._ready:
            spare = next((s for s in self._ready if s.shape_key == shape.key), None)
            if spare is None:
                return None
            self._ready.remove(spare)
            if self._alive(spare):
                return spare
            log.warning("qemu spare %s died; discarding it", spare.token)
            self._discard_later(spare)
        return None

    def want(self, shape: Shape) -> None:
        """Keep ``size`` spares of ``shape`` (in the background); spares of another shape go."""
        if self.size == 0:
            return
        if self._shape is None or self._shape.key != shape.key:
            self._shape = shape
            for spare in [s for s in self._ready if s.shape_key != shape.key]:
                self._ready.remove(spare)
                self._discard_later(spare)
        if self._refill is None or self._refill.done():
            self._refill = asyncio.create_task(self._fill(), name="qemu-spares")

    async def _fill(self) -> None:
        while (shape := self._shape) is not None and len(self._ready) < self.size:
            try:
                spare = await self._spawn(shape)
            except Exception:
                # Not retried in a loop: the next start asks again.
                log.exception("qemu spare: start failed")
                return
            if self._shape is None or spare.shape_key != self._shape.key:
                await self._discard(spare)
                continue
            self._ready.append(spare)
            self._added.set()

    def _discard_later(self, spare: Spare) -> None:
        task = asyncio.create_task(self._discard(spare), name=f"qemu-spare-discard-{spare.token}")
        self._discards.add(task)
        task.add_done_callback(self._discards.discard)

    async def close(self) -> None:
        """Kill every spare (node shutdown); the pool refills again only when asked."""
        self._shape = None
        if self._refill is not None:
            self._refill.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refill
        ready, self._ready = self._ready, []
        for spare in ready:
            await self._discard(spare)
        if self._discards:
            await asyncio.gather(*self._discards, return_exceptions=True)
