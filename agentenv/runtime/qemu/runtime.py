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

from agentenv.config import Settings, get_settings
from agentenv.types import ENVD_PORT
from agentenv.runtime import network
from agentenv.runtime.base import CpuSampler, Runtime, RuntimeError_
from agentenv.types import LiveSnapshots, SandboxInstance, SandboxMetrics, SandboxSpec, SnapshotRef, TemplateImage
from agentenv.runtime.network import SandboxNetwork
from agentenv.runtime.qemu import vmnet
from agentenv.runtime.qemu.qmp import Qmp
from agentenv.storage.images import GuestImages, ImageError, build_guest_images, create_upper_drive
from agentenv.storage.reflink import ReflinkPool

log = logging.getLogger(__name__)

MARKER = "qemu.json"
#: TCG boots a kernel and a python envd several times slower than KVM.
ENVD_TIMEOUT_KVM = 60.0
ENVD_TIMEOUT_TCG = 300.0
SNAPSHOT_MEMORY = "memory.bin"
SNAPSHOT_UPPER = "upper.ext4"
SNAPSHOT_META = "vm.json"
#: Bytes/s: effectively unlimited (a migration to a local file has nothing to protect).
MIGRATION_BANDWIDTH = 1 << 40


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
    symlink to it. The layer's ``owner`` file names the directory that holds ``dest.path``: the
    orchestrator renames snapshot directories there (temp -> committed -> deleting), so the layer
    is in use exactly while some directory there links to it (:func:`remove_orphan_snapshot_disks`)."""
    pool = ReflinkPool(settings.data_dir)
    layer = pool.root / "snapshots" / dest.snapshot_id / SNAPSHOT_UPPER
    pool.clone(upper, layer)
    link = dest.path / SNAPSHOT_UPPER
    link.unlink(missing_ok=True)
    link.symlink_to(layer)
    # Written last: a layer without an owner is never collected (it is being made).
    (layer.parent / "owner").write_text(str(dest.path.resolve().parent) + "\n")
    return layer


def _layer_linked_from(home: Path, layer: Path) -> bool:
    """Whether a snapshot directory in ``home`` links its upper drive to ``layer``."""
    target = os.path.realpath(layer)
    try:
        entries = list(home.iterdir())
    except FileNotFoundError:
        return False
    for entry in entries:
        link = entry / SNAPSHOT_UPPER
        if link.is_symlink() and os.path.realpath(link) == target:
            return True
    return False


def remove_orphan_snapshot_disks(settings: Settings) -> list[str]:
    """Delete snapshot layers no snapshot directory links to any more (deleted snapshots)."""
    pool = ReflinkPool(settings.data_dir)
    removed = []
    for owner in sorted((pool.root / "snapshots").glob("*/owner")):
        with contextlib.suppress(OSError):
            home = Path(owner.read_text().strip())
            if not _layer_linked_from(home, owner.parent / SNAPSHOT_UPPER):
                pool.remove_tree(owner.parent)
                removed.append(owner.parent.name)
    return removed


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


async def envd_healthy(url: str, limit_s: float = 2.0) -> bool:
    """One ``GET /health`` over a plain socket. An httpx client costs ~50 ms to create (it builds
    an SSL context), as much as the whole probe of a restored envd."""
    parsed = httpx.URL(url)
    request = f"GET /health HTTP/1.1\r\nHost: {parsed.host}\r\nConnection: close\r\n\r\n".encode()
    try:
        async with asyncio.timeout(limit_s):
            reader, writer = await asyncio.open_connection(parsed.host, parsed.port or 80)
            try:
                writer.write(request)
                status = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False
    return status.split(b" ")[1:2] in ([b"200"], [b"204"])


async def wait_for_envd(url: str, limit_s: float, alive: Any, console: Path, interval: float = 0.1) -> None:
    """Poll envd's /health until it answers 204/200; fail early when the VM died."""
    deadline = time.monotonic() + limit_s
    while not await envd_healthy(url):
        if not await alive():
            raise RuntimeError_(f"the VM exited before envd answered; console:\n{serial_tail(console)}")
        if time.monotonic() > deadline:
            tail = serial_tail(console)
            raise RuntimeError_(f"envd did not answer within {limit_s:.0f}s; console:\n{tail}")
        await asyncio.sleep(interval)


