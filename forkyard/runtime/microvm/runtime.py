"""The lifecycle QEMU and Firecracker share: one VM process per sandbox in the sandbox's netns.

Per sandbox::

    {data_dir}/sandboxes/<id>/<marker>.json   what the VM was started with (recovery, kill)
                              ...              the VMM's sockets, pid file and logs
    {data_dir}/layers/sandboxes/<id>/          the VM's drive directory in the reflink pool:
                              upper.ext4       its private writable drive (:mod:`.disks`)

A start claims the sandbox directory, prepares the upper drive, sets up the network (netns, veth,
``tap0``, see :mod:`.vmnet`), lets the runtime launch its VMM (:meth:`MicroVmRuntime._launch`)
and waits for envd. A pause (``snapshot(stop=True)``) stops the VM but keeps the network and
says so in the marker (``paused``): the resume restores into it and keeps the sandbox address.
Only a kill frees the network.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Self, TypeVar

import psutil

from forkyard.config import Settings
from forkyard.errors import Conflict, Gone, NotFound
from forkyard.runtime import network
from forkyard.runtime.base import CpuSampler, Runtime
from forkyard.runtime.microvm import vmnet
from forkyard.runtime.microvm.disks import allocated_and_size, prepare_upper, remove_orphan_snapshot_disks
from forkyard.runtime.microvm.host import Alive, kill_pid, pid_alive, wait_for_envd
from forkyard.runtime.microvm.state import MicroVMState
from forkyard.runtime.network import SandboxNetwork
from forkyard.storage.atomic import write_json_atomic
from forkyard.storage.images import GuestImages, build_guest_images
from forkyard.storage.reflink import ReflinkPool
from forkyard.types import (
    ENVD_PORT,
    LiveSnapshots,
    SandboxInstance,
    SandboxMetrics,
    SandboxSpec,
    SnapshotRef,
    TemplateImage,
)

log = logging.getLogger(__name__)

#: Every microVM snapshot directory records its VM in this file (guest artifacts, size, ...).
SNAPSHOT_META = "vm.json"


@dataclass(frozen=True)
class VmPaths:
    """Where one sandbox's VM keeps its files; each runtime names its own on top."""

    #: Name of the marker file in ``root``; its existence makes the directory this runtime's.
    MARKER: ClassVar[str]
    #: Name of the guest's serial console log in ``root``.
    CONSOLE: ClassVar[str]

    root: Path
    layer_dir: Path

    @classmethod
    def of(cls, settings: Settings, sandbox_id: str) -> Self:
        return cls(
            root=settings.data_dir / "sandboxes" / sandbox_id,
            layer_dir=ReflinkPool(settings.data_dir).root / "sandboxes" / sandbox_id,
        )

    @property
    def marker(self) -> Path:
        return self.root / self.MARKER

    @property
    def console(self) -> Path:
        return self.root / self.CONSOLE

    @property
    def upper(self) -> Path:
        return self.layer_dir / "upper.ext4"

    @property
    def runtime_files(self) -> tuple[Path, ...]:
        """Files of a running VMM that a VMM started later in ``root`` must not find (sockets,
        pid files): a pause removes them."""
        return ()


P = TypeVar("P", bound=VmPaths)
S = TypeVar("S", bound=MicroVMState)


def read_marker(paths: VmPaths, kind: type[S]) -> S | None:
    """The record in ``paths``' marker file as ``kind``; None when there is none (or unreadable)."""
    try:
        data = json.loads(paths.marker.read_text())
    except (OSError, ValueError):
        return None
    return kind.from_json(data) if isinstance(data, dict) and data else None


def write_marker(paths: VmPaths, state: MicroVMState) -> None:
    write_json_atomic(paths.marker, state.to_json())


def claim_dir(sandbox_id: str, paths: VmPaths) -> SandboxNetwork | None:
    """Create the sandbox's directory. A pause leaves it behind with the sandbox's network
    (netns, tap, NAT): a resume takes that over, keeps its address and sets nothing up."""
    try:
        paths.root.mkdir(parents=True, exist_ok=False)
        return None
    except FileExistsError:
        pass
    state = read_marker(paths, MicroVMState)
    if state is None or not state.paused or state.network is None:
        raise Conflict(f"sandbox {sandbox_id} already exists on this node")
    return state.network


def netns_exists(net: SandboxNetwork) -> bool:
    return os.path.exists(net.netns_path)


@dataclass(frozen=True)
class Boot:
    """What a VM starts from: a template's artifacts (cold boot) or a snapshot (restore)."""

    images: GuestImages
    vcpus: int
    memory_mb: int
    snapshot: SnapshotRef | None = None
    #: The snapshot's ``vm.json`` (empty for a cold boot).
    meta: dict[str, Any] = field(default_factory=dict)


