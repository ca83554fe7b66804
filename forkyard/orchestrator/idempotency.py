"""Create requests' idempotency keys: a retried create with the same key gets the sandbox the
first one made (while it lives). Kept in memory, the newest :data:`IDEMPOTENCY_KEYS_KEPT`."""

from __future__ import annotations

IDEMPOTENCY_KEYS_KEPT = 10_000


class IdempotencyCache:
    def __init__(self, kept: int = IDEMPOTENCY_KEYS_KEPT) -> None:
        self._kept = kept
        self._sandboxes: dict[str, str] = {}

    def sandbox_for(self, key: str | None) -> str | None:
        return self._sandboxes.get(key) if key else None

    def remember(self, key: str | None, sandbox_id: str) -> None:
        if not key:
            return
        self._sandboxes[key] = sandbox_id
        while len(self._sandboxes) > self._kept:  # oldest first (dict order)
            self._sandboxes.pop(next(iter(self._sandboxes)))