def pid_alive(pid: int | None, name_part: str, owner: str | None = None) -> bool:
    """Whether ``pid`` is a live ``name_part`` process (and, with ``owner``, one whose command
    line mentions it: a recycled pid of another sandbox's VM is not ours)."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        argv = proc.cmdline()
    except psutil.Error:
        return False
    return any(name_part in a for a in argv[:1]) and (owner is None or any(owner in a for a in argv))


async def kill_pid(pid: int | None, name_part: str, limit_s: float = 10.0, owner: str | None = None) -> None:
    """SIGKILL a VM process (it holds no state worth a graceful stop) and wait until it is gone."""
    if not pid_alive(pid, name_part, owner):
        return
    assert pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + limit_s
    while pid_alive(pid, name_part, owner) and time.monotonic() < deadline:  # noqa: ASYNC110  # polling another process
        await asyncio.sleep(0.02)


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


@dataclass(frozen=True)
class Boot:
    """What a VM starts from: a template's artifacts (cold boot) or a snapshot (restore)."""

    images: GuestImages
    vcpus: int
    memory_mb: int
    snapshot: SnapshotRef | None = None


def read_snapshot(source: SnapshotRef) -> Boot:
    """The VM a snapshot was taken of; it names its guest artifacts, so a restore builds nothing."""
    if not (source.path / SNAPSHOT_MEMORY).is_file():
        raise RuntimeError_(f"snapshot {source.snapshot_id} has no QEMU memory image", code=404)
    meta = json.loads((source.path / SNAPSHOT_META).read_text())
    try:
        images = GuestImages.from_json(meta["images"])
    except ImageError as exc:
        raise RuntimeError_(f"snapshot {source.snapshot_id} cannot be restored: {exc}") from exc
    return Boot(images, int(meta["vcpus"]), int(meta["memory_mb"]), source)


def read_marker(paths: VmPaths) -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads(paths.marker.read_text())
        return state
    except (OSError, ValueError):
        return {}


def write_marker(paths: VmPaths, state: dict[str, Any]) -> None:
    tmp = paths.marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, paths.marker)


def template_build_key(tmpl: TemplateImage) -> tuple[str, str, int, int] | None:
    """Identifies one build of a template: a rebuild renames a new rootfs tree into place."""
    try:
        st = tmpl.rootfs.stat()
    except OSError:
        return None
    return tmpl.template_id, str(tmpl.rootfs), st.st_ino, st.st_mtime_ns


