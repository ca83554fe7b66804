"""Dead-sandbox detection: per running (or frozen) sandbox, a task awaiting the runtime's
``wait_exit`` (gVisor: a pidfd on the runsc sandbox process; no polling). A wait that returns
with a reason is a death nobody asked for; the watch reports it through ``on_death`` and the
lifecycle owner decides (it checks, under the sandbox's lock, that it is still the instance
watched). Every operation that stops a sandbox on purpose unwatches it first."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from forkyard.runtime.base import Runtime
from forkyard.types import SandboxInstance

log = logging.getLogger(__name__)

#: ``on_death(sandbox_id, instance, reason)``.
OnDeath = Callable[[str, SandboxInstance, str], Awaitable[None]]


class DeathWatch:
    def __init__(self, on_death: OnDeath) -> None:
        self._on_death = on_death
        #: Per watched sandbox, the task waiting for its processes to die.
        self._watchers: dict[str, asyncio.Task[None]] = {}
        #: The runtime's wait behind each watcher (its result: why the sandbox died, or None).
        self._exits: dict[str, asyncio.Task[str | None]] = {}

    def watch(self, sandbox_id: str, runtime: Runtime, instance: SandboxInstance) -> None:
        self.unwatch(sandbox_id)
        exit_wait = asyncio.create_task(runtime.wait_exit(instance))
        self._exits[sandbox_id] = exit_wait
        self._watchers[sandbox_id] = asyncio.create_task(
            self._await_death(sandbox_id, instance, exit_wait), name=f"watch-{sandbox_id}"
        )

    def unwatch(self, sandbox_id: str) -> None:
        watcher = self._watchers.pop(sandbox_id, None)
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()  # what stops the sandbox now is an operation of ours
        exit_wait = self._exits.pop(sandbox_id, None)
        if exit_wait is not None:
            exit_wait.cancel()

    def exit_wait(self, sandbox_id: str) -> asyncio.Task[str | None] | None:
        """The wait running since the sandbox was watched: it holds the process already, which a
        wait started now could not, the process being gone by then (a resume races it)."""
        return self._exits.get(sandbox_id)

    def reported(self, sandbox_id: str) -> None:
        """Called by ``on_death`` (from the watcher's own task): this watch has ended."""
        if self._watchers.get(sandbox_id) is asyncio.current_task():
            del self._watchers[sandbox_id]
            self._exits.pop(sandbox_id, None)

    def close(self) -> None:
        """Stop watching (server shut-down): the sandboxes run on; a restart watches again."""
        for sandbox_id in list(self._watchers):
            self.unwatch(sandbox_id)

    async def _await_death(
        self, sandbox_id: str, instance: SandboxInstance, exit_wait: asyncio.Task[str | None]
    ) -> None:
        try:
            reason = await exit_wait
        except Exception as exc:  # cannot watch: the sandbox is found dead on its next use
            log.warning("cannot watch sandbox %s for its death: %s", sandbox_id, exc)
            return
        if reason is not None:
            await self._on_death(sandbox_id, instance, reason)
