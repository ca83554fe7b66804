"""Standbys: sandboxes restored ahead of demand from a user snapshot that is restored more than once.

RL trainers create many sandboxes from one prepared snapshot (a GRPO group, a task's start
state). The second create from a snapshot shows it is such a snapshot: from then on a few
sandboxes restored from it wait in a pool (like a template's warm pool), and a create claims one
(envd ``/init`` with the caller's env vars) instead of restoring. At most
``snapshot_standby_snapshots`` snapshots keep standbys, the least recently used losing theirs
first; deleting a snapshot drops its standbys.

A snapshot keeps ``snapshot_standbys`` standbys, or as many as the largest group of creates from
it seen so far (creates arriving less than :data:`GROUP_GAP_SECONDS` apart), up to
``snapshot_standbys_max``: a trainer that creates a group of 16 from one start state each step
claims 16 standbys from its second group on. Standbys beyond ``snapshot_standbys`` are made only
while the node has more than ``pause_min_available_mib`` of memory available (below it frozen
sandboxes are moved to disk: standbys must not push them there).

Standbys have no database row: they are made and killed through
:class:`~forkyard.orchestrator.rowless.RowlessSandboxes`, a crashed server's start-up clean-up
removes them like any leak, a clean shut-down kills them.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import psutil

from forkyard.config import Settings
from forkyard.orchestrator.catalog import SnapshotCatalog, SnapshotMeta
from forkyard.orchestrator.envd_client import EnvdClient, initialised
from forkyard.orchestrator.envd_exec import EnvdExec
from forkyard.orchestrator.ids import new_sandbox_id
from forkyard.orchestrator.pool import WarmPool
from forkyard.orchestrator.rowless import RowlessSandboxes
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.storage.snapshots import SnapshotRow
from forkyard.types import SandboxInstance, SandboxSpec

log = logging.getLogger(__name__)

#: Restores of one snapshot after which it gets standbys (the next creates claim them).
RESTORES_BEFORE_STANDBYS = 2
#: Creates from one snapshot arriving at most this far apart count as one group. A group created
#: at once arrives within milliseconds; one created a few at a time (a client's concurrency limit)
#: arrives in waves whose gaps are a claim's ~20-50 ms once standbys serve it.
GROUP_GAP_SECONDS = 0.25


@dataclass
class _Demand:
    """Creates from one snapshot: the group now arriving and the largest group seen."""

    last: float = -float("inf")
    group: int = 0
    largest: int = 0

    def arrived(self, now: float) -> None:
        self.group = self.group + 1 if now - self.last <= GROUP_GAP_SECONDS else 1
        self.last = now
        self.largest = max(self.largest, self.group)


class Standbys:
    def __init__(
        self,
        settings: Settings,
        catalog: SnapshotCatalog,
        runtimes: RuntimeSet,
        envd_client: EnvdClient,
        rowless: RowlessSandboxes,
    ) -> None:
        self._settings = settings
        self._rowless = rowless
        self._envd_client = envd_client
        self._commands = EnvdExec()
        self._catalog = catalog
        self._runtimes = runtimes
        self._restores: collections.Counter[str] = collections.Counter()
        self._demand: dict[str, _Demand] = {}
        #: Snapshots with standbys, least recently used first.
        self._rows: collections.OrderedDict[str, SnapshotRow] = collections.OrderedDict()
        base = settings.snapshot_standbys
        self._most = max(base, settings.snapshot_standbys_max) if base > 0 else 0
        self.pool = WarmPool(
            min(1, base),
            self._most,
            self._make,
            self._kill,
            settings.pool_refill_quiet_ms / 1000,
            high_for=self.wanted,
        )

    def wanted(self, snapshot_id: str) -> int:
        """How many standbys ``snapshot_id`` should have now."""
        base = self._settings.snapshot_standbys
        demand = self._demand.get(snapshot_id)
        wanted = min(max(base, demand.largest if demand else 0), self._most)
        if wanted > base and self._memory_short():
            return base
        return wanted

    def _memory_short(self) -> bool:
        return psutil.virtual_memory().available >> 20 <= self._settings.pause_min_available_mib

    async def claim(self, row: SnapshotRow) -> SandboxInstance | None:
        """A standby of ``row`` (None: restore one), counting the restore towards getting standbys."""
        if not self.pool.enabled:
            return None
        sid = row.snapshot_id
        self._demand.setdefault(sid, _Demand()).arrived(time.monotonic())
        if sid in self._rows:
            self._rows.move_to_end(sid)
            instance = self.pool.take(sid)
            if instance is not None:
                self._rowless.claimed(instance)  # the caller's now: a user sandbox
            if self.pool.ready(sid) < self.wanted(sid):
                self.pool.fill(sid)  # a larger group than before: grow (no-op while filling)
            return instance
        self._restores[sid] += 1
        if self._restores[sid] >= RESTORES_BEFORE_STANDBYS:
            await self._start(row)
        return None

    async def _start(self, row: SnapshotRow) -> None:
        self._rows[row.snapshot_id] = row
        while len(self._rows) > self._settings.snapshot_standby_snapshots:
            old, _ = self._rows.popitem(last=False)
            self._restores.pop(old, None)
            self._demand.pop(old, None)
            log.info("standbys: %s loses its standbys to %s (least recently used)", old, row.snapshot_id)
            await self.pool.drop(old)
        self.pool.fill(row.snapshot_id)

    async def forget(self, snapshot_id: str) -> None:
        """The snapshot is gone: kill its standbys."""
        self._restores.pop(snapshot_id, None)
        self._demand.pop(snapshot_id, None)
        self._rows.pop(snapshot_id, None)
        await self.pool.drop(snapshot_id)

    async def _make(self, snapshot_id: str) -> SandboxInstance:
        row = self._rows[snapshot_id]
        meta = SnapshotMeta.of(row)
        spec = SandboxSpec(
            sandbox_id=new_sandbox_id(), template=meta.image(row.template_id), ahead_of_demand=True
        )
        runtime = self._runtimes.named(row.runtime)
        async with self._catalog.use(row) as ref:  # fetched first if its copy was evicted
            instance = await self._rowless.restore(runtime, spec, ref, "standby")
        # envd in the image holds the source's token: the same /init a restore of it gets.
        return await initialised(
            self._envd_client, self._commands, self._rowless, instance, meta.envs, meta.envd_access_token
        )

    async def _kill(self, instance: SandboxInstance) -> None:
        await self._rowless.kill(instance)

    async def close(self) -> None:
        await self.pool.close()
        await self._commands.close()
