"""Firecracker runtime: one ``firecracker`` VMM per sandbox, driven through its API socket.

Per sandbox, beside the drive directory of :mod:`forkyard.runtime.microvm.runtime`::

    {data_dir}/sandboxes/<id>/firecracker.json  marker + what the VM was started with (recovery)
                              api.sock          the VMM's API socket
                              uffd.sock         the page server's socket (uffd restores only)
                              console.log       the VMM's stdout: the guest's serial console
                              firecracker.log, metrics.json
    {data_dir}/layers/sandboxes/<id>/           the VMM's working directory (see below):
                              upper.ext4        private writable drive (reflink clone)
                              vsock.sock        the guest's vsock

The guest artifacts are the same as QEMU's (:mod:`forkyard.storage.images`): the kernel and
initramfs, the read-only base and envd drives, and the per-sandbox upper drive. The VMM runs in
the sandbox's netns with ``tap0`` (:mod:`forkyard.runtime.microvm.vmnet`), so envd answers at the
sandbox address exactly as under the other runtimes.

Firecracker records drive paths in a snapshot verbatim and cannot override them on load. The
upper drive is therefore given as the *relative* path ``upper.ext4`` and every VMM runs with its
own drive directory as cwd: a restored VM opens its own reflink clone.

Snapshots are ``Full``, or ``Diff`` when ``dest.parent`` is the snapshot the VM's dirty-page log
runs from (:meth:`FirecrackerRuntime.snapshot`). A diff is applied onto a copy of the parent's
memory, so every snapshot directory holds one complete ``memory.bin`` and never needs its parent
again. Restore maps that file MAP_PRIVATE (``mem_backend`` ``File``), which every VM restored
from one snapshot shares; ``settings.firecracker.uffd`` instead starts a page-fault server
(:mod:`.uffd`) per restored VM on ``uffd.sock`` that fills guest pages lazily.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import httpx

from forkyard.config import FirecrackerSettings, Settings
from forkyard.errors import Failed, Unavailable
from forkyard.runtime.base import Capability
from forkyard.runtime.firecracker import api, balloon
from forkyard.runtime.firecracker.memory import apply_diff_memory, copy_cow
from forkyard.runtime.firecracker_version import binary_version, binary_version_problem
from forkyard.runtime.kinds import firecracker_unusable_reason
from forkyard.runtime.microvm import vmnet
from forkyard.runtime.microvm.disks import snapshot_disk
from forkyard.runtime.microvm.runtime import (
    Boot,
    MicroVmRuntime,
    Phases,
    VmPaths,
    write_marker,
    write_snapshot_meta,
)
from forkyard.runtime.microvm.state import MicroVMState
from forkyard.runtime.network import SandboxNetwork
from forkyard.storage.images import GuestImages
from forkyard.types import RuntimeName, SandboxInstance, SnapshotRef

log = logging.getLogger(__name__)

UPPER_NAME = "upper.ext4"
VSOCK_NAME = "vsock.sock"
SNAPSHOT_STATE = "vmstate.bin"
SNAPSHOT_MEMORY = "memory.bin"
SNAPSHOT_DIFF = "memory.diff"
#: Seconds a snapshot request may take (it writes all of guest memory for a Full one).
SNAPSHOT_TIMEOUT = 300.0
#: ``argv[0]`` part of a page-fault server (``python -m forkyard.runtime.firecracker.uffd``).
UFFD_PROCESS = "python"


@dataclass(frozen=True)
class FcPaths(VmPaths):
    MARKER = "firecracker.json"
    #: The VMM's stdout: the guest's serial console (ttyS0) ends up here.
    CONSOLE = "console.log"

    @property
    def api_socket(self) -> Path:
        return self.root / "api.sock"

    @property
    def vsock(self) -> Path:
        """Relative to the VMM's cwd (the drive directory), like the upper drive: a snapshot
        records it verbatim, and every restored VMM must bind its own socket."""
        return Path(VSOCK_NAME)

    @property
    def log(self) -> Path:
        return self.root / "firecracker.log"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def uffd_socket(self) -> Path:
        return self.root / "uffd.sock"

    @property
    def runtime_files(self) -> tuple[Path, ...]:
        return self.api_socket, self.uffd_socket


def fc_paths(settings: Settings, sandbox_id: str) -> FcPaths:
    return FcPaths.of(settings, sandbox_id)


def boot_requests(
    images: GuestImages,
    paths: FcPaths,
    *,
    vcpus: int,
    memory_mb: int,
    kernel: Path,
    boot_args: str,
    level: api.ApiLevel = api.NEWEST,
) -> list[api.ApiRequest]:
    """Everything sent before InstanceStart, in order."""
    return [
        api.logger(paths.log),
        api.metrics(paths.metrics),
        api.machine_config(vcpus, memory_mb, track_dirty_pages=True),
        api.boot_source(kernel, images.kernel.initramfs, boot_args),
        api.drive("base", str(images.base), read_only=True),
        api.drive("upper", UPPER_NAME, read_only=False),
        api.drive("envd", str(images.envd), read_only=True),
        api.network_interface("eth0", vmnet.TAP_NAME, vmnet.GUEST_MAC),
        api.vsock(paths.vsock),
        api.balloon(0, level=level),
        api.instance_start(),
    ]


def restore_requests(
    paths: FcPaths, source: Path, *, uffd: bool, level: api.ApiLevel = api.NEWEST
) -> list[api.ApiRequest]:
    backend = paths.uffd_socket if uffd else source / SNAPSHOT_MEMORY
    return [
        api.logger(paths.log),
        api.metrics(paths.metrics),
        api.snapshot_load(
            source / SNAPSHOT_STATE,
            backend,
            backend_type="Uffd" if uffd else "File",
            resume=True,
            level=level,
        ),
    ]


@dataclass
class FirecrackerState(MicroVMState):
    """What the Firecracker runtime records of a sandbox (the instance's state and its marker)."""

    #: The userfaultfd page server of a restored VM (:mod:`.uffd`), when one serves it.
    uffd_pid: int | None = None
    #: Whether the guest runs in PVM mode (a snapshot restores only in its own mode).
    pvm: bool = False
    #: The snapshot the VM's dirty-page log runs from (None: no diff can be taken).
    dirty_since: str | None = None


def diff_base(state: FirecrackerState, dest: SnapshotRef) -> bool:
    """Whether ``dest`` can be a ``Diff`` snapshot; if so, a copy of the parent's memory, which the
    diff is applied onto, is made in ``dest`` first (the parent may be deleted meanwhile).

    Firecracker's diff holds the pages dirtied since the VM was last snapshotted or loaded, so
    the parent must be exactly that snapshot (``state.dirty_since``), and its memory present."""
    parent = dest.parent
    if parent is None:
        return False
    if state.dirty_since != parent.snapshot_id:
        log.info(
            "firecracker snapshot %s: Full, the VM's dirty pages count from %s, not from its parent %s",
            dest.snapshot_id,
            state.dirty_since,
            parent.snapshot_id,
        )
        return False
    try:
        copy_cow(parent.path / SNAPSHOT_MEMORY, dest.path / SNAPSHOT_MEMORY)
    except OSError as exc:
        log.info(
            "firecracker snapshot %s: Full, the memory of %s is gone: %s",
            dest.snapshot_id,
            parent.snapshot_id,
            exc,
        )
        return False
    return True


def complete_diff_memory(dest: SnapshotRef, diff: Path) -> None:
    """Apply the diff's dirty pages onto the copy of the parent's memory :func:`diff_base` made:
    ``dest`` then holds one complete ``memory.bin``."""
    apply_diff_memory(diff, dest.path / SNAPSHOT_MEMORY)
    diff.unlink()


class FirecrackerRuntime(MicroVmRuntime[FcPaths, FirecrackerState]):
    name: ClassVar[RuntimeName] = "firecracker"
    capabilities = frozenset({Capability.FREEZE})
    process_name: ClassVar[str] = "firecracker"
    snapshot_file: ClassVar[str] = SNAPSHOT_STATE

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        #: Waiters that reap exited VMMs and page servers (kept referenced so they are not
        #: garbage-collected).
        self._reapers: set[asyncio.Task[int]] = set()

    @property
    def fc(self) -> FirecrackerSettings:
        return self.settings.firecracker

    # -- availability -------------------------------------------------------------------------

    def probe(self) -> str | None:
        return firecracker_unusable_reason(self.settings)

    def platform(self) -> str:
        return "pvm" if self.fc.pvm else "kvm"

    def kernel(self, images: GuestImages) -> Path:
        if self.fc.pvm:
            if self.fc.pvm_kernel is None:
                raise Unavailable("PVM mode needs FORKYARD_FIRECRACKER__PVM_KERNEL (a PVM guest vmlinux)")
            return self.fc.pvm_kernel
        return self.fc.kernel or images.kernel.vmlinux

    def boot_args(self, images: GuestImages, paths: FcPaths | None = None) -> str:
        gateway, guest = vmnet.guest_addresses(self.settings)
        # Firecracker has no PCI bus and no i8042; the kernel must not wait for either.
        args = images.cmdline(guest, gateway) + " pci=off i8042.noaux i8042.nomux i8042.dumbkbd"
        if paths is not None:
            # The guest's init finds its drives by serial; Firecracker's serials come from the files.
            drives = {"base": images.base, "upper": paths.upper, "envd": images.envd}
            args += "".join(f" forkyard.serial.{name}={api.blk_serial(p)}" for name, p in drives.items())
        return args

    def paths(self, sandbox_id: str) -> FcPaths:
        return FcPaths.of(self.settings, sandbox_id)

    # -- the hooks of MicroVmRuntime ----------------------------------------------------------

    def _envd_timeout(self) -> float:
        return self.fc.boot_timeout

    def _state_type(self) -> type[FirecrackerState]:
        return FirecrackerState

    def _extra_state(self, boot: Boot, state: FirecrackerState) -> None:
        state.pvm = self.fc.pvm
        # Loading a snapshot resets the dirty-page log: the next diff is relative to it.
        state.dirty_since = boot.snapshot.snapshot_id if boot.snapshot else None

    def _check_restorable(self, boot: Boot) -> None:
        taken_pvm = bool(boot.meta.get("pvm", False))
        if taken_pvm != self.fc.pvm:
            snapshot_id = boot.snapshot.snapshot_id if boot.snapshot else "?"
            mode = {True: "PVM", False: "KVM"}
            raise Unavailable(
                f"snapshot {snapshot_id} was taken in {mode[taken_pvm]} mode; firecracker here runs "
                f"{mode[self.fc.pvm]} guests"
            )

    def _vm_processes(self, state: FirecrackerState, paths: FcPaths) -> list[tuple[int | None, str]]:
        return [(state.pid, self.process_name), (state.uffd_pid, UFFD_PROCESS)]

    async def _launch(
        self, net: SandboxNetwork, boot: Boot, paths: FcPaths, state: FirecrackerState, phases: Phases
    ) -> None:
        # Firecracker opens, never creates, its log and metrics files.
        for output in (paths.log, paths.metrics):
            output.touch()
        state.pid = await self._spawn(net, paths)
        write_marker(paths, state)
        phases.mark("spawn")
        client = api.FirecrackerClient(paths.api_socket)
        try:
            await client.wait_ready(self.fc.boot_timeout, self._vm_alive(state, paths))
            await client.send_all(await self._start_requests(boot, paths, state))
        finally:
            await client.close()
        phases.mark("boot" if boot.snapshot is None else "load")

    async def _start_requests(
        self, boot: Boot, paths: FcPaths, state: FirecrackerState
    ) -> list[api.ApiRequest]:
        level = await asyncio.to_thread(self.api_level)
        if boot.snapshot is None:
            return boot_requests(
                boot.images,
                paths,
                vcpus=boot.vcpus,
                memory_mb=boot.memory_mb,
                kernel=self.kernel(boot.images),
                boot_args=self.boot_args(boot.images, paths),
                level=level,
            )
        if self.fc.uffd:
            state.uffd_pid = await self._start_uffd_handler(paths, boot.snapshot.path / SNAPSHOT_MEMORY)
            write_marker(paths, state)
        return restore_requests(paths, boot.snapshot.path, uffd=self.fc.uffd, level=level)

    def api_level(self) -> api.ApiLevel:
        """What the configured binary's release accepts (checked supported at its start)."""
        version = binary_version(self.fc.binary)
        return api.ApiLevel(version) if version is not None else api.NEWEST

    async def _spawn(self, net: SandboxNetwork, paths: FcPaths) -> int:
        """Start the VMM in the sandbox's netns, cwd = its drive directory (see module doc)."""
        binary = self.fc.binary
        if shutil.which(binary) is None:
            raise Unavailable(f"firecracker binary {binary!r} not found (see docs/KVM.md)")
        problem = await asyncio.to_thread(binary_version_problem, binary)
        if problem is not None:
            raise Unavailable(f"{problem} (see docs/KVM.md)")
        # The child inherits the descriptor; the parent's copy is closed right after the spawn.
        console = await asyncio.to_thread(open, paths.console, "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                "nsenter",
                f"--net={net.netns_path}",
                "--",
                binary,
                "--api-sock",
                str(paths.api_socket),
                "--id",
                net.sandbox_id[:60],
                cwd=paths.layer_dir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=console,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            console.close()
        # nsenter execs the VMM in place, so this pid is firecracker's own.
        self._reap(proc)
        return proc.pid

    async def _start_uffd_handler(self, paths: FcPaths, memory: Path) -> int:
        """One page-fault server per restored VM (:mod:`.uffd`); it exits with its VMM."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "forkyard.runtime.firecracker.uffd",
            str(paths.uffd_socket),
            str(memory),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        self._reap(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        if line.strip() != b"ready":
            raise Failed("the userfaultfd page server did not start")
        return proc.pid

    def _reap(self, proc: asyncio.subprocess.Process) -> None:
        """Wait for the child in the background: an exited VMM must not stay a zombie."""
        reaper = asyncio.get_running_loop().create_task(proc.wait())
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)

    # -- snapshots ----------------------------------------------------------------------------

    async def freeze(self, instance: SandboxInstance) -> None:
        """Inflate the balloon over the guest's idle memory (:mod:`.balloon`: the host gets it
        back while the sandbox is frozen), then pause the vCPUs (``PATCH /vm``): devices, tap and
        address stay."""
        client = api.FirecrackerClient(self.paths(instance.sandbox_id).api_socket, timeout=SNAPSHOT_TIMEOUT)
        try:
            if self.fc.freeze_balloon_keep_mib > 0:
                started = time.monotonic()
                inflation = await balloon.inflate_for_freeze(
                    client, keep_mib=self.fc.freeze_balloon_keep_mib, within=self.fc.freeze_balloon_seconds
                )
                log.info(
                    "firecracker %s: freeze: %s in %d ms",
                    instance.sandbox_id,
                    inflation.summary(),
                    (time.monotonic() - started) * 1000,
                )
            await client.send(api.vm_state("Paused"))
        finally:
            await client.close()

    async def thaw(self, instance: SandboxInstance) -> None:
        """Run the vCPUs again and deflate the balloon a freeze inflated."""
        client = api.FirecrackerClient(self.paths(instance.sandbox_id).api_socket, timeout=SNAPSHOT_TIMEOUT)
        try:
            await client.send(api.vm_state("Resumed"))
            if self.fc.freeze_balloon_keep_mib > 0:
                await balloon.deflate(client)
        finally:
            await client.close()

    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Pause the vCPUs, write VM state and memory, clone the upper drive, then resume (or, with
        ``stop``, stop the VM and keep its network for the resume: a pause).

        ``Diff`` when ``dest.parent`` is the snapshot this VM's dirty-page log runs from (the one
        it was last snapshotted to, or restored from) and that snapshot's memory is still there:
        only the pages dirtied since are written while the VM is paused, and applied after the
        resume onto a copy of the parent's memory. Otherwise ``Full``. A failed snapshot leaves
        the VM running, and the next one ``Full``."""
        paths = self.paths(instance.sandbox_id)
        state = self._recorded(paths, instance)
        dest.path.mkdir(parents=True, exist_ok=True)
        phases = Phases()
        diff = await asyncio.to_thread(diff_base, state, dest)
        phases.mark("base")
        # Creating a snapshot resets the dirty-page log even when a later step fails: until this
        # one is complete, no snapshot is a valid parent.
        state.dirty_since = None
        write_marker(paths, state)
        await self._save(paths, state, dest, diff=diff, stop=stop, phases=phases)
        if stop:
            await self._stop_keeping_network(instance, paths)
        else:
            state.dirty_since = dest.snapshot_id
            write_marker(paths, state)
        log.info(
            "firecracker %s: %s (%s) in %s",
            instance.sandbox_id,
            "pause" if stop else "snapshot",
            "Diff" if diff else "Full",
            phases.summary(),
        )

    async def _save(
        self,
        paths: FcPaths,
        state: FirecrackerState,
        dest: SnapshotRef,
        *,
        diff: bool,
        stop: bool,
        phases: Phases,
    ) -> None:
        """Everything of a snapshot from the pause on; on failure the VM runs again."""
        memory = dest.path / (SNAPSHOT_DIFF if diff else SNAPSHOT_MEMORY)
        client = api.FirecrackerClient(paths.api_socket, timeout=SNAPSHOT_TIMEOUT)
        try:
            await client.send(api.vm_state("Paused"))
            try:
                kind: api.SnapshotType = "Diff" if diff else "Full"
                await client.send(api.snapshot_create(dest.path / SNAPSHOT_STATE, memory, kind))
                # vCPUs are stopped and Firecracker's Sync engine has written every completed
                # request: the upper drive file is consistent with the memory image.
                await asyncio.to_thread(snapshot_disk, self.settings, paths.upper, dest)
                phases.mark("save")
                if not stop:
                    await client.send(api.vm_state("Resumed"))
                if diff:
                    await asyncio.to_thread(complete_diff_memory, dest, memory)
                write_snapshot_meta(
                    dest,
                    state,
                    pvm=state.pvm,
                    runtime=self.name,
                    type=kind,
                    parent=dest.parent.snapshot_id if diff and dest.parent else None,
                )
                phases.mark("merge" if diff else "meta")
            except BaseException:
                # Resuming a running VM is a no-op: whichever step failed, the VM runs again.
                with contextlib.suppress(api.FirecrackerApiError, httpx.HTTPError):
                    await client.send(api.vm_state("Resumed"))
                raise
        finally:
            await client.close()
