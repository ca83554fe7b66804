"""The one owner of the sandboxes a node makes for itself: runtime instances with no database row.

A user sandbox has a row and changes state only through ``Orchestrator._enter``. These have none,
and are no user's: nobody connects to, pauses or snapshots them through the API. They are

* ``template-snapshot``: booted to take a template's snapshot (``TemplateSnapshots``), killed
  right after;
* ``warm-pool`` and ``standby``: restored ahead of demand from a template's or a user snapshot
  (``TemplateSnapshots``' and ``Standbys``' ``WarmPool``); a create *claims* one, and from then on
  it is a user sandbox: ``Orchestrator._bring_up`` gives it a row;
* ``build``: a template build's sandbox (``TemplateBuilder``), killed when the build ends.

They go through the same shape of transition, smaller: ``making -> live -> claimed | killed``
(``making -> killed`` when the make failed; the runtime has undone its part then), each checked
against :data:`EDGES` here. On a crash no row names them, so start-up recovery's
``Runtime.cleanup_orphans(keep)`` (``keep``: the ids rows name) removes them with every other
leak; on a clean shut-down their users kill them (the pools' ``close``, a cancelled build's
``finally``).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Literal

from forkyard.errors import Failed
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.runtime.base import Runtime
from forkyard.types import SandboxInstance, SandboxSpec, SnapshotRef

log = logging.getLogger(__name__)

Purpose = Literal["template-snapshot", "warm-pool", "standby", "build"]


class RowlessState(enum.StrEnum):
    MAKING = "making"
    LIVE = "live"
    CLAIMED = "claimed"
    KILLED = "killed"


S = RowlessState
#: The transitions a rowless sandbox may make; claimed and killed are final (a claimed one is
#: the lifecycle's, a user sandbox).
EDGES: dict[RowlessState, frozenset[RowlessState]] = {
    S.MAKING: frozenset({S.LIVE, S.KILLED}),
    S.LIVE: frozenset({S.CLAIMED, S.KILLED}),
    S.CLAIMED: frozenset(),
    S.KILLED: frozenset(),
}


@dataclass
class Rowless:
    sandbox_id: str
    purpose: Purpose
    runtime: Runtime
    state: RowlessState = S.MAKING


class RowlessSandboxes:
    def __init__(self, runtimes: RuntimeSet) -> None:
        self._runtimes = runtimes
        self._live: dict[str, Rowless] = {}

    async def create(self, runtime: Runtime, spec: SandboxSpec, purpose: Purpose) -> SandboxInstance:
        """Boot a sandbox of ``spec``'s template."""
        entry = self._begin(spec.sandbox_id, purpose, runtime)
        try:
            instance = await runtime.create(spec)
        except BaseException:
            self._end(entry, S.KILLED)
            raise
        self._enter(entry, S.LIVE)
        return instance

    async def restore(
        self, runtime: Runtime, spec: SandboxSpec, source: SnapshotRef, purpose: Purpose
    ) -> SandboxInstance:
        """Restore ``source`` as a new sandbox ``spec.sandbox_id``."""
        entry = self._begin(spec.sandbox_id, purpose, runtime)
        try:
            instance = await runtime.restore(spec, source)
        except BaseException:
            self._end(entry, S.KILLED)
            raise
        self._enter(entry, S.LIVE)
        return instance

    async def kill(self, instance: SandboxInstance) -> None:
        """Kill a rowless sandbox; it is gone from here even when the runtime's kill fails
        (start-up's orphan sweep retries what is left)."""
        entry = self._live.get(instance.sandbox_id)
        if entry is None:
            log.warning("killing %s, which is no rowless sandbox made here", instance.sandbox_id)
            await self._runtimes.named(instance.runtime).kill(instance)
            return
        try:
            await entry.runtime.kill(instance)
        finally:
            self._end(entry, S.KILLED)

    def claimed(self, instance: SandboxInstance) -> None:
        """A create took ``instance`` over: it is a user sandbox now, the lifecycle's to kill."""
        entry = self._live.get(instance.sandbox_id)
        if entry is not None:
            self._end(entry, S.CLAIMED)

    def live(self, purpose: Purpose | None = None) -> list[str]:
        """Ids of the rowless sandboxes being made or live (of ``purpose``, if given)."""
        return [sid for sid, e in self._live.items() if purpose is None or e.purpose == purpose]

    def _begin(self, sandbox_id: str, purpose: Purpose, runtime: Runtime) -> Rowless:
        if sandbox_id in self._live:
            raise Failed(f"rowless sandbox {sandbox_id} is already being made")
        entry = self._live[sandbox_id] = Rowless(sandbox_id, purpose, runtime)
        return entry

    @staticmethod
    def _enter(entry: Rowless, state: RowlessState) -> None:
        if state not in EDGES[entry.state]:
            raise Failed(f"rowless sandbox {entry.sandbox_id}: no transition from {entry.state} to {state}")
        entry.state = state

    def _end(self, entry: Rowless, state: RowlessState) -> None:
        self._enter(entry, state)
        self._live.pop(entry.sandbox_id, None)
