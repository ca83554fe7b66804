"""QEMU runtime: ``qemu-system-x86_64 -M microvm`` per sandbox, under KVM or TCG (``settings.qemu.accel``).

Per sandbox, beside the drive directory of :mod:`agentenv.runtime.microvm.runtime`::

    {data_dir}/sandboxes/<id>/qemu.json   marker + what the VM was started with (orphan recovery)
                              qmp.sock    QMP control socket
                              serial.log  the guest's serial console (kernel, init, envd output)
                              qemu.log    QEMU's own output
                              qemu.pid    pid of the daemonised QEMU

Devices are virtio-mmio (the microvm machine has no PCI): the read-only base image, the upper
drive and the read-only envd drive (virtio-blk, identified by serial), and virtio-net on
``tap0`` inside the sandbox's netns (QEMU is started in that netns), see
:mod:`agentenv.runtime.microvm.vmnet`.

Snapshots are always full: a QEMU migration of RAM and device state to ``memory.bin`` (QEMU 7.2
has no ``file:`` migration URI, so ``exec:cat``), taken while the vCPUs are stopped, plus a
reflink clone of the upper drive at the same instant. Restore starts a QEMU with identical
devices that reads the stream from the open memory file (``-incoming fd:N``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from agentenv.config import Settings
from agentenv.errors import Failed, Unavailable
from agentenv.runtime.base import log_tail
from agentenv.runtime.kvm import kvm_unusable_reason
from agentenv.runtime.microvm import vmnet
from agentenv.runtime.microvm.disks import snapshot_disk
from agentenv.runtime.microvm.runtime import (
    Boot,
    MicroVmRuntime,
    Phases,
    VmPaths,
    write_marker,
    write_snapshot_meta,
)
from agentenv.runtime.network import SandboxNetwork
from agentenv.runtime.qemu.qmp import Qmp, QmpError
from agentenv.storage.images import GuestImages
from agentenv.types import RuntimeName, SandboxInstance, SnapshotRef

log = logging.getLogger(__name__)

Accel = Literal["kvm", "tcg"]
#: TCG boots a kernel and a python envd several times slower than KVM.
ENVD_TIMEOUT_KVM = 60.0
ENVD_TIMEOUT_TCG = 300.0
SNAPSHOT_MEMORY = "memory.bin"
#: Bytes/s: effectively unlimited (a migration to a local file has nothing to protect).
MIGRATION_BANDWIDTH = 1 << 40


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
    def runtime_files(self) -> tuple[Path, ...]:
        return self.pidfile, self.qmp


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


class QemuRuntime(MicroVmRuntime[QemuPaths]):
    name: ClassVar[RuntimeName] = "qemu"
    process_name: ClassVar[str] = "qemu"
    snapshot_file: ClassVar[str] = SNAPSHOT_MEMORY

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
                return f"AGENTENV_QEMU__ACCEL=kvm, but {reason}"
        return None

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

    # -- command line -------------------------------------------------------------------------

    def command(
        self,
        images: GuestImages,
        paths: QemuPaths,
        *,
        vcpus: int,
        memory_mb: int,
        incoming_fd: int | None = None,
    ) -> list[str]:
        accel = self.accel
        gateway, guest = vmnet.guest_addresses(self.settings)
        drives = [("base", images.base, True), ("upper", paths.upper, False), ("envd", images.envd, True)]
        cmd = [
            # TCG: legacy PIT/PIC/RTC as timer references (KVM guests have kvmclock).
            self.settings.qemu.qemu_path,
            "-M",
            f"microvm,accel={accel}" + (",pit=on,pic=on,rtc=on" if accel == "tcg" else ""),
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
            f"tap,id=net0,ifname={vmnet.TAP_NAME},script=no,downscript=no",
            "-device",
            f"virtio-net-device,netdev=net0,mac={vmnet.GUEST_MAC}",
        ]
        for serial, path, readonly in drives:
            ro = ",readonly=on" if readonly else ""
            cmd += [
                "-drive",
                f"id={serial},file={path},format=raw,if=none,cache=unsafe{ro}",
                "-device",
                f"virtio-blk-device,drive={serial},serial={serial}",
            ]
        if incoming_fd is not None:
            # QEMU reads the migration stream from the open file itself (no `cat` and pipe).
            cmd += ["-incoming", f"fd:{incoming_fd}"]
        return cmd

    # -- the hooks of MicroVmRuntime ----------------------------------------------------------

    def _envd_timeout(self) -> float:
        return ENVD_TIMEOUT_KVM if self.accel == "kvm" else ENVD_TIMEOUT_TCG

    def _vm_processes(self, state: dict[str, Any], paths: QemuPaths) -> list[tuple[int | None, str]]:
        # Without a recorded pid (a start cut short) the daemonised QEMU may still have written one.
        return [(state.get("pid") or _read_pidfile(paths), self.process_name)]

    def _check_restorable(self, boot: Boot) -> None:
        # The CPU model differs (KVM: host, TCG: max): a migration stream does not cross over.
        taken = boot.meta.get("accel")
        if taken is not None and taken != self.accel:
            snapshot_id = boot.snapshot.snapshot_id if boot.snapshot else "?"
            raise Unavailable(f"snapshot {snapshot_id} was taken under {taken}; QEMU here runs {self.accel}")

    async def _launch(
        self, net: SandboxNetwork, boot: Boot, paths: QemuPaths, state: dict[str, Any], phases: Phases
    ) -> None:
        state["pid"] = await self._spawn(net, boot, paths)
        write_marker(paths, state)
        phases.mark("spawn")
        if boot.snapshot is not None:
            await self._wait_incoming(paths)
            phases.mark("incoming")

    async def _spawn(self, net: SandboxNetwork, boot: Boot, paths: QemuPaths) -> int:
        memory = boot.snapshot.path / SNAPSHOT_MEMORY if boot.snapshot else None
        fd = os.open(memory, os.O_RDONLY | os.O_CLOEXEC) if memory else None
        try:
            cmd = self.command(boot.images, paths, vcpus=boot.vcpus, memory_mb=boot.memory_mb, incoming_fd=fd)
            await self._spawn_in_netns(net, cmd, paths, pass_fds=() if fd is None else (fd,))
        finally:
            if fd is not None:
                os.close(fd)
        pid = _read_pidfile(paths)
        if pid is None:
            raise Failed(f"qemu wrote no pid file: {log_tail(paths.qemu_log)}")
        return pid

    async def _spawn_in_netns(
        self, net: SandboxNetwork, cmd: list[str], paths: QemuPaths, pass_fds: tuple[int, ...] = ()
    ) -> None:
        # nsenter only switches the network namespace: QEMU opens tap0 there, files stay host's.
        # Output goes to a file, not a pipe: the daemonised QEMU would hold a pipe open forever.
        with open(paths.qemu_log, "ab") as out:  # noqa: ASYNC230  # local file, opened once
            proc = await asyncio.create_subprocess_exec(
                "nsenter",
                f"--net={net.netns_path}",
                "--",
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
        """Stop the vCPUs, clone the upper drive and migrate RAM + device state to a file.

        Always a full snapshot: QEMU's migration stream has no incremental RAM, so ``dest.parent``
        is ignored (the disk is a reflink clone sharing unchanged blocks anyway). A failed
        snapshot leaves the VM running."""
        paths = self.paths(instance.sandbox_id)
        dest.path.mkdir(parents=True, exist_ok=True)
        phases = Phases()
        qmp = await Qmp.connect(paths.qmp)
        try:
            await qmp.execute("stop")
            phases.mark("stop")
            try:
                # QEMU writes the raw image with plain pwrite: with the vCPUs stopped the file
                # holds every write the guest completed (FICLONE writes back dirty pages first);
                # what the guest still caches is in its RAM, which the migration saves.
                await asyncio.to_thread(snapshot_disk, self.settings, paths.upper, dest)
                phases.mark("disk")
                await self._migrate_to_file(qmp, dest.path / SNAPSHOT_MEMORY)
                phases.mark("migrate")
            except BaseException:
                with contextlib.suppress(QmpError, OSError):
                    await qmp.execute("cont")
                raise
            if not stop:
                await qmp.execute("cont")
        finally:
            await qmp.close()
        write_snapshot_meta(dest, instance.state, accel=self.accel, runtime=self.name)
        if stop:
            await self._stop_keeping_network(instance, paths)
        phases.mark("stop_vm" if stop else "cont")
        size_mib = (dest.path / SNAPSHOT_MEMORY).stat().st_size >> 20
        log.info(
            "qemu %s: %s in %s, memory %d MiB",
            instance.sandbox_id,
            "pause" if stop else "snapshot",
            phases.summary(),
            size_mib,
        )

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
