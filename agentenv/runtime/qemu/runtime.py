"""QEMU runtime: ``qemu-system-x86_64 -M microvm`` per sandbox, KVM when usable, TCG otherwise.

Per sandbox::

    {data_dir}/sandboxes/<id>/qemu.json   marker + what the VM was started with (orphan recovery)
                              qmp.sock    QMP control socket
                              serial.log  the guest's serial console (kernel, init, envd output)
                              qemu.pid    pid of the daemonised QEMU
    {data_dir}/layers/sandboxes/<id>/upper.ext4   private writable drive (reflink clone)

Devices are virtio-mmio (the microvm machine has no PCI): the read-only base image, the upper
drive and the read-only envd drive (virtio-blk, identified by serial), and virtio-net on
``tap0`` inside the sandbox's netns (QEMU is started in that netns), see :mod:`.vmnet`.

Snapshots are QEMU migrations to a file (``migrate exec:cat > mem``) taken while the guest is
stopped, plus a reflink clone of the upper drive at the same instant; restore starts a QEMU
with identical devices and ``-incoming exec:cat mem``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import psutil

from agentenv.config import ENVD_PORT, Settings, get_settings
from agentenv.runtime import network
from agentenv.runtime.base import (
    CpuSampler,
    Runtime,
    RuntimeError_,
    SandboxInstance,
    SandboxMetrics,
    SandboxSpec,
    SnapshotRef,
)
from agentenv.runtime.network import SandboxNetwork
from agentenv.runtime.qemu import vmnet
from agentenv.runtime.qemu.qmp import Qmp
from agentenv.storage.images import GuestImages, build_guest_images, create_upper_drive
from agentenv.storage.reflink import ReflinkPool

log = logging.getLogger(__name__)

MARKER = "qemu.json"
#: TCG boots a kernel and a python envd several times slower than KVM.
ENVD_TIMEOUT_KVM = 60.0
ENVD_TIMEOUT_TCG = 300.0
SNAPSHOT_MEMORY = "memory.bin"
SNAPSHOT_UPPER = "upper.ext4"
SNAPSHOT_META = "vm.json"


@dataclass(frozen=True)
class VmPaths:
    root: Path
    upper: Path

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def qmp(self) -> Path:
        return self.root / "qmp.sock"

    @property
    def serial(self) -> Path:
        return self.root / "serial.log"

    @property
    def qemu_log(self) -> Path:
        return self.root / "qemu.log"

    @property
    def pidfile(self) -> Path:
        return self.root / "qemu.pid"


def vm_paths(settings: Settings, sandbox_id: str) -> VmPaths:
    return VmPaths(
        root=settings.data_dir / "sandboxes" / sandbox_id,
        upper=ReflinkPool(settings.data_dir).root / "sandboxes" / sandbox_id / "upper.ext4",
    )


def snapshot_disk(settings: Settings, upper: Path, dest: SnapshotRef) -> Path:
    """Reflink-clone a VM's upper drive into the pool for snapshot ``dest``.

    Clones must stay inside the pool's file system, and ``dest.path`` (the snapshot directory)
    may not be: the clone lives at ``layers/snapshots/<id>/`` and ``dest.path/upper.ext4`` is a
    symlink to it. :func:`remove_snapshot_disk` (and orphan clean-up) deletes it again."""
    pool = ReflinkPool(settings.data_dir)
    layer = pool.root / "snapshots" / dest.snapshot_id / SNAPSHOT_UPPER
    pool.clone(upper, layer)
    link = dest.path / SNAPSHOT_UPPER
    link.unlink(missing_ok=True)
    link.symlink_to(layer)
    # Back-pointer: once the snapshot directory is deleted, orphan clean-up frees the layer.
    (layer.parent / "owner").write_text(str(dest.path.resolve()) + "\n")
    return layer


def remove_orphan_snapshot_disks(settings: Settings) -> list[str]:
    """Delete snapshot layers whose snapshot directory no longer exists."""
    pool = ReflinkPool(settings.data_dir)
    removed = []
    for owner in sorted((pool.root / "snapshots").glob("*/owner")):
        with contextlib.suppress(OSError):
            if not Path(owner.read_text().strip()).is_dir():
                pool.remove_tree(owner.parent)
                removed.append(owner.parent.name)
    return removed


def remove_snapshot_disk(settings: Settings, snapshot_id: str) -> None:
    pool = ReflinkPool(settings.data_dir)
    layer_dir = pool.root / "snapshots" / snapshot_id
    if layer_dir.exists():
        pool.remove_tree(layer_dir)


def tcg_clock_args(accel: str) -> str:
    """Under TCG the guest reads the host's TSC, but calibrating it against the emulated PIT
    fails on a busy host and the kernel then hangs in early boot: tell it the frequency."""
    if accel != "tcg":
        return ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return f" tsc_early_khz={int(float(line.partition(':')[2]) * 1000)}"
    return ""


def serial_tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


async def wait_for_envd(url: str, limit_s: float, alive: Any, console: Path) -> None:
    """Poll envd's /health until it answers 204/200; fail early when the VM died."""
    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = await client.get(f"{url}/health")
                if r.status_code in (200, 204):
                    return
            if not await alive():
                raise RuntimeError_(f"the VM exited before envd answered; console:\n{serial_tail(console)}")
            if time.monotonic() > deadline:
                raise RuntimeError_(
                    f"envd did not answer within {limit_s:.0f}s; console:\n{serial_tail(console)}"
                )
            await asyncio.sleep(0.1)


