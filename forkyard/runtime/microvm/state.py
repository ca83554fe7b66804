"""What a microVM runtime records of a sandbox: the instance's ``state`` and, the same record,
the marker file in the sandbox's directory (what a kill and crash recovery trust: a pause
rewrites it to ``paused`` with the network it keeps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from forkyard.runtime.state import RuntimeState
from forkyard.types import SandboxNetwork


@dataclass
class MicroVMState(RuntimeState):
    #: The sandbox's directory, and its private upper drive.
    paths: str = ""
    upper: str = ""
    #: The guest artifacts it boots (``storage.images.GuestImages.to_json``); snapshots copy them.
    images: dict[str, Any] = field(default_factory=dict)
    vcpus: int = 0
    memory_mb: int = 0
    #: The VMM's host process.
    pid: int | None = None
    #: The directory a VMM started ahead of its sandbox was started in (pid checks: its command
    #: line names that, not the sandbox's directory).
    vm_owner: str | None = None
    #: The link this node holds for the sandbox; a paused one keeps it for the resume.
    network: SandboxNetwork | None = None
    #: Stopped by a pause: only ``network`` is kept.
    paused: bool = False

    @classmethod
    def _decode(cls, values: dict[str, Any]) -> dict[str, Any]:
        net = values.pop("network", None)
        return values | ({"network": SandboxNetwork.from_state(net)} if net else {})

    @classmethod
    def paused_with(cls, network: SandboxNetwork | None) -> Self:
        return cls(network=network, paused=True)
