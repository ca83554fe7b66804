"""Firecracker runtime: one ``firecracker`` VMM per sandbox, driven through its API socket.

Per sandbox::

    {data_dir}/sandboxes/<id>/firecracker.json  marker + what the VM was started with (recovery)
                              api.sock, vsock.sock, firecracker.log, metrics.json
    {data_dir}/layers/sandboxes/<id>/upper.ext4   private writable drive (reflink clone); also
                                                  the VMM's working directory, see below

The guest artifacts are the same as QEMU's (:mod:`agentenv.storage.images`): the kernel and
initramfs, the read-only base and envd drives, and the per-sandbox upper drive. The VMM runs in
the sandbox's netns with ``tap0`` (:mod:`agentenv.runtime.qemu.vmnet`), so envd answers at the
sandbox address exactly as under the other runtimes.

Firecracker records drive paths in a snapshot verbatim and cannot override them on load. The
upper drive is therefore given as the *relative* path ``upper.ext4`` and every VMM runs with its
own sandbox layer directory as cwd: a restored or forked VM opens its own reflink clone.

Snapshots: ``Full``, or ``Diff`` (dirty pages since the parent, ``track_dirty_pages`` is always
on) merged onto the parent's memory so that every snapshot directory has one complete memory
file. Restore maps that file MAP_PRIVATE (``mem_backend`` ``File``), which every VM restored
from one snapshot shares; ``AGENTENV_FIRECRACKER_UFFD=1`` instead starts a page-fault server
(:mod:`.uffd`) per restored VM on ``sandboxes/<id>/uffd.sock`` that fills guest pages lazily.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import psutil

from agentenv.config import Settings, get_settings
from agentenv.types import ENVD_PORT
from agentenv.runtime import network
from agentenv.runtime.base import CpuSampler, Runtime, RuntimeError_
from agentenv.types import SandboxInstance, SandboxMetrics, SandboxSpec, SnapshotRef
from agentenv.runtime.firecracker import api
from agentenv.runtime.firecracker.config import FirecrackerSettings
from agentenv.runtime.firecracker.memory import copy_cow, merge_diff_memory
from agentenv.runtime.network import SandboxNetwork
from agentenv.runtime.qemu import vmnet
from agentenv.runtime.qemu.runtime import kill_pid, pid_alive, wait_for_envd
from agentenv.storage.images import GuestImages, build_guest_images, create_upper_drive
from agentenv.storage.reflink import ReflinkPool

log = logging.getLogger(__name__)

MARKER = "firecracker.json"
UPPER_NAME = "upper.ext4"
VSOCK_NAME = "vsock.sock"
SNAPSHOT_STATE = "vmstate.bin"
SNAPSHOT_MEMORY = "memory.bin"
SNAPSHOT_DIFF = "memory.diff"
SNAPSHOT_UPPER = "upper.ext4"
SNAPSHOT_META = "vm.json"
ENVD_TIMEOUT = 60.0


@dataclass(frozen=True)
class FcPaths:
    root: Path
    layer_dir: Path

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def api_socket(self) -> Path:
        return self.root / "api.sock"

    @property
    def vsock(self) -> Path:
        """Relative to the VMM's cwd (the layer dir), like the upper drive: a snapshot records
        it verbatim, and every restored VMM must bind its own socket."""
        return Path(VSOCK_NAME)

    @property
    def log(self) -> Path:
        return self.root / "firecracker.log"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def console(self) -> Path:
        """The VMM's stdout: the guest's serial console (ttyS0) ends up here."""
        return self.root / "console.log"

    @property
    def upper(self) -> Path:
        return self.layer_dir / UPPER_NAME

    @property
    def uffd_socket(self) -> Path:
        return self.root / "uffd.sock"


def fc_paths(settings: Settings, sandbox_id: str) -> FcPaths:
    return FcPaths(
        root=settings.data_dir / "sandboxes" / sandbox_id,
        layer_dir=ReflinkPool(settings.data_dir).root / "sandboxes" / sandbox_id,
    )


def boot_requests(
    images: GuestImages, paths: FcPaths, *, vcpus: int, memory_mb: int, kernel: Path, boot_args: str
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
        api.balloon(0),
        api.instance_start(),
    ]


def restore_requests(paths: FcPaths, source: Path, *, uffd: bool) -> list[api.ApiRequest]:
    backend = paths.uffd_socket if uffd else source / SNAPSHOT_MEMORY
    return [
        api.logger(paths.log),
        api.metrics(paths.metrics),
        api.snapshot_load(
            source / SNAPSHOT_STATE,
            backend,
            backend_type="Uffd" if uffd else "File",
            resume=True,
        ),
    ]


def _allocated_and_size(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0, 0
    return st.st_blocks * 512, st.st_size


class FirecrackerRuntime(Runtime):
    name: ClassVar[str] = "firecracker"

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self.fc = FirecrackerSettings()
        self._cpu = CpuSampler()
        #: Waiters that reap exited VMMs (kept referenced so they are not garbage-collected).
        self._reapers: set[asyncio.Task[int]] = set()

    # -- availability -------------------------------------------------------------------------

    @classmethod
    def probe(cls) -> str | None:
        from agentenv.runtime.registry import firecracker_unusable_reason

        return firecracker_unusable_reason(get_settings())

    @property
    def binary(self) -> str:
        return self.fc.pvm_binary if self.fc.pvm else self.settings.firecracker_path

    def kernel(self, images: GuestImages) -> Path:
        if self.fc.pvm:
            if self.fc.pvm_kernel is None:
                raise RuntimeError_("PVM mode needs AGENTENV_FIRECRACKER_PVM_KERNEL (a PVM guest vmlinux)")
            return self.fc.pvm_kernel
        return self.fc.kernel or images.kernel.vmlinux

    def boot_args(self, images: GuestImages) -> str:
        gateway, guest = vmnet.guest_addresses(self.settings)
        # Firecracker has no PCI bus and no i8042; the kernel must not wait for either.
        return images.cmdline(guest, gateway) + " pci=off i8042.noaux i8042.nomux i8042.dumbkbd"

    # -- lifecycle ----------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        return await self._start(spec, snapshot=None)

    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        if not (source.path / SNAPSHOT_STATE).is_file():
            raise RuntimeError_(f"snapshot {source.snapshot_id} has no Firecracker VM state", code=404)
        return await self._start(spec, snapshot=source)

    async def fork(
        self, instance: SandboxInstance, snapshot: SnapshotRef, specs: list[SandboxSpec]
    ) -> list[SandboxInstance]:
        """Snapshot ``instance`` (it keeps running) and start one VM per spec from it.

        The children share the snapshot's memory file (MAP_PRIVATE) and reflink-clone its disk."""
        await self.snapshot(instance, snapshot, stop=False)
        return list(await asyncio.gather(*(self.restore(spec, snapshot) for spec in specs)))

    async def _start(self, spec: SandboxSpec, snapshot: SnapshotRef | None) -> SandboxInstance:
        sid = spec.sandbox_id
        paths = fc_paths(self.settings, sid)
        tmpl = spec.template
        if snapshot is None:
            images = await asyncio.to_thread(build_guest_images, self.settings, tmpl.template_id, tmpl.rootfs)
            vcpus, memory_mb = tmpl.vcpus, tmpl.memory_mb
        else:
            meta = json.loads((snapshot.path / SNAPSHOT_META).read_text())
            images = GuestImages.from_json(meta["images"])
            vcpus, memory_mb = meta["vcpus"], meta["memory_mb"]
        state: dict[str, Any] = {
            "paths": str(paths.root), "upper": str(paths.upper), "images": images.to_json(),
            "vcpus": vcpus, "memory_mb": memory_mb, "pvm": self.fc.pvm,
        }
        try:
            paths.root.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise RuntimeError_(f"sandbox {sid} already exists on this node", code=409) from None
        try:
            paths.layer_dir.mkdir(parents=True, exist_ok=True)
            if snapshot is None:
                await asyncio.to_thread(create_upper_drive, self.settings, images, paths.upper)
            else:
                await asyncio.to_thread(copy_cow, snapshot.path / SNAPSHOT_UPPER, paths.upper)
            net = await network.setup_network(
                self.settings, sid, allow_internet_access=spec.allow_internet_access
            )
            state["network"] = net.to_state()
            paths.marker.write_text(json.dumps(state))
            await vmnet.add_tap(self.settings, net)
            state["pid"] = await self._spawn(net, paths)
            paths.marker.write_text(json.dumps(state))

            async def alive() -> bool:
                return pid_alive(state["pid"], "firecracker")

            # Firecracker opens, never creates, its log and metrics files.
            for output in (paths.log, paths.metrics):
                output.touch()
            client = api.FirecrackerClient(paths.api_socket)
            try:
                await client.wait_ready(self.fc.boot_timeout, alive)
                if snapshot is None:
                    await client.send_all(
                        boot_requests(
                            images, paths, vcpus=vcpus, memory_mb=memory_mb,
                            kernel=self.kernel(images), boot_args=self.boot_args(images),
                        )
                    )
                else:
                    if self.fc.uffd:
                        memory = snapshot.path / SNAPSHOT_MEMORY
                        state["uffd_pid"] = await self._start_uffd_handler(paths, memory)
                        paths.marker.write_text(json.dumps(state))
                    await client.send_all(restore_requests(paths, snapshot.path, uffd=self.fc.uffd))
            finally:
                await client.close()
            url = f"http://{net.sandbox_ip}:{ENVD_PORT}"
            await wait_for_envd(url, ENVD_TIMEOUT, alive, paths.console)
            return SandboxInstance(sid, self.name, url, net.sandbox_ip, state)
        except BaseException:
            await self._destroy(sid, state)
            raise

    async def _spawn(self, net: SandboxNetwork, paths: FcPaths) -> int:
        """Start the VMM in the sandbox's netns, cwd = its layer directory (see module doc)."""
        if shutil.which(self.binary) is None:
            raise RuntimeError_(f"firecracker binary {self.binary!r} not found (see docs/KVM.md)")
        # The child inherits the descriptor; the parent's copy is closed right after the spawn.
        console = await asyncio.to_thread(open, paths.console, "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                "nsenter", f"--net={net.netns_path}", "--",
                self.binary, "--api-sock", str(paths.api_socket), "--id", net.sandbox_id[:60],
                cwd=paths.layer_dir, stdin=asyncio.subprocess.DEVNULL, stdout=console,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )
        finally:
            console.close()
        # nsenter execs the VMM in place, so this pid is firecracker's own.
        reaper = asyncio.get_running_loop().create_task(proc.wait())
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)
        return proc.pid

    async def _start_uffd_handler(self, paths: FcPaths, memory: Path) -> int:
        """One page-fault server per restored VM (:mod:`.uffd`); it exits with its VMM."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentenv.runtime.firecracker.uffd", str(paths.uffd_socket), str(memory),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        if line.strip() != b"ready":
            raise RuntimeError_("the userfaultfd page server did not start")
        reaper = asyncio.get_running_loop().create_task(proc.wait())
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)
        return proc.pid

    async def kill(self, instance: SandboxInstance) -> None:
        await self._destroy(instance.sandbox_id, instance.state)

    async def _destroy(self, sandbox_id: str, state: dict[str, Any]) -> None:
        paths = fc_paths(self.settings, sandbox_id)
        if not state and paths.marker.exists():
            with contextlib.suppress(ValueError, OSError):
                state = json.loads(paths.marker.read_text())
        await kill_pid(state.get("pid"), "firecracker")
        await kill_pid(state.get("uffd_pid"), "python")
        net_state = state.get("network")
        net = SandboxNetwork.from_state(net_state) if net_state else None
        await network.teardown_network(self.settings, sandbox_id, net)
        pool = ReflinkPool(self.settings.data_dir)
        pool.remove(paths.upper)
        with contextlib.suppress(OSError):
            paths.layer_dir.rmdir()
        shutil.rmtree(paths.root, ignore_errors=True)
        self._cpu.forget(sandbox_id)

    async def is_alive(self, instance: SandboxInstance) -> bool:
        return pid_alive(instance.state.get("pid"), "firecracker")

    async def metrics(self, instance: SandboxInstance) -> SandboxMetrics:
        state = instance.state
        vcpus, mem_total = int(state["vcpus"]), int(state["memory_mb"]) << 20
        upper = Path(state["upper"])
        try:
            proc = psutil.Process(state.get("pid"))
            times = proc.cpu_times()
            cpu_total = times.user + times.system
            rss = proc.memory_info().rss
        except (psutil.Error, TypeError) as exc:
            raise RuntimeError_(f"sandbox {instance.sandbox_id} is not running: {exc}", code=404) from exc
        pct = self._cpu.percent(instance.sandbox_id, cpu_total, vcpus) or 0.0
        disk_used, disk_total = await asyncio.to_thread(_allocated_and_size, upper)
        return SandboxMetrics(vcpus, pct, min(rss, mem_total), mem_total, disk_used, disk_total)

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed = []
        for marker in sorted((self.settings.data_dir / "sandboxes").glob(f"*/{MARKER}")):
            sid = marker.parent.name
            if sid not in keep:
                await self._destroy(sid, {})
                removed.append(sid)
        return removed

    # -- snapshots ----------------------------------------------------------------------------

    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Pause, write VM state + memory (Diff against ``dest.parent`` when given), clone the
        upper drive, then resume (or, with ``stop``, tear the VM down: that is a pause)."""
        paths = fc_paths(self.settings, instance.sandbox_id)
        dest.path.mkdir(parents=True, exist_ok=True)
        parent = dest.parent
        diff = parent is not None and (parent.path / SNAPSHOT_MEMORY).is_file()
        memory_target = dest.path / (SNAPSHOT_DIFF if diff else SNAPSHOT_MEMORY)
        client = api.FirecrackerClient(paths.api_socket, timeout=300.0)
        try:
            await client.send(api.vm_state("Paused"))
            try:
                await client.send(
                    api.snapshot_create(dest.path / SNAPSHOT_STATE, memory_target, "Diff" if diff else "Full")
                )
                # vCPUs are stopped and Firecracker's Sync engine has written every completed
                # request: the upper drive file is consistent with the memory image.
                await asyncio.to_thread(copy_cow, paths.upper, dest.path / SNAPSHOT_UPPER)
            finally:
                if not stop:
                    await client.send(api.vm_state("Resumed"))
        finally:
            await client.close()
        if diff:
            assert parent is not None
            await asyncio.to_thread(
                merge_diff_memory, parent.path / SNAPSHOT_MEMORY, memory_target, dest.path / SNAPSHOT_MEMORY
            )
            memory_target.unlink()
        meta = {key: instance.state[key] for key in ("images", "vcpus", "memory_mb", "pvm")} | {
            "runtime": self.name, "type": "Diff" if diff else "Full",
            "parent": parent.snapshot_id if parent else None,
        }
        (dest.path / SNAPSHOT_META).write_text(json.dumps(meta, indent=2) + "\n")
        if stop:
            await self._destroy(instance.sandbox_id, instance.state)