def pid_alive(pid: int | None, name_part: str) -> bool:
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and any(name_part in a for a in proc.cmdline()[:1])
    except psutil.Error:
        return False


async def kill_pid(pid: int | None, name_part: str, limit_s: float = 10.0) -> None:
    """SIGKILL a VM process (it holds no state worth a graceful stop) and wait until it is gone."""
    if not pid_alive(pid, name_part):
        return
    assert pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + limit_s
    while pid_alive(pid, name_part) and time.monotonic() < deadline:  # noqa: ASYNC110  # polling another process
        await asyncio.sleep(0.02)


class QemuRuntime(Runtime):
    name: ClassVar[str] = "qemu"

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self.qemu = self.settings.qemu_path
        self._cpu = CpuSampler()

    # -- availability -------------------------------------------------------------------------

    @classmethod
    def probe(cls) -> str | None:
        qemu = get_settings().qemu_path
        if shutil.which(qemu) is None:
            return f"{qemu} not found (apt-get install qemu-system-x86)"
        if os.geteuid() != 0:
            return "the qemu runtime needs root (network namespaces, tap devices, loop-mounted reflink pool)"
        return None

    @staticmethod
    def accelerator() -> str:
        from agentenv.runtime.registry import kvm_unusable_reason

        return "kvm" if kvm_unusable_reason() is None else "tcg"

    # -- command line -------------------------------------------------------------------------

    def command(
        self, images: GuestImages, paths: VmPaths, *, vcpus: int, memory_mb: int, incoming: Path | None = None
    ) -> list[str]:
        accel = self.accelerator()
        gateway, guest = vmnet.guest_addresses(self.settings)
        drives = [("base", images.base, True), ("upper", paths.upper, False), ("envd", images.envd, True)]
        cmd = [
            # TCG: legacy PIT/PIC/RTC as timer references (KVM guests have kvmclock).
            self.qemu, "-M", f"microvm,accel={accel}" + (",pit=on,pic=on,rtc=on" if accel == "tcg" else ""),
            "-cpu", "host" if accel == "kvm" else "max",
            "-m", str(memory_mb), "-smp", str(vcpus), "-nodefaults", "-no-user-config",
            "-display", "none", "-no-reboot",
            "-kernel", str(images.kernel.vmlinux), "-initrd", str(images.kernel.initramfs),
            "-append", images.cmdline(guest, gateway) + " earlyprintk=ttyS0" + tcg_clock_args(accel),
            "-serial", f"file:{paths.serial}",
            "-qmp", f"unix:{paths.qmp},server=on,wait=off",
            "-pidfile", str(paths.pidfile), "-daemonize",
            "-netdev", f"tap,id=net0,ifname={vmnet.TAP_NAME},script=no,downscript=no",
            "-device", f"virtio-net-device,netdev=net0,mac={vmnet.GUEST_MAC}",
        ]
        for serial, path, readonly in drives:
            ro = ",readonly=on" if readonly else ""
            cmd += [
                "-drive", f"id={serial},file={path},format=raw,if=none,cache=unsafe{ro}",
                "-device", f"virtio-blk-device,drive={serial},serial={serial}",
            ]
        if incoming is not None:
            cmd += ["-incoming", f"exec:cat {incoming}"]
        return cmd

    # -- lifecycle ----------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        return await self._start(spec, snapshot=None)

    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        if not (source.path / SNAPSHOT_MEMORY).is_file():
            raise RuntimeError_(f"snapshot {source.snapshot_id} has no QEMU memory image", code=404)
        return await self._start(spec, snapshot=source)

    async def _start(self, spec: SandboxSpec, snapshot: SnapshotRef | None) -> SandboxInstance:
        sid = spec.sandbox_id
        paths = vm_paths(self.settings, sid)
        tmpl = spec.template
        images = await asyncio.to_thread(build_guest_images, self.settings, tmpl.template_id, tmpl.rootfs)
        vcpus, memory_mb = tmpl.vcpus, tmpl.memory_mb
        if snapshot is not None:
            meta = json.loads((snapshot.path / SNAPSHOT_META).read_text())
            images = GuestImages.from_json(meta["images"])
            vcpus, memory_mb = meta["vcpus"], meta["memory_mb"]
        state: dict[str, Any] = {
            "paths": str(paths.root), "upper": str(paths.upper), "images": images.to_json(),
            "vcpus": vcpus, "memory_mb": memory_mb,
        }
        try:
            paths.root.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise RuntimeError_(f"sandbox {sid} already exists on this node", code=409) from None
        try:
            paths.upper.parent.mkdir(parents=True, exist_ok=True)
            if snapshot is None:
                await asyncio.to_thread(create_upper_drive, self.settings, images, paths.upper)
            else:
                upper_source = (snapshot.path / SNAPSHOT_UPPER).resolve()
                pool = ReflinkPool(self.settings.data_dir)
                await asyncio.to_thread(pool.clone, upper_source, paths.upper)
            net = await network.setup_network(
                self.settings, sid, allow_internet_access=spec.allow_internet_access
            )
            state["network"] = net.to_state()
            paths.marker.write_text(json.dumps(state))
            await vmnet.add_tap(self.settings, net)
            incoming = snapshot.path / SNAPSHOT_MEMORY if snapshot else None
            cmd = self.command(images, paths, vcpus=vcpus, memory_mb=memory_mb, incoming=incoming)
            await self._spawn_in_netns(net, cmd, paths)
            state["pid"] = int(paths.pidfile.read_text().strip())
            paths.marker.write_text(json.dumps(state))
            url = f"http://{net.sandbox_ip}:{ENVD_PORT}"
            instance = SandboxInstance(sid, self.name, url, net.sandbox_ip, state)
            if snapshot is not None:
                await self._wait_incoming(paths)
            timeout = ENVD_TIMEOUT_KVM if self.accelerator() == "kvm" else ENVD_TIMEOUT_TCG

            async def alive() -> bool:
                return pid_alive(state["pid"], "qemu")

            await wait_for_envd(url, timeout, alive, paths.serial)
            return instance
        except BaseException:
            await self._destroy(sid, state)
            raise

    async def _spawn_in_netns(self, net: SandboxNetwork, cmd: list[str], paths: VmPaths) -> None:
        # nsenter only switches the network namespace: QEMU opens tap0 there, files stay host's.
        # Output goes to a file, not a pipe: the daemonised QEMU would hold a pipe open forever.
        with open(paths.qemu_log, "ab") as out:  # noqa: ASYNC230  # local file, opened once
            proc = await asyncio.create_subprocess_exec(
                "nsenter", f"--net={net.netns_path}", "--", *cmd,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            )
            code = await proc.wait()  # -daemonize: the parent exits once QEMU is initialised
        if code != 0 or not paths.pidfile.exists():
            log_tail = serial_tail(paths.qemu_log)
            raise RuntimeError_(f"qemu failed to start (exit {code}): {log_tail}")

    async def _wait_incoming(self, paths: VmPaths, limit_s: float = 120.0) -> None:
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
                    raise RuntimeError_(f"restore failed: VM status {status}")
                if time.monotonic() > deadline:
                    raise RuntimeError_("restore: the incoming migration did not finish in time")
                await asyncio.sleep(0.02)
        finally:
            await qmp.close()

    async def kill(self, instance: SandboxInstance) -> None:
        await self._destroy(instance.sandbox_id, instance.state)

    async def _destroy(self, sandbox_id: str, state: dict[str, Any]) -> None:
        paths = vm_paths(self.settings, sandbox_id)
        if not state and paths.marker.exists():
            with contextlib.suppress(ValueError, OSError):
                state = json.loads(paths.marker.read_text())
        pid = state.get("pid")
        if pid is None and paths.pidfile.exists():
            with contextlib.suppress(ValueError, OSError):
                pid = int(paths.pidfile.read_text().strip())
        await kill_pid(pid, "qemu")
        net_state = state.get("network")
        net = SandboxNetwork.from_state(net_state) if net_state else None
        await network.teardown_network(self.settings, sandbox_id, net)
        ReflinkPool(self.settings.data_dir).remove(paths.upper)
        with contextlib.suppress(OSError):
            paths.upper.parent.rmdir()
        shutil.rmtree(paths.root, ignore_errors=True)
        self._cpu.forget(sandbox_id)

    async def is_alive(self, instance: SandboxInstance) -> bool:
        return pid_alive(instance.state.get("pid"), "qemu")

    async def metrics(self, instance: SandboxInstance) -> SandboxMetrics:
        pid = instance.state.get("pid")
        upper = Path(instance.state["upper"])
        try:
            proc = psutil.Process(pid)
            times = proc.cpu_times()
            cpu_total = times.user + times.system
            rss = proc.memory_info().rss
            vcpus = int(proc.cmdline()[proc.cmdline().index("-smp") + 1])
            mem_total = int(proc.cmdline()[proc.cmdline().index("-m") + 1]) << 20
        except (psutil.Error, ValueError, IndexError) as exc:
            raise RuntimeError_(f"sandbox {instance.sandbox_id} is not running: {exc}", code=404) from exc
        pct = self._cpu.percent(instance.sandbox_id, cpu_total, vcpus) or 0.0
        try:
            st = await asyncio.to_thread(os.stat, upper)
            disk_used, disk_total = st.st_blocks * 512, st.st_size
        except FileNotFoundError:
            disk_used = disk_total = 0
        return SandboxMetrics(vcpus, pct, min(rss, mem_total), mem_total, disk_used, disk_total)

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed = []
        root = self.settings.data_dir / "sandboxes"
        for marker in sorted(root.glob(f"*/{MARKER}")):
            sid = marker.parent.name
            if sid in keep:
                continue
            await self._destroy(sid, {})
            removed.append(sid)
        await asyncio.to_thread(remove_orphan_snapshot_disks, self.settings)
        return removed

    # -- snapshots ----------------------------------------------------------------------------

    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Stop the vCPUs, clone the upper drive and migrate RAM + device state to a file.

        QEMU's migration stream is always complete (no incremental RAM), so ``dest.parent`` only
        matters for the disk, which is a reflink clone sharing blocks anyway."""
        paths = vm_paths(self.settings, instance.sandbox_id)
        dest.path.mkdir(parents=True, exist_ok=True)
        memory = dest.path / SNAPSHOT_MEMORY
        qmp = await Qmp.connect(paths.qmp)
        try:
            await qmp.execute("stop")
            try:
                # QEMU writes the raw image with plain pwrite: with the vCPUs stopped the file
                # holds every write the guest completed (FICLONE writes back dirty pages first);
                # what the guest still caches is in its RAM, which the migration saves.
                await asyncio.to_thread(snapshot_disk, self.settings, paths.upper, dest)
                await qmp.execute("migrate", {"uri": f"exec:cat > {memory}"})
                await self._wait_migration(qmp)
            finally:
                if not stop:
                    await qmp.execute("cont")
        finally:
            await qmp.close()
        meta = {
            key: instance.state[key] for key in ("images", "vcpus", "memory_mb")
        } | {"accel": self.accelerator(), "runtime": self.name}
        (dest.path / SNAPSHOT_META).write_text(json.dumps(meta, indent=2) + "\n")
        if stop:
            await self._destroy(instance.sandbox_id, instance.state)

    async def _wait_migration(self, qmp: Qmp, limit_s: float = 300.0) -> None:
        deadline = time.monotonic() + limit_s
        while True:
            info = await qmp.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise RuntimeError_(f"QEMU migration to file {status}: {info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                await qmp.execute("migrate_cancel")
                raise RuntimeError_("QEMU migration to file timed out")
            await asyncio.sleep(0.02)