def read_snapshot(source: SnapshotRef, required: str, runtime: str) -> Boot:
    """The VM a snapshot was taken of; it names its guest artifacts, so a restore builds nothing."""
    if not (source.path / required).is_file():
        raise NotFound(f"snapshot {source.snapshot_id} is not a {runtime} snapshot (it has no {required})")
    try:
        meta: dict[str, Any] = json.loads((source.path / SNAPSHOT_META).read_text())
        images = GuestImages.from_json(meta["images"])
    except (OSError, ValueError, KeyError) as exc:
        raise Gone(f"snapshot {source.snapshot_id} has no readable {SNAPSHOT_META}: {exc}") from exc
    except Gone as exc:
        raise Gone(f"snapshot {source.snapshot_id} cannot be restored: {exc.message}") from exc
    return Boot(images, int(meta["vcpus"]), int(meta["memory_mb"]), source, meta)


def write_snapshot_meta(dest: SnapshotRef, state: MicroVMState, **extra: Any) -> None:
    """Record in ``dest`` the VM it holds (what :func:`read_snapshot` reads back)."""
    meta = {"images": state.images, "vcpus": state.vcpus, "memory_mb": state.memory_mb} | extra
    write_json_atomic(dest.path / SNAPSHOT_META, meta, indent=2)


class GuestImageCache:
    """Guest artifacts per template build: finding them hashes the whole rootfs listing (~1 s on
    the base template), which every cold create would otherwise pay again."""

    def __init__(self) -> None:
        self._by_build: dict[tuple[str, str, int, int, int], GuestImages] = {}

    async def get(self, settings: Settings, tmpl: TemplateImage) -> GuestImages:
        key = self._build_key(tmpl)
        cached = self._by_build.get(key) if key else None
        if cached is not None and all(p.exists() for p in (cached.base, cached.envd, cached.kernel.vmlinux)):
            return cached
        # The upper drive is the sandbox's disk: the template's disk_mb is its size (the quota).
        images = await asyncio.to_thread(
            build_guest_images, settings, tmpl.template_id, tmpl.rootfs, tmpl.disk_mb
        )
        if key:
            self._by_build[key] = images
        return images

    @staticmethod
    def _build_key(tmpl: TemplateImage) -> tuple[str, str, int, int, int] | None:
        """Identifies one build of a template (a rebuild renames a new rootfs tree into place) and
        its disk size."""
        try:
            st = tmpl.rootfs.stat()
        except OSError:
            return None
        return tmpl.template_id, str(tmpl.rootfs), st.st_ino, st.st_mtime_ns, tmpl.disk_mb


