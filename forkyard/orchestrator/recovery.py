"""Start-up recovery: what became of each sandbox the last run left live or paused, decided
here and carried out by the lifecycle owner through :class:`RecoveryActions` (every state and
tier change goes through its gate); then the snapshot sweep, the disk-layer collection and the
runtimes' removal of what no record names."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from forkyard.orchestrator.catalog import SnapshotCatalog
from forkyard.orchestrator.garbage import GarbageCollector
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.orchestrator.store import PauseTier, SandboxRecord, SandboxStore
from forkyard.types import KEPT_BY_RECOVERY, LIVE_STATES, SandboxState

log = logging.getLogger(__name__)

S = SandboxState


@dataclass(frozen=True)
class RecoveryActions:
    """The transitions recovery asks of the lifecycle owner."""

    is_alive: Callable[[SandboxRecord], Awaitable[bool]]
    #: Make a running sandbox reachable again (route, death watch).
    reattach: Callable[[SandboxRecord], None]
    #: Restore a sandbox recorded running but found stopped from the fork checkpoint a crash cut
    #: short; whether it came back.
    revive: Callable[[SandboxRecord], Awaitable[bool]]
    #: Destroy a sandbox found dead (waits for its release); a failed kill stays "killing".
    destroy: Callable[[SandboxRecord, str], Awaitable[None]]
    #: Freeze a paused sandbox found running (its move to disk was cut short); whether it froze.
    refreeze: Callable[[SandboxRecord], Awaitable[bool]]
    set_tier: Callable[[SandboxRecord, PauseTier], Awaitable[None]]
    watch: Callable[[SandboxRecord], None]


class Recovery:
    def __init__(
        self,
        store: SandboxStore,
        catalog: SnapshotCatalog,
        runtimes: RuntimeSet,
        garbage: GarbageCollector,
        actions: RecoveryActions,
    ) -> None:
        self._store = store
        self._catalog = catalog
        self._runtimes = runtimes
        self._garbage = garbage
        self._act = actions

    async def run(self) -> None:
        await self._recover_live()
        for rec in await self._store.in_states((S.PAUSED,)):
            await self._recover_paused(rec)
        await self._remove_orphans()
        paused = {r.sandbox_id: r.pause_snapshot or "" for r in await self._store.in_states((S.PAUSED,))}
        removed = await self._catalog.sweep(paused)
        if removed:
            log.info("snapshot recovery removed %s", ", ".join(removed))
        await self._garbage.collect()

    async def _recover_live(self) -> None:
        """Re-attach sandboxes that survived a server restart, revive a fork's parent a crash
        left stopped, clean up the rest."""
        for rec in await self._store.in_states(LIVE_STATES):
            if rec.state == S.RUNNING and await self._act.is_alive(rec):
                self._act.reattach(rec)
                log.info("recovery: re-attached running sandbox %s", rec.sandbox_id)
            elif rec.state == S.RUNNING and await self._act.revive(rec):
                log.info("recovery: revived sandbox %s from its fork checkpoint", rec.sandbox_id)
            else:
                log.info("recovery: sandbox %s (%s) is gone; cleaning up", rec.sandbox_id, rec.state)
                await self._act.destroy(rec, f"server restart found it {rec.state} but not alive")

    async def _recover_paused(self, rec: SandboxRecord) -> None:
        """A frozen sandbox outlives the server (its processes stay, frozen); one a crash caught
        moving to disk is frozen again if it still runs, or takes the pause snapshot that
        checkpoint committed; one whose processes are gone (a host reboot) is lost."""
        if rec.pause_tier in ("disk", "filesystem"):  # nothing of it runs; its disk is kept
            return
        alive = await self._act.is_alive(rec)
        if alive and rec.pause_tier == "frozen":
            log.info("recovery: paused sandbox %s is still frozen in place", rec.sandbox_id)
            self._act.watch(rec)
            return
        if alive and await self._act.refreeze(rec):  # a move to disk was cut short: it runs, thawed
            await self._act.set_tier(rec, "frozen")
            self._act.watch(rec)
            log.info("recovery: paused sandbox %s frozen again in place", rec.sandbox_id)
            return
        committed = await self._catalog.rows("pause", source=rec.sandbox_id)
        if committed:
            rec.pause_snapshot = committed[0].snapshot_id
            await self._act.set_tier(rec, "disk")
            log.info("recovery: paused sandbox %s is on disk (%s)", rec.sandbox_id, rec.pause_snapshot)
            return
        await self._act.destroy(rec, "server restart found the frozen sandbox gone")

    async def _remove_orphans(self) -> None:
        """Have each runtime remove what no record names (leaks of a crash, failed releases)."""
        keep = {r.sandbox_id for r in await self._store.in_states(KEPT_BY_RECOVERY)}
        for runtime in self._runtimes:
            try:
                removed = await runtime.cleanup_orphans(keep)
            except Exception:
                log.exception("recovery: %s cleanup_orphans failed", runtime.name)
                continue
            if removed:
                log.info("recovery: %s removed leaked sandboxes %s", runtime.name, ", ".join(removed))
