"""The one interface every isolation runtime (gVisor, Firecracker, QEMU) implements.

The orchestrator owns sandbox records and lifecycle state; a runtime only turns a
:class:`SandboxSpec` into a running, isolated machine whose envd answers at
:attr:`SandboxInstance.envd_url`, and tears it down again. Runtimes never import the API.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


class RuntimeError_(Exception):
    """A runtime operation failed; ``message`` is safe to show to an API client."""

    def __init__(self, message: str, *, code: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class TemplateImage:
    """What a runtime needs of a template: its read-only root file system and limits."""

    template_id: str
    #: Read-only base root file system directory (shared by every sandbox of the template).
    rootfs: Path
    vcpus: int = 2
    memory_mb: int = 512
    disk_mb: int = 4096
    #: Per-template runtime override ("gvisor", "qemu", "firecracker"), or None for the node default.
    runtime: str | None = None


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    template: TemplateImage
    #: Environment variables for every process envd starts (merged under per-process envs).
    envs: dict[str, str] = field(default_factory=dict)
    allow_internet_access: bool = True
    #: Token envd requires in ``X-Access-Token`` (None: no token, the E2B default for non-secure sandboxes).
    envd_access_token: str | None = None


@dataclass
class SandboxInstance:
    """A live sandbox as the runtime left it. ``state`` is runtime-private and JSON-serialisable:
    the orchestrator persists it so that a restarted server can re-attach or clean up."""

    sandbox_id: str
    runtime: str
    #: Base URL at which the host reaches the sandbox's envd, e.g. ``http://10.213.0.2:49983``.
    envd_url: str
    #: Address of the sandbox on its private link; ports other than envd's are reached here too.
    address: str
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SandboxMetrics:
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int


@dataclass(frozen=True)
class SnapshotRef:
    """A snapshot on local disk: ``path`` holds the memory image and the disk layer.

    ``parent`` is the snapshot this one is incremental to (None for a full snapshot)."""

    snapshot_id: str
    path: Path
    parent: SnapshotRef | None = None


#: Lists the committed snapshots of a runtime (see :meth:`Runtime.collect_garbage`).
LiveSnapshots = Callable[[], Awaitable[list[SnapshotRef]]]


class Runtime(abc.ABC):
    """A way to run isolated sandboxes on this node."""

    name: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> str | None:
        """None when this runtime can run here, else the reason it cannot (shown to users)."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        """Boot a sandbox from its template and return once envd answers ``/health``."""

    @abc.abstractmethod
    async def kill(self, instance: SandboxInstance) -> None:
        """Stop the sandbox and remove every process, mount, network namespace, cgroup and
        scratch file it owns. Idempotent: killing a dead or half-created sandbox succeeds."""

    @abc.abstractmethod
    async def metrics(self, instance: SandboxInstance) -> SandboxMetrics:
        """Current resource usage."""

    @abc.abstractmethod
    async def is_alive(self, instance: SandboxInstance) -> bool:
        """Whether the sandbox's machine is still running (used on start-up recovery)."""

    @abc.abstractmethod
    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """Remove resources of sandboxes not in ``keep`` (crash recovery); return their ids."""

    # -- memory-state lifecycle (pause/resume, snapshots, fork) -------------------------------

    @abc.abstractmethod
    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Write the sandbox's memory, processes and disk layer to ``dest.path``, incremental to
        ``dest.parent`` when given. With ``stop`` the sandbox is left stopped (pause), otherwise
        it keeps running (snapshot, fork)."""

    @abc.abstractmethod
    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        """Start a sandbox whose memory, processes and disk are those of ``source``."""

    async def collect_garbage(self, live_snapshots: LiveSnapshots) -> list[str]:
        """Free shared disk layers that neither a sandbox of this runtime nor a committed snapshot
        of it still uses; return what was freed. ``live_snapshots()`` lists the committed
        snapshots: a runtime calls it only once nothing can mount a chain any more (under its
        layer lock), so a snapshot committed meanwhile is never missed. Runtimes whose snapshots
        share nothing have nothing to do."""
        return []


class CpuSampler:
    """Turns each sandbox's cumulative CPU-seconds counter into its utilisation between two calls,
    the way every runtime reports ``cpu_used_pct``."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}

    def percent(self, sandbox_id: str, cpu_seconds: float, vcpus: int) -> float | None:
        """Percent of ``vcpus`` used since the previous call (0-100); None on the first call."""
        now = time.monotonic()
        last = self._last.get(sandbox_id)
        self._last[sandbox_id] = (now, cpu_seconds)
        if last is None or now <= last[0]:
            return None
        return max(0.0, min(100.0, 100.0 * (cpu_seconds - last[1]) / (now - last[0]) / max(vcpus, 1)))

    def forget(self, sandbox_id: str) -> None:
        self._last.pop(sandbox_id, None)
