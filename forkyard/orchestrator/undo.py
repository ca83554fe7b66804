"""Undo lists for multi-step work (the shape e2b-dev/infra's orchestrator uses for its cleanups).

Each step that made something registers how to take it back; on failure the steps are undone
newest first, and a failing undo is logged with its cause without stopping the others."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Undo:
    def __init__(self, what: str) -> None:
        self.what = what
        self._steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []

    def push(self, step: str, undo: Callable[[], Awaitable[object]]) -> None:
        self._steps.append((step, undo))

    def commit(self) -> None:
        """The work succeeded: nothing is to be undone."""
        self._steps.clear()

    async def rollback(self) -> None:
        while self._steps:
            step, undo = self._steps.pop()
            try:
                await undo()
            except Exception:
                # Undoing the rest matters more than this one failure; its cause is in the log.
                log.exception("%s: undoing %r failed", self.what, step)
