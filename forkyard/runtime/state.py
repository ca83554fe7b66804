"""The base of each runtime's private record of a sandbox (``SandboxInstance.state``).

Every runtime persists a dataclass of its own (``GvisorState``, ``FirecrackerState``,
``QemuState``); the orchestrator stores it as opaque JSON and nothing above the runtimes reads
it. Reading one back tolerates the rows older nodes wrote: keys it no longer has are dropped
(``template_rootfs`` and ``network`` moved onto the instance), keys it lacks take defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Self

from forkyard.types import SandboxInstance


@dataclass
class RuntimeState:
    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Self:
        known = {f.name for f in fields(cls)}
        return cls(**cls._decode({k: v for k, v in (data or {}).items() if k in known and v is not None}))

    @classmethod
    def of(cls, instance: SandboxInstance) -> Self:
        """The state ``instance``'s runtime recorded (its own class, by the runtime's choice)."""
        return cls.from_json(instance.state)

    @classmethod
    def _decode(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Turn the JSON of fields that are not plain JSON values back into their types."""
        return values