class QemuRuntime(Runtime):
    name: ClassVar[str] = "qemu"

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self.qemu = self.settings.qemu_path
        self._cpu = CpuSampler()
        #: Guest artifacts per template build: finding them hashes the whole rootfs listing (~1 s
        #: on the base template), which every cold create would otherwise pay again.
        self._images: dict[tuple[str, str, int, int], GuestImages] = {}

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
        self, images: GuestImages, paths: VmPaths, *, vcpus: int, memory_mb: int,
        incoming_fd: int | None = None,
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
        if incoming_fd is not None:
            # QEMU reads the migration stream from the open file itself (no `cat` and pipe).
            cmd += ["-incoming", f"fd:{incoming_fd}"]
        return cmd

    # -- lifecycle ----------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        tmpl = spec.template
        return await self._start(spec, Boot(await self._template_images(tmpl), tmpl.vcpus, tmpl.memory_mb))

    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        return await self._start(spec, await asyncio.to_thread(read_snapshot, source))

    async def _template_images(self, tmpl: TemplateImage) -> GuestImages:
        key = template_build_key(tmpl)
        cached = self._images.get(key) if key else None
        if cached is not None and all(p.exists() for p in (cached.base, cached.envd, cached.kernel.vmlinux)):
            return cached
        images = await asyncio.to_thread(build_guest_images, self.settings, tmpl.template_id, tmpl.rootfs)
        if key:
            self._images[key] = images
        return images

    async def _start(self, spec: SandboxSpec, boot: Boot) -> SandboxInstance:
        sid = spec.sandbox_id
        paths = vm_paths(self.settings, sid)
        kept = self._claim_dir(sid, paths)
        state: dict[str, Any] = {
            "paths": str(paths.root), "upper": str(paths.upper), "images": boot.images.to_json(),
            "vcpus": boot.vcpus, "memory_mb": boot.memory_mb,
            # The orchestrator records it in snapshots: sandboxes restored from them need it.
            "template_rootfs": str(spec.template.rootfs),
            "network": kept.to_state() if kept else None,
        }
        try:
            return await self._bring_up(spec, boot, paths, state, kept)
        except BaseException:
            await self._destroy(sid, state)
            raise

    async def _bring_up(
        self, spec: SandboxSpec, boot: Boot, paths: VmPaths, state: dict[str, Any],
        kept: SandboxNetwork | None,
    ) -> SandboxInstance:
        phases = Phases()
        write_marker(paths, state)
        await self._prepare_upper(boot, paths)
        phases.mark("disk")
        net = kept or await self._setup_network(spec, paths, state)
        phases.mark("network")
        state["pid"] = await self._spawn(net, boot, paths)
        write_marker(paths, state)
        phases.mark("spawn")
        url = f"http://{net.sandbox_ip}:{ENVD_PORT}"
        if boot.snapshot is not None:
            await self._wait_incoming(paths)
            phases.mark("incoming")
        await self._wait_envd(url, state["pid"], paths, restored=boot.snapshot is not None)
        phases.mark("envd")
        what = "boot" if boot.snapshot is None else "resume" if kept else "restore"
        log.info("qemu %s: %s in %s", spec.sandbox_id, what, phases.summary())
        return SandboxInstance(spec.sandbox_id, self.name, url, net.sandbox_ip, state)

    def _claim_dir(self, sandbox_id: str, paths: VmPaths) -> SandboxNetwork | None:
        """Create the sandbox's directory. A pause leaves it behind with the sandbox's network
        (netns, tap, NAT): a resume takes that over, keeps its address and sets nothing up."""
        try:
            paths.root.mkdir(parents=True, exist_ok=False)
            return None
        except FileExistsError:
            pass
        state = read_marker(paths)
        if state.get("paused") and state.get("network"):
            return SandboxNetwork.from_state(state["network"])
        raise RuntimeError_(f"sandbox {sandbox_id} already exists on this node", code=409)

    async def _prepare_upper(self, boot: Boot, paths: VmPaths) -> None:
        paths.upper.parent.mkdir(parents=True, exist_ok=True)
        if boot.snapshot is None:
            await asyncio.to_thread(create_upper_drive, self.settings, boot.images, paths.upper)
        else:
            source = (boot.snapshot.path / SNAPSHOT_UPPER).resolve()
            await asyncio.to_thread(ReflinkPool(self.settings.data_dir).clone, source, paths.upper)

    async def _setup_network(
        self, spec: SandboxSpec, paths: VmPaths, state: dict[str, Any]
    ) -> SandboxNetwork:
        net = await network.setup_network(
            self.settings, spec.sandbox_id, allow_internet_access=spec.allow_internet_access
        )
        state["network"] = net.to_state()
        write_marker(paths, state)
        await vmnet.add_tap(self.settings, net)
        return net

    async def _spawn(self, net: SandboxNetwork, boot: Boot, paths: VmPaths) -> int:
        memory = boot.snapshot.path / SNAPSHOT_MEMORY if boot.snapshot else None
        fd = os.open(memory, os.O_RDONLY | os.O_CLOEXEC) if memory else None
        try:
            cmd = self.command(boot.images, paths, vcpus=boot.vcpus, memory_mb=boot.memory_mb, incoming_fd=fd)
            await self._spawn_in_netns(net, cmd, paths, pass_fds=() if fd is None else (fd,))
        finally:
            if fd is not None:
                os.close(fd)
        return int(paths.pidfile.read_text().strip())

    async def _spawn_in_netns(
        self, net: SandboxNetwork, cmd: list[str], paths: VmPaths, pass_fds: tuple[int, ...] = ()
    ) -> None:
        # nsenter only switches the network namespace: QEMU opens tap0 there, files stay host's.
        # Output goes to a file, not a pipe: the daemonised QEMU would hold a pipe open forever.
        with open(paths.qemu_log, "ab") as out:  # noqa: ASYNC230  # local file, opened once
            proc = await asyncio.create_subprocess_exec(
                "nsenter", f"--net={net.netns_path}", "--", *cmd,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                pass_fds=pass_fds,
            )
            code = await proc.wait()  # -daemonize: the parent exits once QEMU is initialised
        if code != 0 or not paths.pidfile.exists():
            log_tail = serial_tail(paths.qemu_log)
            raise RuntimeError_(f"qemu failed to start (exit {code}): {log_tail}")

    async def _wait_envd(self, url: str, pid: int, paths: VmPaths, *, restored: bool) -> None:
        timeout = ENVD_TIMEOUT_KVM if self.accelerator() == "kvm" else ENVD_TIMEOUT_TCG

        async def alive() -> bool:
            return pid_alive(pid, "qemu", str(paths.root))

        # A restored envd is already listening: it answers within milliseconds of the vCPUs
        # running again, so a coarse poll would only add latency.
        await wait_for_envd(url, timeout, alive, paths.serial, interval=0.005 if restored else 0.1)

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
                await asyncio.sleep(0.005)
        finally:
            await qmp.close()

    async def kill(self, instance: SandboxInstance) -> None:
        await self._destroy(instance.sandbox_id, instance.state)

    async def _destroy(self, sandbox_id: str, state: dict[str, Any]) -> None:
        paths = vm_paths(self.settings, sandbox_id)
        # The marker is what this node holds for the sandbox now (a pause rewrote it; the
        # caller's state may be the one from before the pause).
        state = read_marker(paths) or state
        pid = state.get("pid")
        if pid is None and paths.pidfile.exists():
            with contextlib.suppress(ValueError, OSError):
                pid = int(paths.pidfile.read_text().strip())
        await kill_pid(pid, "qemu", owner=str(paths.root))
        net_state = state.get("network")
        net = SandboxNetwork.from_state(net_state) if net_state else None
        await network.teardown_network(self.settings, sandbox_id, net)
        ReflinkPool(self.settings.data_dir).remove(paths.upper)
        with contextlib.suppress(OSError):
            paths.upper.parent.rmdir()
        shutil.rmtree(paths.root, ignore_errors=True)
        self._cpu.forget(sandbox_id)

    async def is_alive(self, instance: SandboxInstance) -> bool:
        paths = vm_paths(self.settings, instance.sandbox_id)
        return pid_alive(instance.state.get("pid"), "qemu", str(paths.root))

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

    async def collect_garbage(self, live_snapshots: LiveSnapshots) -> list[str]:
        """Free the disk layers of deleted snapshots. Whether a layer is used is read from the
        snapshot directories themselves (their ``upper.ext4`` links), which also covers snapshots
        being written right now; ``live_snapshots`` is not needed."""
        return await asyncio.to_thread(remove_orphan_snapshot_disks, self.settings)

    # -- snapshots ----------------------------------------------------------------------------

    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Stop the vCPUs, clone the upper drive and migrate RAM + device state to a file.

        QEMU's migration stream is always complete (no incremental RAM), so ``dest.parent`` only
        matters for the disk, which is a reflink clone sharing blocks anyway. A failed snapshot
        leaves the VM running."""
        paths = vm_paths(self.settings, instance.sandbox_id)
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
                with contextlib.suppress(RuntimeError_, OSError):
                    await qmp.execute("cont")
                raise
            if not stop:
                await qmp.execute("cont")
        finally:
            await qmp.close()
        meta = {
            key: instance.state[key] for key in ("images", "vcpus", "memory_mb")
        } | {"accel": self.accelerator(), "runtime": self.name}
        (dest.path / SNAPSHOT_META).write_text(json.dumps(meta, indent=2) + "\n")
        if stop:
            await self._stop_keeping_network(instance, paths)
        phases.mark("stop_vm" if stop else "cont")
        size_mib = (dest.path / SNAPSHOT_MEMORY).stat().st_size >> 20
        log.info("qemu %s: %s in %s, memory %d MiB", instance.sandbox_id, "pause" if stop else "snapshot",
                 phases.summary(), size_mib)

    async def _migrate_to_file(self, qmp: Qmp, memory: Path) -> None:
        # Unthrottled: the default limit (128 MiB/s) paces a stopped VM's save too (0.8 s for
        # an idle guest's 113 MiB instead of 0.2 s).
        await qmp.execute("migrate-set-parameters", {"max-bandwidth": MIGRATION_BANDWIDTH})
        await qmp.execute("migrate", {"uri": f"exec:cat > {memory}"})
        await self._wait_migration(qmp)

    async def _stop_keeping_network(self, instance: SandboxInstance, paths: VmPaths) -> None:
        """After a pause: the VM process and its drive go (the snapshot has both), the network
        stays for the resume; the marker says so (``paused``), and a kill removes it all."""
        state = read_marker(paths) or dict(instance.state)
        await kill_pid(state.get("pid"), "qemu", owner=str(paths.root))
        ReflinkPool(self.settings.data_dir).remove(paths.upper)
        for leftover in (paths.pidfile, paths.qmp):
            leftover.unlink(missing_ok=True)
        write_marker(paths, {"paused": True, "network": state.get("network")})
        self._cpu.forget(instance.sandbox_id)

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
            await asyncio.sleep(0.01)