class Phases:
    """Milliseconds per step of one start or snapshot: the profile in the runtime's log line
    (``qemu <id>: restore in 412 ms (disk 1, network 0, spawn 52, ...)``, read by the bench)."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.ms: dict[str, int] = {}

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.ms[step] = round((now - self._last) * 1000)
        self._last = now

    def summary(self) -> str:
        total = round((time.perf_counter() - self._start) * 1000)
        return f"{total} ms (" + ", ".join(f"{k} {v}" for k, v in self.ms.items()) + ")"


class MicroVmRuntime(Runtime, Generic[P, S]):
    """Owns the lifecycle of a microVM sandbox; subclasses start, configure and snapshot their VMM
    and name the class of their record (``S``, a :class:`MicroVMState`)."""

    #: ``argv[0]`` of the VMM contains it (pid checks: a recycled pid is not our VM).
    process_name: ClassVar[str]
    #: The file every snapshot of this runtime holds (a restore checks for it first).
    snapshot_file: ClassVar[str]

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._cpu = CpuSampler()
        self._images = GuestImageCache()

    # -- what each runtime adds ---------------------------------------------------------------

    @abc.abstractmethod
    def paths(self, sandbox_id: str) -> P:
        """The sandbox's files."""

    @abc.abstractmethod
    def _state_type(self) -> type[S]:
        """The class of this runtime's record of a sandbox."""

    def _state(self, instance: SandboxInstance) -> S:
        return self._state_type().of(instance)

    def _recorded(self, paths: P, instance: SandboxInstance) -> S:
        """What this node holds for the sandbox now: its marker (a pause rewrote it; the
        instance may be the one from before the pause), else the instance's record."""
        return read_marker(paths, self._state_type()) or self._state(instance)

    @abc.abstractmethod
    async def _launch(self, net: SandboxNetwork, boot: Boot, paths: P, state: S, phases: Phases) -> None:
        """Start the VMM in ``net``'s netns, record its pid in ``state.pid`` (and the marker)
        and boot ``boot.images`` or load ``boot.snapshot``; envd is waited for by the caller."""

    @abc.abstractmethod
    def _envd_timeout(self) -> float:
        """Seconds a started VM gets until envd answers."""

    def _extra_state(self, boot: Boot, state: S) -> None:
        """Fill in the runtime-specific fields of a new sandbox's ``state``."""

    def _check_restorable(self, boot: Boot) -> None:
        """Raise when this node cannot run the snapshot ``boot`` (taken under other settings)."""

    def _vm_processes(self, state: S, paths: P) -> list[tuple[int | None, str]]:
        """(pid, ``argv[0]`` part) of every process a VM runs on the host."""
        return [(state.pid, self.process_name)]

    def _vm_owner(self, state: S, paths: P) -> str:
        """A string every VM process of the sandbox has in its command line (pid checks: a
        recycled pid is not ours). A VMM started ahead of its sandbox names the directory it was
        started in (``state.vm_owner``)."""
        return state.vm_owner or str(paths.root)

    # -- start --------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        tmpl = spec.template
        images = await self._images.get(self.settings, tmpl)
        return await self._start(spec, Boot(images, tmpl.vcpus, tmpl.memory_mb))

    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        boot = await asyncio.to_thread(read_snapshot, source, self.snapshot_file, self.name)
        self._check_restorable(boot)
        return await self._start(spec, boot)

    async def _start(self, spec: SandboxSpec, boot: Boot) -> SandboxInstance:
        paths = self.paths(spec.sandbox_id)
        kept = await self._claim_dir(spec.sandbox_id, paths)
        state = self._state_type()(
            paths=str(paths.root),
            upper=str(paths.upper),
            images=boot.images.to_json(),
            vcpus=boot.vcpus,
            memory_mb=boot.memory_mb,
            network=kept,
        )
        self._extra_state(boot, state)
        try:
            return await self._bring_up(spec, boot, paths, state, kept)
        except BaseException:
            await self._destroy(spec.sandbox_id, state)
            raise

    async def _claim_dir(self, sandbox_id: str, paths: P) -> SandboxNetwork | None:
        """Create the sandbox's directory, or take over the network a pause kept (see
        :func:`claim_dir`) when it is still there."""
        kept = claim_dir(sandbox_id, paths)
        if kept is None or netns_exists(kept):
            return kept
        # The host rebooted while the sandbox was paused (/run/netns is a tmpfs): a new network.
        await network.teardown_network(self.settings, sandbox_id, kept)
        return None

    async def _bring_up(
        self, spec: SandboxSpec, boot: Boot, paths: P, state: S, kept: SandboxNetwork | None
    ) -> SandboxInstance:
        phases = Phases()
        write_marker(paths, state)
        snapshot_dir = boot.snapshot.path if boot.snapshot else None
        await asyncio.to_thread(prepare_upper, self.settings, boot.images, snapshot_dir, paths.upper)
        phases.mark("disk")
        vmm_tap = self._vmm_brings_tap(spec.sandbox_id, boot, kept=kept is not None)
        net = kept or await self._plug_network(spec, paths, state, tap_device=not vmm_tap)
        phases.mark("network")
        await self._launch(net, boot, paths, state, phases)
        url = f"http://{net.sandbox_ip}:{ENVD_PORT}"
        await self._wait_envd(url, paths, state, restored=boot.snapshot is not None)
        phases.mark("envd")
        what = "boot" if boot.snapshot is None else "resume" if kept else "restore"
        log.info("%s %s: %s in %s", self.name, spec.sandbox_id, what, phases.summary())
        # The orchestrator records the template root in snapshots: sandboxes restored from them need it.
        rootfs = str(spec.template.rootfs)
        return SandboxInstance(
            spec.sandbox_id,
            self.name,
            url,
            net.sandbox_ip,
            state.to_json(),
            template_rootfs=rootfs,
            network=net,
        )

    def _vmm_brings_tap(self, sandbox_id: str, boot: Boot, *, kept: bool) -> bool:
        """Whether the VMM that will run ``boot`` has a tap of its own to move into the netns
        (a pre-started one), so the network set-up creates none (``kept``: the network, and
        its tap, are a paused sandbox's)."""
        return False

    async def _plug_network(
        self, spec: SandboxSpec, paths: P, state: S, *, tap_device: bool = True
    ) -> SandboxNetwork:
        net = await network.setup_network(
            self.settings,
            spec.sandbox_id,
            allow_internet_access=spec.allow_internet_access,
            egress=spec.egress,
        )
        state.network = net
        write_marker(paths, state)
        if tap_device:
            await vmnet.add_tap(self.settings, net)
        else:
            await vmnet.add_tap(self.settings, net, device=False)
        return net

    def _vm_alive(self, state: S, paths: P) -> Alive:
        """Asks whether the VM process ``state`` records is still running."""

        async def alive() -> bool:
            return pid_alive(state.pid, self.process_name, self._vm_owner(state, paths))

        return alive

    async def _wait_envd(self, url: str, paths: P, state: S, *, restored: bool) -> None:
        # A restored envd is already listening: it answers within milliseconds of the vCPUs
        # running again, so a coarse poll would only add latency.
        interval = 0.005 if restored else 0.1
        alive = self._vm_alive(state, paths)
        await wait_for_envd(url, self._envd_timeout(), alive, paths.console, interval=interval)

    # -- stop ---------------------------------------------------------------------------------

    async def kill(self, instance: SandboxInstance) -> None:
        await self._destroy(instance.sandbox_id, self._state(instance))

    async def halt(self, instance: SandboxInstance) -> None:
        paths = self.paths(instance.sandbox_id)
        state = self._recorded(paths, instance)
        for pid, name in self._vm_processes(state, paths):
            await kill_pid(pid, name, owner=self._vm_owner(state, paths))

    async def _destroy(self, sandbox_id: str, state: S) -> None:
        paths = self.paths(sandbox_id)
        # The marker is what this node holds for the sandbox now (a pause rewrote it; the
        # caller's state may be the one from before the pause).
        state = read_marker(paths, self._state_type()) or state
        await self._stop_vm(sandbox_id, paths, state)
        await network.teardown_network(self.settings, sandbox_id, state.network)
        shutil.rmtree(paths.root, ignore_errors=True)

    async def _stop_vm(self, sandbox_id: str, paths: P, state: S) -> None:
        """Kill the VM's processes, delete its drive directory and runtime files; the network and
        the sandbox directory stay."""
        for pid, name in self._vm_processes(state, paths):
            await kill_pid(pid, name, owner=self._vm_owner(state, paths))
        await asyncio.to_thread(ReflinkPool(self.settings.data_dir).remove_tree, paths.layer_dir)
        for leftover in paths.runtime_files:
            leftover.unlink(missing_ok=True)
        self._cpu.forget(sandbox_id)

    async def _stop_keeping_network(self, instance: SandboxInstance, paths: P) -> None:
        """After a pause: the VM process and its drive go (the snapshot has both), the network
        stays for the resume; the marker says so (``paused``), and a kill removes it all."""
        state = self._recorded(paths, instance)
        await self._stop_vm(instance.sandbox_id, paths, state)
        write_marker(paths, self._state_type().paused_with(state.network))

    # -- state --------------------------------------------------------------------------------

    async def is_alive(self, instance: SandboxInstance) -> bool:
        paths, state = self.paths(instance.sandbox_id), self._state(instance)
        return pid_alive(state.pid, self.process_name, self._vm_owner(state, paths))

    async def metrics(self, instance: SandboxInstance) -> SandboxMetrics:
        state = self._state(instance)
        vcpus, mem_total = state.vcpus, state.memory_mb << 20
        if not await self.is_alive(instance):
            raise NotFound(f"sandbox {instance.sandbox_id} is not running")
        try:
            proc = psutil.Process(state.pid)
            times = proc.cpu_times()
            rss = proc.memory_info().rss
        except psutil.Error as exc:
            raise NotFound(f"sandbox {instance.sandbox_id} is not running: {exc}") from exc
        pct = self._cpu.percent(instance.sandbox_id, times.user + times.system, vcpus) or 0.0
        disk_used, disk_total = await asyncio.to_thread(allocated_and_size, Path(state.upper))
        return SandboxMetrics(vcpus, pct, min(rss, mem_total), mem_total, disk_used, disk_total)

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed = []
        for directory in sorted((self.settings.data_dir / "sandboxes").glob("*")):
            sandbox_id = directory.name
            if sandbox_id not in keep and self.paths(sandbox_id).marker.exists():
                await self._destroy(sandbox_id, self._state_type()())
                removed.append(sandbox_id)
        await asyncio.to_thread(remove_orphan_snapshot_disks, self.settings)
        return removed

    async def collect_garbage(self, live_snapshots: LiveSnapshots) -> list[str]:
        """Free the disk layers of deleted snapshots. Whether a layer is used is read from the
        snapshot directories themselves (their ``upper.ext4`` links), which also covers snapshots
        being written right now; ``live_snapshots`` is not needed."""
        return await asyncio.to_thread(remove_orphan_snapshot_disks, self.settings)
