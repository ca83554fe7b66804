"""Standbys: sandboxes restored ahead of demand from a user snapshot that is restored more than once.

RL trainers create many sandboxes from one prepared snapshot (a GRPO group, a task's start
state). The second create from a snapshot shows it is such a snapshot: from then on a few
sandboxes restored from it wait in a pool (like a template's warm pool), and a create claims one
(envd ``/init`` with the caller's env vars) instead of restoring. At most
``snapshot_standby_snapshots`` snapshots keep standbys, the least recently used losing theirs
first; deleting a snapshot drops its standbys.

Standbys have no registry row: a crashed server's start-up clean-up removes them like any leak,
a clean shut-down kills them.
"""

from __future__ import annotations

import collections
import logging

from agentenv.config import Settings
from agentenv.orchestrator.catalog import SnapshotCatalog, SnapshotMeta
from agentenv.orchestrator.envd_client import EnvdClient, initialised
from agentenv.orchestrator.envd_exec import EnvdExec
from agentenv.orchestrator.ids import new_sandbox_id
from agentenv.orchestrator.pool import WarmPool
from agentenv.orchestrator.runtimes import RuntimeSet
from agentenv.storage.snapshots import SnapshotRow
from agentenv.types import SandboxInstance, SandboxSpec

log = logging.getLogger(__name__)

#: Restores of one snapshot after which it gets standbys (the next creates claim them).
RESTORES_BEFORE_STANDBYS = 2


class Standbys:
    def __init__(
        self, settings: Settings, catalog: SnapshotCatalog, runtimes: RuntimeSet, envd_client: EnvdClient
    ) -> None:
        self._settings = settings
        self._envd_client = envd_client
        self._commands = EnvdExec()
        self._catalog = catalog
        self._runtimes = runtimes
        self._restores: collections.Counter[str] = collections.Counter()
        #: Snapshots with standbys, least recently used first.
        self._rows: collections.OrderedDict[str, SnapshotRow] = collections.OrderedDict()
        high = settings.snapshot_standbys
        self.pool = WarmPool(min(1, high), high, self._make, self._kill, settings.pool_refill_quiet_ms / 1000)

    async def claim(self, row: SnapshotRow) -> SandboxInstance | None:
        """A standby of ``row`` (None: restore one), counting the restore towards getting standbys."""
        if not self.pool.enabled:
            return None
        sid = row.snapshot_id
        if sid in self._rows:
            self._rows.move_to_end(sid)
            return self.pool.take(sid)
        self._restores[sid] += 1
        if self._restores[sid] >= RESTORES_BEFORE_STANDBYS:
            await self._start(row)
        return None

    async def _start(self, row: SnapshotRow) -> None:
        self._rows[row.snapshot_id] = row
        while len(self._rows) > self._settings.snapshot_standby_snapshots:
            old, _ = self._rows.popitem(last=False)
            self._restores.pop(old, None)
            log.info("standbys: %s loses its standbys to %s (least recently used)", old, row.snapshot_id)
            await self.pool.drop(old)
        self.pool.fill(row.snapshot_id)

    async def forget(self, snapshot_id: str) -> None:
        """The snapshot is gone: kill its standbys."""
        self._restores.pop(snapshot_id, None)
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
            instance = await runtime.restore(spec, ref)
        # envd in the image holds the source's token: the same /init a restore of it gets.
        return await initialised(
            self._envd_client, self._commands, runtime, instance, meta.envs, meta.envd_access_token
        )

    async def _kill(self, instance: SandboxInstance) -> None:
        await self._runtimes.named(instance.runtime).kill(instance)

    async def close(self) -> None:
        await self.pool.close()
        await self._commands.close()
