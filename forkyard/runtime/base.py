"""The one interface every isolation runtime (gVisor, Firecracker, QEMU) implements.

The orchestrator owns sandbox records and lifecycle state; a runtime only turns a
:class:`~forkyard.types.SandboxSpec` into a running, isolated machine whose envd answers at
:attr:`~forkyard.types.SandboxInstance.envd_url`, and tears it down again. Runtimes raise the
kinds of :mod:`forkyard.errors` (never HTTP statuses) and never import the orchestrator or the API.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import time
import urllib.parse
from pathlib import Path
from typing import ClassVar

from forkyard.config import Settings
from forkyard.errors import Conflict, NotSupported
from forkyard.runtime import network
from forkyard.types import (
    EgressPolicy,
    LiveSnapshots,
    RuntimeName,
    SandboxInstance,
    SandboxMetrics,
    SandboxSpec,
    SnapshotRef,
)


class Capability(enum.StrEnum):
    """What a runtime can do beyond the interface every runtime implements. Callers ask
    :attr:`Runtime.capabilities` instead of calling and catching ``NotSupported``."""

    #: :meth:`Runtime.freeze` / :meth:`Runtime.thaw`: the frozen pause tier.
    FREEZE = "freeze"
    #: :meth:`Runtime.stop_keep_disk` / :meth:`Runtime.boot_kept_disk`: E2B's filesystem-only pause.
    FILESYSTEM_PAUSE = "filesystem_pause"
    #: :meth:`Runtime.export_root`: template builds.
    EXPORT_ROOT = "export_root"
    #: :meth:`Runtime.root_layers`: a template build's step cache.
    ROOT_LAYERS = "root_layers"
    #: ``SandboxSpec.volumes`` are bound into the sandbox (and kept by its snapshots and restores).
    VOLUMES = "volumes"


class Runtime(abc.ABC):
    """A way to run isolated sandboxes on this node."""

    name: ClassVar[RuntimeName]
    #: The optional operations this runtime implements (the others raise ``NotSupported``).
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @abc.abstractmethod
    def probe(self) -> str | None:
        """None when this runtime can run here with the settings it was built with, else the
        reason it cannot (shown to users)."""

    @abc.abstractmethod
    def platform(self) -> str:
        """How the runtime isolates, for operators (``GET /node``): runsc's platform, QEMU's
        accelerator, Firecracker's KVM or PVM."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        """Boot a sandbox from its template and return once envd answers ``/health``."""

    @abc.abstractmethod
    async def kill(self, instance: SandboxInstance) -> None:
        """Stop the sandbox and remove every process, mount, network namespace, cgroup and
        scratch file it owns. Idempotent: killing a dead or half-created sandbox succeeds."""

    async def claimed(self, instance: SandboxInstance) -> None:
        """A sandbox made ahead of demand (``SandboxSpec.ahead_of_demand``) is now in use: give it
        a live sandbox's share of the CPU. The default does nothing."""
        return None

    async def halt(self, instance: SandboxInstance) -> None:
        """Stop every process of the sandbox now; ``kill`` frees the rest later. After it nothing
        of the sandbox runs or answers; a kill request waits only for this. The default does
        nothing (then ``kill`` does all of it in the background)."""
        return None

    @abc.abstractmethod
    async def metrics(self, instance: SandboxInstance) -> SandboxMetrics:
        """Current resource usage."""

    @abc.abstractmethod
    async def is_alive(self, instance: SandboxInstance) -> bool:
        """Whether the sandbox's machine is still running (used on start-up recovery)."""

    async def wait_exit(self, instance: SandboxInstance) -> str | None:
        """Return once the sandbox's processes are gone by any cause other than this runtime's
        own operations (an OOM kill, a crash, ``kill -9``), with what is known of why; None at
        once where the runtime cannot watch (the lifecycle then learns of a death on next use).
        The lifecycle cancels the wait before it stops the sandbox itself."""
        return None

    async def stop_prestarted(self) -> None:
        """Stop what the runtime keeps started ahead of demand (node shutdown); sandboxes keep
        running. The default has nothing to stop."""
        return None

    @abc.abstractmethod
    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """Remove resources of sandboxes not in ``keep`` (crash recovery); return their ids."""

    async def update_network(
        self, instance: SandboxInstance, *, allow_internet_access: bool, egress: EgressPolicy | None
    ) -> None:
        """Replace a running sandbox's outbound policy in place (``network.update_egress``).
        Every runtime records the sandbox's link in ``instance.network``; a sandbox without one
        cannot."""
        if instance.network is None:  # a 409 (the endpoint's documented refusal), not a server error
            raise Conflict(f"sandbox {instance.sandbox_id} has no network of its own to update")
        await network.update_egress(
            self.settings,
            instance.network,
            allow_internet_access=allow_internet_access,
            egress=egress,
        )

    # -- memory-state lifecycle (pause/resume, snapshots, fork) -------------------------------

    async def snapshot_keeps_running(self, instance: SandboxInstance) -> bool:
        """Whether ``snapshot(stop=False)`` would leave ``instance`` running (paused only for the
        checkpoint) rather than stop it and restore it in place. A fork asks: a parent that keeps
        running is not one more restore beside its children."""
        return False

    @abc.abstractmethod
    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Write the sandbox's memory, processes and disk layer to ``dest.path``, incremental to
        ``dest.parent`` when given. With ``stop`` the sandbox is left stopped (pause), otherwise
        it keeps running (snapshot, fork)."""

    @abc.abstractmethod
    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        """Start a sandbox whose memory, processes and disk are those of ``source``."""

    # -- the frozen pause tier -----------------------------------------------------------------

    async def freeze(self, instance: SandboxInstance) -> None:
        """Stop the sandbox where it stands, keeping its memory, processes, network and address
        (the first tier of a pause: milliseconds, memory stays in use). A frozen sandbox is
        still alive for :meth:`is_alive`; :meth:`kill` works on it. Before a :meth:`snapshot`
        it is thawed. Runtimes that cannot freeze raise ``NotSupported``."""
        raise NotSupported(f"the {self.name} runtime cannot freeze a sandbox")

    async def thaw(self, instance: SandboxInstance) -> None:
        """Let a frozen sandbox run again; a sandbox that is not frozen is left as it is."""
        raise NotSupported(f"the {self.name} runtime cannot freeze a sandbox")

    # -- the filesystem pause tier (E2B's ``memory: false``) ------------------------------------

    async def stop_keep_disk(self, instance: SandboxInstance) -> SandboxInstance:
        """End every process of the sandbox and free its memory, network and cgroups, keeping
        its disk (its writable layer and the layers under it) for :meth:`boot_kept_disk`.
        Returns the instance as kept: what :meth:`kill` needs to remove the disk later."""
        raise NotSupported(f"the {self.name} runtime has no filesystem-only pause")

    async def boot_kept_disk(self, spec: SandboxSpec, kept: SandboxInstance) -> SandboxInstance:
        """Boot the sandbox afresh (new kernel, new boot id) from its template over the disk
        :meth:`stop_keep_disk` kept. On failure the disk stays, so a kill still removes it."""
        raise NotSupported(f"the {self.name} runtime has no filesystem-only pause")

    async def export_root(self, instance: SandboxInstance, dest: Path) -> None:
        """Copy the sandbox's root file system, as its processes see it, into the empty
        directory ``dest`` (template builds: the build sandbox becomes a template's rootfs). The
        caller has flushed it (``sync`` inside) and keeps it from writing meanwhile."""
        raise NotSupported(f"the {self.name} runtime cannot export a root file system (template builds)")

    def root_layers(self, instance: SandboxInstance) -> list[Path]:
        """The directories, in overlayfs format and newest first, that hold everything the
        sandbox's root has that its template root has not (its upper, then the snapshot layers
        it was restored onto): a template build's step cache seals them after each step. The
        caller has flushed the sandbox (``sync`` inside) and keeps it from writing meanwhile."""
        raise NotSupported(f"the {self.name} runtime does not expose its root's layers")

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


def log_tail(path: Path, limit: int = 1500) -> str:
    """The end of a runtime's log file (runsc, envd, a VM console), for error messages."""
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip() or "(empty)"
    except OSError:
        return "(no log)"


async def envd_healthy(url: str, limit_s: float = 2.0) -> bool:
    """One ``GET /health`` over a plain socket. An httpx client costs ~50 ms to create (it builds
    an SSL context), as much as the whole probe of a restored envd."""
    parsed = urllib.parse.urlsplit(url)
    request = f"GET /health HTTP/1.1\r\nHost: {parsed.netloc}\r\nConnection: close\r\n\r\n".encode()
    try:
        async with asyncio.timeout(limit_s):
            reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port or 80)
            try:
                writer.write(request)
                status = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False
    return status.split(b" ")[1:2] in ([b"200"], [b"204"])
