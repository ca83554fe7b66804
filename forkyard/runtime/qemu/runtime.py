"""QEMU runtime: ``qemu-system-x86_64 -M microvm`` per sandbox, under KVM or TCG (``settings.qemu.accel``).

Per sandbox, beside the drive directory of :mod:`forkyard.runtime.microvm.runtime`::

    {data_dir}/sandboxes/<id>/qemu.json   marker + what the VM was started with (orphan recovery)
                              qmp.sock    QMP control socket
                              serial.log  the guest's serial console (kernel, init, envd output)
                              qemu.log    QEMU's own output
                              qemu.pid    pid of the daemonised QEMU

Devices are virtio-mmio (the microvm machine has no PCI): the read-only base image, the upper
drive and the read-only envd drive (virtio-blk, identified by serial), and virtio-net on
``tap0`` inside the sandbox's netns (QEMU is started in that netns), see
:mod:`forkyard.runtime.microvm.vmnet`.

Guest RAM (``settings.qemu.memory``):

* ``file`` (default): a ``memory-backend-file`` (``share=on``) on ``memory.ram`` in the drive
  directory (:mod:`.memory`). A snapshot, taken while the vCPUs are stopped, is a reflink clone of
  that file and of the upper drive plus QEMU's device state only (``memory.bin``, migrated with
  the capability ``x-ignore-shared``, which skips shared RAM). A restore maps a reflink clone of
  the snapshot's RAM file in a QEMU started with ``-incoming defer`` (a spare one when there is
  one, :mod:`.spares`) and loads only the device state: restore time does not grow with guest
  memory, and every restored VM writes to its own clone.
* ``stream``: anonymous RAM, a snapshot migrates RAM and device state to ``memory.bin`` (QEMU 7.2
  has no ``file:`` migration URI, so ``exec:cat``); a restore reads it all (``-incoming fd:N``).

Either way snapshots are full (no incremental RAM: with a file backend QEMU's dirty-page log
only feeds its own migration of that RAM, which ``x-ignore-shared`` turns off; the reflink
clone shares every unchanged block with its source on disk instead). A snapshot records its mode
(``vm.json`` ``memory``), so a restore follows the snapshot, whatever the setting is now.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from forkyard.config import Settings
from forkyard.errors import Failed, Unavailable
from forkyard.runtime.base import Capability, log_tail
from forkyard.runtime.kvm import kvm_unusable_reason
from forkyard.runtime.microvm import vmnet
from forkyard.runtime.microvm.disks import SNAPSHOT_UPPER, snapshot_disk, snapshot_layer_file
from forkyard.runtime.microvm.host import kill_pid, pid_alive
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
from forkyard.runtime.qemu.memory import RAM_FILE, clone_into, create_ram_file
from forkyard.runtime.qemu.qmp import Qmp, QmpError
from forkyard.runtime.qemu.spares import SPARES_DIR, Shape, Spare, SparePool
from forkyard.storage.images import GuestImages
from forkyard.storage.reflink import ReflinkPool
from forkyard.types import RuntimeName, SandboxInstance, SandboxSpec, SnapshotRef

log = logging.getLogger(__name__)

Accel = Literal["kvm", "tcg"]
Memory = Literal["file", "stream"]
#: TCG boots a kernel and a python envd several times slower than KVM.
ENVD_TIMEOUT_KVM = 60.0
ENVD_TIMEOUT_TCG = 300.0
SNAPSHOT_MEMORY = "memory.bin"
#: Bytes/s: effectively unlimited (a migration to a local file has nothing to protect).
MIGRATION_BANDWIDTH = 1 << 40
#: QEMU fd set (``-add-fd``) that holds a spare's upper drive.
UPPER_FDSET = 1


@dataclass(frozen=True)
class QemuPaths(VmPaths):
    MARKER = "qemu.json"
    CONSOLE = "serial.log"

    @property
    def qmp(self) -> Path:
        return self.root / "qmp.sock"

    @property
    def qemu_log(self) -> Path:
        return self.root / "qemu.log"

    @property
    def pidfile(self) -> Path:
        return self.root / "qemu.pid"

    @property
    def ram(self) -> Path:
        return self.layer_dir / RAM_FILE

    @property
    def runtime_files(self) -> tuple[Path, ...]:
        return self.pidfile, self.qmp

    @property
    def vm_files(self) -> tuple[Path, ...]:
        """What a spare QEMU has open in its own directories (moved into a sandbox's on adoption)."""
        return self.qmp, self.console, self.qemu_log, self.pidfile


def vm_paths(settings: Settings, sandbox_id: str) -> QemuPaths:
    return QemuPaths.of(settings, sandbox_id)


def tcg_clock_args(accel: Accel) -> str:
    """Under TCG the guest reads the host's TSC, but calibrating it against the emulated PIT
    fails on a busy host and the kernel then hangs in early boot: tell it the frequency."""
    if accel != "tcg":
        return ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return f" tsc_early_khz={int(float(line.partition(':')[2]) * 1000)}"
    return ""


def _read_pidfile(paths: QemuPaths) -> int | None:
    try:
        return int(paths.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _device_state_uri(memory_bin: Path, fd: int | None) -> str:
    # QEMU hands an exec: URI to /bin/sh: quote the path.
    return f"fd:{fd}" if fd is not None else f"exec:cat {shlex.quote(str(memory_bin))}"


@dataclass
class QemuState(MicroVMState):
    """What the QEMU runtime records of a sandbox (the instance's state and its marker)."""

    #: Where the VM's RAM lives (the module docstring); rows from before RAM files streamed.
    memory: Memory = "stream"


class QemuRuntime(MicroVmRuntime[QemuPaths, QemuState]):
    name: ClassVar[RuntimeName] = "qemu"
    capabilities = frozenset({Capability.FREEZE})
    process_name: ClassVar[str] = "qemu"
    snapshot_file: ClassVar[str] = SNAPSHOT_MEMORY

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        #: Spares taken for restores under way (sandbox id -> spare, and whether the sandbox's
        #: network has a tap0 already), until adopted.
        self._claimed: dict[str, tuple[Spare, bool]] = {}
        self._spares = SparePool(
            settings.qemu.prespawn, self._spawn_spare, self._discard_spare, self._spare_alive
        )

    # -- availability -------------------------------------------------------------------------

    def probe(self) -> str | None:
        qemu = self.settings.qemu.qemu_path
        if shutil.which(qemu) is None:
            return f"{qemu} not found (apt-get install qemu-system-x86)"
        if os.geteuid() != 0:
            return "the qemu runtime needs root (network namespaces, tap devices, loop-mounted reflink pool)"
        if self.settings.qemu.accel == "kvm":
            reason = kvm_unusable_reason()
            if reason is not None:
                return f"FORKYARD_QEMU__ACCEL=kvm, but {reason}"
        return None

    def platform(self) -> str:
        return str(self.accel)

    @functools.cached_property
    def accel(self) -> Accel:
        """The accelerator every VM of this runtime uses: ``auto`` is KVM when /dev/kvm can boot
        guests, else TCG (decided once: it is asked on every start and snapshot)."""
        choice = self.settings.qemu.accel
        if choice == "kvm" or choice == "tcg":
            return choice
        return "kvm" if kvm_unusable_reason() is None else "tcg"

    def paths(self, sandbox_id: str) -> QemuPaths:
        return QemuPaths.of(self.settings, sandbox_id)

    @property
    def spares(self) -> SparePool:
        return self._spares

    def spare_paths(self, token: str) -> QemuPaths:
        return QemuPaths(
            root=self.settings.data_dir / SPARES_DIR / token,
            layer_dir=ReflinkPool(self.settings.data_dir).root / SPARES_DIR / token,
        )

    # -- command line -------------------------------------------------------------------------

    def command(
        self,
        images: GuestImages,
        paths: QemuPaths,
        *,
        vcpus: int,
        memory_mb: int,
        memory: Memory = "stream",
        incoming: str | None = None,
        tap: str = vmnet.TAP_NAME,
        upper_fds: tuple[int, int] | None = None,
    ) -> list[str]:
        """``incoming``: ``defer`` (device state comes by ``migrate-incoming``) or a URI.
        ``upper_fds``: (read-only, read-write) descriptors of the upper drive, given instead of
        its path (see :meth:`_spawn_spare`)."""
        accel = self.accel
        gateway, guest = vmnet.guest_addresses(self.settings)
        upper: Path | str = paths.upper if upper_fds is None else f"/dev/fdset/{UPPER_FDSET}"
        drives = [("base", images.base, True), ("upper", upper, False), ("envd", images.envd, True)]
        machine = f"microvm,accel={accel}" + (",pit=on,pic=on,rtc=on" if accel == "tcg" else "")
        if memory == "file":
            machine += ",memory-backend=ram0"
        cmd = [
            # TCG: legacy PIT/PIC/RTC as timer references (KVM guests have kvmclock).
            self.settings.qemu.qemu_path,
            "-M",
            machine,
            "-cpu",
            "host" if accel == "kvm" else "max",
            "-m",
            str(memory_mb),
            "-smp",
            str(vcpus),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-kernel",
            str(images.kernel.vmlinux),
            "-initrd",
            str(images.kernel.initramfs),
            "-append",
            images.cmdline(guest, gateway) + " earlyprintk=ttyS0" + tcg_clock_args(accel),
            "-serial",
            f"file:{paths.console}",
            "-qmp",
            f"unix:{paths.qmp},server=on,wait=off",
            "-pidfile",
            str(paths.pidfile),
            "-daemonize",
            "-netdev",
            f"tap,id=net0,ifname={tap},script=no,downscript=no",
            "-device",
            f"virtio-net-device,netdev=net0,mac={vmnet.GUEST_MAC}",
        ]
        for fd in upper_fds or ():
            cmd += ["-add-fd", f"fd={fd},set={UPPER_FDSET}"]
        if memory == "file":
            cmd += ["-object", f"memory-backend-file,id=ram0,size={memory_mb}M,mem-path={paths.ram},share=on"]
        for serial, path, readonly in drives:
            ro = ",readonly=on" if readonly else ""
            cmd += [
                "-drive",
                f"id={serial},file={path},format=raw,if=none,cache=unsafe{ro}",
                "-device",
                f"virtio-blk-device,drive={serial},serial={serial}",
            ]
        if incoming is not None:
            cmd += ["-incoming", incoming]
        return cmd

    # -- the hooks of MicroVmRuntime ----------------------------------------------------------

    def _envd_timeout(self) -> float:
        return ENVD_TIMEOUT_KVM if self.accel == "kvm" else ENVD_TIMEOUT_TCG

    def _state_type(self) -> type[QemuState]:
        return QemuState

    def _extra_state(self, boot: Boot, state: QemuState) -> None:
        state.memory = self._memory_of(boot)

    def _memory_of(self, boot: Boot) -> Memory:
        # A restore follows its snapshot (one taken before RAM files has no ``memory``).
        memory: Memory = boot.meta.get("memory", "stream") if boot.snapshot else self.settings.qemu.memory
        return memory

    def _vm_processes(self, state: QemuState, paths: QemuPaths) -> list[tuple[int | None, str]]:
        # Without a recorded pid (a start cut short) the daemonised QEMU may still have written one.
        return [(state.pid or _read_pidfile(paths), self.process_name)]

    def _check_restorable(self, boot: Boot) -> None:
        # The CPU model differs (KVM: host, TCG: max): a migration stream does not cross over.
        taken = boot.meta.get("accel")
        if taken is not None and taken != self.accel:
            snapshot_id = boot.snapshot.snapshot_id if boot.snapshot else "?"
            raise Unavailable(f"snapshot {snapshot_id} was taken under {taken}; QEMU here runs {self.accel}")

    async def _start(self, spec: SandboxSpec, boot: Boot) -> SandboxInstance:
        instance = await super()._start(spec, boot)
        if self._state(instance).memory == "file":
            # Restores (resume, fork, snapshot children) of this shape are likely next.
            self._spares.want(Shape(boot.images, boot.vcpus, boot.memory_mb))
        return instance

    async def _launch(
        self, net: SandboxNetwork, boot: Boot, paths: QemuPaths, state: QemuState, phases: Phases
    ) -> None:
        memory = state.memory
        if boot.snapshot is None:
            if memory == "file":
                await asyncio.to_thread(create_ram_file, paths.ram, boot.memory_mb)
            state.pid = await self._spawn(net, boot, paths, memory=memory)
            write_marker(paths, state)
            phases.mark("spawn")
            return
        if memory == "stream":
            await self._restore_stream(net, boot.snapshot, boot, paths, state, phases)
        else:
            await self._restore_mapped(net, boot.snapshot, boot, paths, state, phases)
        phases.mark("incoming")

    async def _restore_mapped(
        self,
        net: SandboxNetwork,
        snapshot: SnapshotRef,
        boot: Boot,
        paths: QemuPaths,
        state: QemuState,
        phases: Phases,
    ) -> None:
        """The RAM-file path: a spare (taken by :meth:`_vmm_brings_tap`) or a new QEMU maps a
        clone of the snapshot's RAM file; only device state is loaded."""
        memory_bin = snapshot.path / SNAPSHOT_MEMORY
        claimed = self._claimed.pop(paths.root.name, None)
        if claimed is not None:
            await self._adopt(claimed, net, snapshot, paths, state, phases)
            await self._load_device_state(paths, _device_state_uri(memory_bin, None))
        else:
            ram = (snapshot.path / RAM_FILE).resolve()
            await asyncio.to_thread(ReflinkPool(self.settings.data_dir).clone, ram, paths.ram)
            phases.mark("ram")
            fd = os.open(memory_bin, os.O_RDONLY | os.O_CLOEXEC)
            try:
                state.pid = await self._spawn(net, boot, paths, memory="file", incoming="defer", fd=fd)
                write_marker(paths, state)
                phases.mark("spawn")
                await self._load_device_state(paths, _device_state_uri(memory_bin, fd))
            finally:
                os.close(fd)

    def _vmm_brings_tap(self, sandbox_id: str, boot: Boot, *, kept: bool) -> bool:
        """A restore of a RAM-file snapshot takes a spare now, if there is one: its tap moves in."""
        if boot.snapshot is None or boot.meta.get("memory") != "file":
            return False
        # A spare's drive placeholder has the upper template's size, which QEMU read at start.
        upper = boot.snapshot.path / SNAPSHOT_UPPER
        if upper.stat().st_size != boot.images.upper_template.stat().st_size:
            return False
        spare = self._spares.take(Shape(boot.images, boot.vcpus, boot.memory_mb))
        if spare is None:
            return False
        self._claimed[sandbox_id] = (spare, kept)
        return True

    async def _destroy(self, sandbox_id: str, state: QemuState) -> None:
        claimed = self._claimed.pop(sandbox_id, None)  # a start failed before adopting it
        if claimed is not None:
            await self._discard_spare(claimed[0])
        await super()._destroy(sandbox_id, state)

    async def _restore_stream(
        self,
        net: SandboxNetwork,
        snapshot: SnapshotRef,
        boot: Boot,
        paths: QemuPaths,
        state: QemuState,
        phases: Phases,
    ) -> None:
        """The stream path: QEMU reads RAM and device state from the open migration file."""
        fd = os.open(snapshot.path / SNAPSHOT_MEMORY, os.O_RDONLY | os.O_CLOEXEC)
        try:
            state.pid = await self._spawn(net, boot, paths, memory="stream", incoming=f"fd:{fd}", fd=fd)
        finally:
            os.close(fd)
        write_marker(paths, state)
        phases.mark("spawn")
        await self._wait_incoming(paths)

    async def _spawn(
        self,
        net: SandboxNetwork | None,
        boot: Boot,
        paths: QemuPaths,
        *,
        memory: Memory,
        incoming: str | None = None,
        fd: int | None = None,
        tap: str = vmnet.TAP_NAME,
        upper_fds: tuple[int, int] | None = None,
    ) -> int:
        """Start QEMU (in ``net``'s netns; None: the host's) and return its pid."""
        cmd = self.command(
            boot.images,
            paths,
            vcpus=boot.vcpus,
            memory_mb=boot.memory_mb,
            memory=memory,
            incoming=incoming,
            tap=tap,
            upper_fds=upper_fds,
        )
        if net is not None:
            # nsenter only switches the network namespace: QEMU opens tap0 there, files stay host's.
            cmd = ["nsenter", f"--net={net.netns_path}", "--", *cmd]
        pass_fds = (() if fd is None else (fd,)) + (upper_fds or ())
        await self._run_daemonizing(cmd, paths, pass_fds=pass_fds)
        pid = _read_pidfile(paths)
        if pid is None:
            raise Failed(f"qemu wrote no pid file: {log_tail(paths.qemu_log)}")
        return pid

    async def _run_daemonizing(
        self, cmd: list[str], paths: QemuPaths, pass_fds: tuple[int, ...] = ()
    ) -> None:
        # Output goes to a file, not a pipe: the daemonised QEMU would hold a pipe open forever.
        with open(paths.qemu_log, "ab") as out:  # noqa: ASYNC230  # local file, opened once
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                pass_fds=pass_fds,
            )
            code = await proc.wait()  # -daemonize: the parent exits once QEMU is initialised
        if code != 0 or not paths.pidfile.exists():
            raise Failed(f"qemu failed to start (exit {code}): {log_tail(paths.qemu_log)}")

    async def _load_device_state(self, paths: QemuPaths, uri: str) -> None:
        """A QEMU waiting with ``-incoming defer`` on a mapped RAM file: load the device state."""
        qmp = await Qmp.connect(paths.qmp)
        try:
            await _ignore_shared(qmp)
            await qmp.execute("migrate-incoming", {"uri": uri})
        finally:
            await qmp.close()
        await self._wait_incoming(paths)

    async def _wait_incoming(self, paths: QemuPaths, limit_s: float = 120.0) -> None:
        qmp = await Qmp.connect(paths.qmp)
        try:
            deadline = time.monotonic() + limit_s
            while True:
                status = (await qmp.execute("query-status")).get("status")
                if status == "running":
                    return
                if status == "paused":
                    # The snapshot was taken with the vCPUs stopped, so QEMU does not start
                    # them after the incoming migration by itself.
                    await qmp.execute("cont")
                    return
                if status not in ("inmigrate", "prelaunch", "restore-vm"):
                    raise Failed(f"restore failed: VM status {status}")
                if time.monotonic() > deadline:
                    raise Failed("restore: the incoming migration did not finish in time")
                await asyncio.sleep(0.005)
        finally:
            await qmp.close()

    # -- spares (QEMU started ahead of a restore) ----------------------------------------------

    async def _spawn_spare(self, shape: Shape) -> Spare:
        token = secrets.token_hex(4)
        paths = self.spare_paths(token)
        spare = Spare(token, shape.key, 0, paths)
        try:
            await asyncio.to_thread(self._spare_files, paths, shape)
            await vmnet.add_host_tap(spare.tap)
            pid = await self._spawn_spare_qemu(shape, spare)
        except BaseException:
            await self._discard_spare(spare)
            raise
        log.info("qemu spare %s started (pid %d)", token, pid)
        return Spare(token, shape.key, pid, paths)

    async def _spawn_spare_qemu(self, shape: Shape, spare: Spare) -> int:
        """The upper drive goes by descriptor: QEMU reopens its drives by name when it activates
        them after an incoming migration (read-only -> read-write), and the spare's file is
        renamed into the sandbox's directory by then. An fd set has one descriptor per access
        mode, which a reopen dups instead of opening a path."""
        paths: QemuPaths = spare.paths
        ro = os.open(paths.upper, os.O_RDONLY | os.O_CLOEXEC)
        rw = os.open(paths.upper, os.O_RDWR | os.O_CLOEXEC)
        try:
            boot = Boot(shape.images, shape.vcpus, shape.memory_mb)
            return await self._spawn(
                None, boot, paths, memory="file", incoming="defer", tap=spare.tap, upper_fds=(ro, rw)
            )
        finally:
            os.close(ro)
            os.close(rw)

    def _spare_files(self, paths: QemuPaths, shape: Shape) -> None:
        """Full-size placeholders QEMU opens at start (it reads the drive's size there); a restore
        clones the snapshot's files into them."""
        ReflinkPool(self.settings.data_dir).ensure()
        paths.root.mkdir(parents=True)
        create_ram_file(paths.ram, shape.memory_mb)
        with open(paths.upper, "wb") as f:
            f.truncate(shape.images.upper_template.stat().st_size)

    def _spare_alive(self, spare: Spare) -> bool:
        return pid_alive(spare.pid or _read_pidfile(spare.paths), self.process_name, str(spare.paths.root))

    async def _discard_spare(self, spare: Spare) -> None:
        paths: QemuPaths = spare.paths
        await kill_pid(spare.pid or _read_pidfile(paths), self.process_name, owner=str(paths.root))
        await vmnet.remove_host_tap(spare.tap)
        await asyncio.to_thread(self._remove_spare_dirs, paths)

    def _remove_spare_dirs(self, paths: QemuPaths) -> None:
        if paths.layer_dir.exists():
            ReflinkPool(self.settings.data_dir).remove_tree(paths.layer_dir)
        shutil.rmtree(paths.root, ignore_errors=True)

    async def _adopt(
        self,
        claimed: tuple[Spare, bool],
        net: SandboxNetwork,
        snapshot: SnapshotRef,
        paths: QemuPaths,
        state: QemuState,
        phases: Phases,
    ) -> None:
        """Make ``spare`` this sandbox's VM: the marker names it first (a crash from here on
        kills it with the sandbox), then its open files get the snapshot's content and move into
        the sandbox's directories, its tap into the sandbox's netns."""
        spare, tap_kept = claimed
        state.pid, state.vm_owner = spare.pid, str(spare.paths.root)
        write_marker(paths, state)
        try:
            await asyncio.to_thread(self._fill_spare, spare.paths, snapshot, paths)
            phases.mark("spare_files")
            await vmnet.adopt_tap(self.settings, net, spare.tap, replace=tap_kept)
            phases.mark("spare_tap")
        finally:
            await asyncio.to_thread(self._remove_spare_dirs, spare.paths)

    @staticmethod
    def _fill_spare(spare: QemuPaths, snapshot: SnapshotRef, paths: QemuPaths) -> None:
        clone_into((snapshot.path / RAM_FILE).resolve(), spare.ram)
        clone_into(paths.upper, spare.upper)  # the snapshot's drive, cloned by the start
        paths.layer_dir.mkdir(parents=True, exist_ok=True)
        for src, dst in ((spare.ram, paths.ram), (spare.upper, paths.upper)):
            os.replace(src, dst)
        for src, dst in zip(spare.vm_files, paths.vm_files, strict=True):
            os.replace(src, dst)

    async def stop_prestarted(self) -> None:
        """Kill the spares (node shutdown); sandboxes keep running."""
        await self._spares.close()

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        await self._remove_stray_spares()
        return await super().cleanup_orphans(keep)

    async def _remove_stray_spares(self) -> None:
        """Spares a crashed server left (their directories say so), not this pool's own."""
        live = self._spares.tokens()
        roots = (self.settings.data_dir / SPARES_DIR, ReflinkPool(self.settings.data_dir).root / SPARES_DIR)
        tokens = {p.name for root in roots if root.is_dir() for p in root.iterdir()} - live
        for token in sorted(tokens):
            log.info("recovery: removing stray qemu spare %s", token)
            await self._discard_spare(Spare(token, "", 0, self.spare_paths(token)))
        for root in roots:
            with contextlib.suppress(OSError):
                root.rmdir()

    # -- snapshots ----------------------------------------------------------------------------

    async def freeze(self, instance: SandboxInstance) -> None:
        """Stop the vCPUs (QMP ``stop``): RAM, devices, tap and address stay."""
        await self._qmp_command(instance, "stop")

    async def thaw(self, instance: SandboxInstance) -> None:
        await self._qmp_command(instance, "cont")

    async def _qmp_command(self, instance: SandboxInstance, command: str) -> None:
        qmp = await Qmp.connect(self.paths(instance.sandbox_id).qmp)
        try:
            await qmp.execute(command)
        finally:
            await qmp.close()

    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Stop the vCPUs, clone the RAM file (file mode) and the upper drive, migrate the device
        state (file mode) or RAM and device state (stream mode) to ``memory.bin``.

        Always full (see the module docstring): ``dest.parent`` is ignored. A failed snapshot
        leaves the VM running."""
        paths = self.paths(instance.sandbox_id)
        state = self._state(instance)
        memory = state.memory
        dest.path.mkdir(parents=True, exist_ok=True)
        phases = Phases()
        qmp = await Qmp.connect(paths.qmp)
        try:
            await qmp.execute("stop")
            phases.mark("stop")
            try:
                await self._save(qmp, paths, dest, memory, phases)
            except BaseException:
                with contextlib.suppress(QmpError, OSError):
                    await qmp.execute("cont")
                raise
            if not stop:
                await qmp.execute("cont")
        finally:
            await qmp.close()
        write_snapshot_meta(dest, state, accel=self.accel, runtime=self.name, memory=memory)
        if stop:
            await self._stop_keeping_network(instance, paths)
        phases.mark("stop_vm" if stop else "cont")
        log.info(
            "qemu %s: %s in %s, %s memory, state %d KiB",
            instance.sandbox_id,
            "pause" if stop else "snapshot",
            phases.summary(),
            memory,
            (dest.path / SNAPSHOT_MEMORY).stat().st_size >> 10,
        )

    async def _save(
        self, qmp: Qmp, paths: QemuPaths, dest: SnapshotRef, memory: Memory, phases: Phases
    ) -> None:
        """What a snapshot holds, taken with the vCPUs stopped."""
        if memory == "file":
            # FICLONE writes the mapping's dirty pages back first: the clone is the RAM as the
            # stopped vCPUs left it.
            await asyncio.to_thread(snapshot_layer_file, self.settings, paths.ram, dest, RAM_FILE)
            phases.mark("ram")
            await _ignore_shared(qmp)
        # QEMU writes the raw image with plain pwrite: with the vCPUs stopped the file holds
        # every write the guest completed (FICLONE writes back dirty pages first); what the
        # guest still caches is in its RAM, which the snapshot saves.
        await asyncio.to_thread(snapshot_disk, self.settings, paths.upper, dest)
        phases.mark("disk")
        await self._migrate_to_file(qmp, dest.path / SNAPSHOT_MEMORY)
        phases.mark("migrate")

    async def _migrate_to_file(self, qmp: Qmp, memory: Path) -> None:
        # Unthrottled: the default limit (128 MiB/s) paces a stopped VM's save too (0.8 s for
        # an idle guest's 113 MiB instead of 0.2 s).
        await qmp.execute("migrate-set-parameters", {"max-bandwidth": MIGRATION_BANDWIDTH})
        # QEMU hands the URI to /bin/sh: quote the path.
        await qmp.execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(memory))}"})
        await self._wait_migration(qmp)

    async def _wait_migration(self, qmp: Qmp, limit_s: float = 300.0) -> None:
        deadline = time.monotonic() + limit_s
        while True:
            info = await qmp.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise Failed(f"QEMU migration to file {status}: {info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                await qmp.execute("migrate_cancel")
                raise Failed("QEMU migration to file timed out")
            await asyncio.sleep(0.01)


async def _ignore_shared(qmp: Qmp) -> None:
    """Migrate device state only: RAM in a shared file backend is the file's, not the stream's
    (set on both ends, before ``migrate`` and before ``migrate-incoming``)."""
    await qmp.execute(
        "migrate-set-capabilities", {"capabilities": [{"capability": "x-ignore-shared", "state": True}]}
    )
