"""QEMU microVM runtime, for real: the guest pipeline's kernel + drives booted under
``qemu-system-x86_64 -M microvm`` (TCG here: this host's /dev/kvm has no vmx/svm).

* the official e2b SDK through a real ``forkyard serve`` (FORKYARD_RUNTIME=qemu): command,
  file write + read, ``uname -r`` is the Debian cloud kernel of the pipeline, kill leaves nothing;
* snapshot (reflink clones of the guest's RAM file and upper drive + QEMU's device state) and
  restore into other sandboxes, through a pre-started QEMU (a spare) and without one, with the
  guest's memory state (same kernel boot id, same process) and disk preserved; a restored
  guest's memory is private (its writes reach neither the snapshot's RAM file nor a sibling's);
* the earlier path (``memory=stream``: RAM migrated to a file and read back) still restores;
* the lifecycle through the server with the SDK: pause/resume, snapshot -> new sandboxes, fork
  (a marker one fork child holds in memory is in its own RAM file only).

TCG boots are slow (a python envd starting on an emulated CPU): each VM takes 1-3 minutes.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox
from e2b.connection_config import ConnectionConfig
from packaging.version import Version

from forkyard.config import QemuSettings, Settings
from forkyard.runtime.qemu.runtime import QemuRuntime, QemuState, vm_paths
from forkyard.runtime.qemu.spares import Shape
from forkyard.storage import images
from forkyard.storage.reflink import ReflinkPool
from forkyard.types import SandboxInstance, SandboxSpec, SnapshotRef, TemplateImage
from tests.support import SHARED_TEMPLATES, leaks, unique_id
from tests.support.counter import STATE_FILE, assert_state_continues, counter_command, read_counter
from tests.support.server import ServerProcess, kill_all_sandboxes, start_server

pytestmark = [pytest.mark.requires_root("microVM sandboxes (netns, tap)")]

VM_LIMIT = 600.0


def _skip_reason() -> str | None:
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed"
    if not (SHARED_TEMPLATES / "base" / ".complete").is_file():
        return f"the base template is not built in {SHARED_TEMPLATES}"
    return None


@pytest.fixture(scope="module")
def qemu_settings() -> Iterator[Settings]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    data = Path(tempfile.mkdtemp(prefix="aeq-", dir="/tmp"))
    settings = Settings(data_dir=data, templates_path=SHARED_TEMPLATES)
    yield settings
    asyncio.run(QemuRuntime(settings).cleanup_orphans(set()))
    ReflinkPool(data).destroy()
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="module")
def base(qemu_settings: Settings) -> TemplateImage:
    from forkyard.storage.templates import load_template

    return load_template("base", qemu_settings)


@pytest.fixture(scope="module")
def guest(qemu_settings: Settings, base: TemplateImage) -> images.GuestImages:
    return images.build_guest_images(qemu_settings, "base", base.rootfs)


def test_pipeline_artifacts(guest: images.GuestImages, qemu_settings: Settings, base: TemplateImage) -> None:
    vmlinux = guest.kernel.vmlinux.read_bytes()
    assert vmlinux[:4] == b"\x7fELF" and vmlinux[4] == 2  # 64-bit ELF, uncompressed
    assert guest.kernel.release.endswith("-cloud-amd64") and guest.kernel.release.startswith("6.1.")
    cpio = guest.kernel.initramfs.read_bytes()
    assert cpio.startswith(b"070701")
    wanted = [
        "init",
        "bin/busybox",
        "modules/virtio_blk.ko",
        "modules/virtio_net.ko",
        "modules/virtio_mmio.ko",
        "modules/overlay.ko",
        "modules/vmw_vsock_virtio_transport.ko",
    ]
    for name in wanted:
        assert name.encode() + b"\0" in cpio, name
    # The read-only drives are ext4 images built without mounting anything.
    for drive in (guest.base, guest.envd, guest.upper_template):
        cmd = ["dumpe2fs", "-h", str(drive)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        assert "Filesystem magic number:  0xEF53" in out
    listing = subprocess.run(
        ["debugfs", "-R", "ls -p /usr/bin", str(guest.base)], capture_output=True, text=True, check=True
    ).stdout
    assert "/bash/" in listing
    # Cached and content-addressed: a second build returns the same files without rebuilding.
    again = images.build_guest_images(qemu_settings, "base", base.rootfs)
    assert again == guest


def test_extract_vmlinux_rejects_garbage() -> None:
    with pytest.raises(images.ImageError, match="not a bzImage"):
        images.extract_vmlinux(b"\0" * 4096)


def _host_leftovers(
    settings: Settings, sandbox_id: str, instance: SandboxInstance | None = None
) -> dict[str, object]:
    paths = vm_paths(settings, sandbox_id)
    # A VM that was a spare names the spare's directory, not the sandbox's, on its command line.
    owner = (QemuState.of(instance).vm_owner if instance else None) or str(paths.root)
    found: dict[str, object] = {
        "qemu": leaks.processes("qemu-system", owner),
        "netns": leaks.netns_exists(sandbox_id),
        "dir": paths.root.exists(),
        "upper": paths.upper.exists(),
    }
    return {k: v for k, v in found.items() if v}


def _wait_no_host_leftovers(settings: Settings, sandbox_id: str, limit_s: float = 15.0) -> dict[str, object]:
    deadline = time.monotonic() + limit_s
    while (left := _host_leftovers(settings, sandbox_id)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def test_sdk_through_server(qemu_settings: Settings, guest: images.GuestImages) -> None:
    """The official SDK against ``forkyard serve`` running the qemu runtime."""
    server = start_server(qemu_settings.data_dir / "server", extra_env={"FORKYARD_RUNTIME": "qemu"})
    try:
        sbx = Sandbox.create(
            template="base",
            timeout=900,
            request_timeout=VM_LIMIT,
            api_key=server.api_key,
            api_url=server.url,
            sandbox_url=server.url,
        )
        try:
            result = sbx.commands.run("uname -r", timeout=120, request_timeout=120)
            assert result.stdout.strip() == guest.kernel.release
            assert result.stdout.strip() != os.uname().release
            sbx.files.write("/home/user/hello.txt", "hello from a microVM\n", request_timeout=120)
            assert sbx.files.read("/home/user/hello.txt", request_timeout=120) == "hello from a microVM\n"
            result = sbx.commands.run("cat /home/user/hello.txt; id -un", timeout=120, request_timeout=120)
            assert result.stdout == "hello from a microVM\nuser\n"
        finally:
            sbx.kill(request_timeout=120)
        server_data = qemu_settings.data_dir / "server"
        # A kill returns once the VM is dead; its drive, network and directory go right after.
        assert _wait_no_host_leftovers(Settings(data_dir=server_data), sbx.sandbox_id) == {}
    finally:
        server.stop()
        ReflinkPool(qemu_settings.data_dir / "server").destroy()


def _envd_sdk(instance: SandboxInstance) -> Sandbox:
    """The official SDK pointed straight at the VM's envd (runtime-level tests, no server)."""
    headers = {"E2b-Sandbox-Id": instance.sandbox_id, "E2b-Sandbox-Port": "49983"}
    config = ConnectionConfig(
        sandbox_url=instance.envd_url, api_key="e2b_test", extra_sandbox_headers=headers
    )
    return Sandbox(  # type: ignore[call-arg]  # the SDK's own constructor kwargs (as test_gvisor)
        sandbox_id=instance.sandbox_id,
        sandbox_domain=None,
        envd_version=Version("0.6.4"),
        envd_access_token=None,
        connection_config=config,
    )


def _ram_holds(ram: Path, marker: bytes) -> bool:
    with open(ram, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(marker) != -1


def _hold_command(marker: str) -> str:
    """A guest process that holds ``marker`` in its heap (never on disk) until killed."""
    program = (
        f"import time; b = bytearray(b'{marker}') * 4096; open('/tmp/held', 'w').close(); time.sleep(1e6)"
    )
    return f'nohup python3 -c "{program}" >/dev/null 2>&1 & while [ ! -e /tmp/held ]; do sleep 0.1; done'


def _hold_in_memory(instance: SandboxInstance, marker: str) -> None:
    _envd_sdk(instance).commands.run(_hold_command(marker), timeout=120, request_timeout=120)


def _assert_memory_private(
    runtime: QemuRuntime, child: SandboxInstance, sibling: SandboxInstance, snap: SnapshotRef
) -> None:
    """The child's writes land in its own RAM file only (positive control: they are there)."""
    marker = f"ae-private-{unique_id('m')}-"
    _hold_in_memory(child, marker)
    own, other = (vm_paths(runtime.settings, i.sandbox_id).ram for i in (child, sibling))
    assert _ram_holds(own, marker.encode())
    assert not _ram_holds(other, marker.encode())
    assert not _ram_holds((snap.path / "memory.ram").resolve(), marker.encode())
    assert os.stat(own).st_ino != os.stat(other).st_ino


def test_snapshot_restore_preserves_memory_and_disk(qemu_settings: Settings, base: TemplateImage) -> None:
    runtime = QemuRuntime(qemu_settings)
    # The sibling restores without a spare: a QEMU started for it, on a clone made before.
    no_spares = QemuRuntime(qemu_settings.model_copy(update={"qemu": QemuSettings(prespawn=0)}))
    original_id, restored_id, sibling_id = unique_id("q"), unique_id("q"), unique_id("q")

    async def scenario() -> None:
        original = await runtime.create(SandboxSpec(sandbox_id=original_id, template=base))
        restored: SandboxInstance | None = None
        sibling: SandboxInstance | None = None
        try:
            sbx = _envd_sdk(original)
            sbx.files.write("/root/state.txt", "before snapshot\n", user="root", request_timeout=120)
            # A process whose memory holds state: it must still be alive, with the same pid.
            sbx.commands.run(
                "sleep 100000 >/dev/null 2>&1 &", background=True, timeout=60, request_timeout=60
            )
            before = sbx.commands.run(
                "cat /proc/sys/kernel/random/boot_id; pgrep -x sleep", timeout=60, request_timeout=60
            ).stdout
            snap = SnapshotRef(unique_id("s"), qemu_settings.data_dir / "snapshots" / "s1")
            await runtime.snapshot(original, snap, stop=False)
            # RAM is a reflink clone of the VM's RAM file; memory.bin holds device state only.
            assert (snap.path / "memory.ram").resolve().stat().st_size == base.memory_mb << 20
            assert (snap.path / "memory.bin").stat().st_size < 1 << 20
            # The original keeps running and diverges; the restore must not see that.
            sbx.files.write("/root/state.txt", "after snapshot\n", user="root", request_timeout=120)
            await runtime.kill(original)
            assert _host_leftovers(qemu_settings, original_id) == {}
            assert await runtime.spares.wait_ready(Shape(*_shape(runtime, original)), 1, 60)
            restored = await runtime.restore(SandboxSpec(sandbox_id=restored_id, template=base), snap)
            assert QemuState.of(restored).vm_owner  # it was a spare
            sibling = await no_spares.restore(SandboxSpec(sandbox_id=sibling_id, template=base), snap)
            assert QemuState.of(sibling).vm_owner is None
            for instance in (restored, sibling):
                rsbx = _envd_sdk(instance)
                after = rsbx.commands.run(
                    "cat /proc/sys/kernel/random/boot_id; pgrep -x sleep", timeout=60, request_timeout=60
                ).stdout
                assert after == before  # same kernel instance (no reboot), same process
                state = rsbx.files.read("/root/state.txt", user="root", request_timeout=120)
                assert state == "before snapshot\n"
            _assert_memory_private(runtime, restored, sibling, snap)
            await no_spares.kill(sibling)
            assert _host_leftovers(qemu_settings, sibling_id) == {}
            await _freeze_and_thaw(runtime, restored, before=before)
            restored = await _pause_and_resume(runtime, restored, base, parent=snap, before=before)
        finally:
            await runtime.kill(original)
            for vm in (restored, sibling):
                if vm is not None:
                    await runtime.kill(vm)
            await runtime.stop_prestarted()
        assert restored is not None
        assert _host_leftovers(qemu_settings, restored_id, restored) == {}
        assert leaks.processes("qemu-system", str(qemu_settings.data_dir / "qemu-spares")) == []

    asyncio.run(scenario())


def _shape(runtime: QemuRuntime, instance: SandboxInstance) -> tuple[images.GuestImages, int, int]:
    state = QemuState.of(instance)
    return images.GuestImages.from_json(state.images), state.vcpus, state.memory_mb


def test_stream_memory_restore(qemu_settings: Settings, base: TemplateImage) -> None:
    """``memory=stream`` (the path before RAM files, kept for the bench): RAM goes through the
    migration file and back; the restored guest is the same kernel and processes."""
    settings = qemu_settings.model_copy(update={"qemu": QemuSettings(memory="stream", prespawn=0)})
    runtime = QemuRuntime(settings)

    async def scenario() -> None:
        original = await runtime.create(SandboxSpec(sandbox_id=unique_id("q"), template=base))
        restored: SandboxInstance | None = None
        try:
            probe = "cat /proc/sys/kernel/random/boot_id; pgrep -x sleep"
            sbx = _envd_sdk(original)
            sbx.commands.run(
                "sleep 100000 >/dev/null 2>&1 &", background=True, timeout=60, request_timeout=60
            )
            before = sbx.commands.run(probe, timeout=60, request_timeout=60).stdout
            snap = SnapshotRef(unique_id("s"), settings.data_dir / "snapshots" / "stream")
            await runtime.snapshot(original, snap, stop=True)
            assert not (snap.path / "memory.ram").exists()
            assert (snap.path / "memory.bin").stat().st_size > 1 << 20
            restored = await runtime.restore(SandboxSpec(sandbox_id=unique_id("q"), template=base), snap)
            assert _envd_sdk(restored).commands.run(probe, timeout=60, request_timeout=60).stdout == before
        finally:
            await runtime.kill(original)
            if restored is not None:
                await runtime.kill(restored)

    asyncio.run(scenario())


async def _freeze_and_thaw(runtime: QemuRuntime, instance: SandboxInstance, *, before: str) -> None:
    """The frozen pause tier: the vCPUs stop (envd stops answering), the VM stays alive; a thaw
    lets the same processes go on."""
    await runtime.freeze(instance)
    assert await runtime.is_alive(instance)
    async with httpx.AsyncClient(trust_env=False) as client:
        with pytest.raises(httpx.TimeoutException):
            await client.get(instance.envd_url + "/health", timeout=1.0)
    await runtime.thaw(instance)
    after = (
        _envd_sdk(instance)
        .commands.run("cat /proc/sys/kernel/random/boot_id; pgrep -x sleep", timeout=60, request_timeout=60)
        .stdout
    )
    assert after == before


async def _pause_and_resume(
    runtime: QemuRuntime,
    instance: SandboxInstance,
    template: TemplateImage,
    *,
    parent: SnapshotRef,
    before: str,
) -> SandboxInstance:
    """A pause stops the VM but keeps its network; the resume (a restore under the same id) takes
    it over: same address, same memory. QEMU snapshots are full: ``parent`` changes nothing."""
    paths = vm_paths(runtime.settings, instance.sandbox_id)
    pause = SnapshotRef(unique_id("p"), runtime.settings.data_dir / "snapshots" / "pause", parent=parent)
    await runtime.snapshot(instance, pause, stop=True)
    assert json.loads((pause.path / "vm.json").read_text())["accel"] == runtime.accel
    left = _host_leftovers(runtime.settings, instance.sandbox_id, instance)
    assert left == {"netns": True, "dir": True}, left  # the VM and its drive went, the network stayed
    assert not await runtime.is_alive(instance)
    resumed = await runtime.restore(SandboxSpec(sandbox_id=instance.sandbox_id, template=template), pause)
    assert (resumed.address, resumed.envd_url) == (instance.address, instance.envd_url)
    assert resumed.network == instance.network
    after = (
        _envd_sdk(resumed)
        .commands.run("cat /proc/sys/kernel/random/boot_id; pgrep -x sleep", timeout=60, request_timeout=60)
        .stdout
    )
    assert after == before
    assert paths.marker.exists() and not (paths.root / "qemu.json.tmp").exists()
    return resumed


# -- lifecycle through the server: pause/resume, snapshots, fork -------------------------------

#: A process whose state lives in guest memory; it writes by rename so a reader never sees a
#: half-written file. 0.2 s steps: every step forks two processes on an emulated CPU.
COUNTER = counter_command(step=0.2)
#: Template snapshots and warm pools off: they would boot a second VM in the background (a minute
#: of emulated CPU on 2 cores) and are not what the lifecycle test is about.
SERVER_ENV = {
    "FORKYARD_RUNTIME": "qemu",
    "FORKYARD_TEMPLATE_SNAPSHOTS": "0",
    "FORKYARD_WARM_POOL_HIGH": "0",
    # Standbys would restore extra VMs from the snapshot the test creates twice from: the slot
    # accounting below counts only the sandboxes the test made.
    "FORKYARD_SNAPSHOT_STANDBYS": "0",
}


def _counter(sbx: Sandbox) -> int:
    return read_counter(sbx, request_timeout=120)


def _assert_state_continues(sbx: Sandbox, before: int, content: str = "parent-state") -> None:
    """The file is there and the counter process came back with its memory and keeps counting."""
    assert_state_continues(sbx, before, content, timeout=60, request_timeout=120)


def _slots(data_dir: Path) -> dict[str, str]:
    """Network slots the server holds: slot file name -> sandbox id."""
    return {p.name: p.read_text().strip() for p in (data_dir / "net").glob("slot-*")}


def _pause_restart_resume(
    servers: list[ServerProcess], parent: Sandbox, opts: dict[str, Any], before: int
) -> Sandbox:
    """Same sandbox, same memory, across a server restart: the counter goes on from where it was."""
    assert parent.pause(request_timeout=VM_LIMIT) is True
    assert Sandbox.get_info(parent.sandbox_id, **opts).state.value == "paused"
    old = servers[-1]
    old.stop()
    servers.append(start_server(old.data_dir, port=old.port, api_key=old.api_key, extra_env=SERVER_ENV))
    resumed = Sandbox.connect(parent.sandbox_id, timeout=900, **opts)
    _assert_state_continues(resumed, before)
    return resumed


def _snapshot_children(parent: Sandbox, opts: dict[str, Any], before: int, ids: list[str]) -> str:
    """The parent keeps running; two sandboxes made from its snapshot see its state and diverge."""
    snap = parent.create_snapshot(request_timeout=VM_LIMIT)
    children = [Sandbox.create(snap.snapshot_id, timeout=900, **opts) for _ in range(2)]
    ids += [c.sandbox_id for c in children]
    for child in children:
        _assert_state_continues(child, before)
    children[0].files.write(STATE_FILE, "child-0", request_timeout=120)
    assert children[1].files.read(STATE_FILE, request_timeout=120) == "parent-state"
    # A paused sandbox keeps its network for the resume: the kill at the end must free it too.
    assert children[1].pause(request_timeout=VM_LIMIT) is True
    return snap.snapshot_id


def _fork_two(parent: Sandbox, before: int, ids: list[str], data_dir: Path) -> None:
    """Each child has the parent's state and diverges on its own, in memory too (a marker one
    child holds is in its RAM file only); the parent keeps running."""
    forked = parent.fork(count=2, timeout=900, request_timeout=VM_LIMIT)
    kids = [k for k in forked if isinstance(k, Sandbox)]
    ids += [k.sandbox_id for k in kids]
    assert len(kids) == 2, [str(e) for e in forked if not isinstance(e, Sandbox)]
    for i, kid in enumerate(kids):
        _assert_state_continues(kid, before)
        kid.files.write(STATE_FILE, f"kid-{i}", request_timeout=120)
    for i, kid in enumerate(kids):
        assert kid.files.read(STATE_FILE, request_timeout=120) == f"kid-{i}"
    marker = f"ae-private-{unique_id('m')}-".encode()
    kids[0].commands.run(_hold_command(marker.decode()), timeout=120, request_timeout=120)
    pool = ReflinkPool(data_dir).root
    rams = {k.sandbox_id: pool / "sandboxes" / k.sandbox_id / "memory.ram" for k in kids}
    assert [_ram_holds(rams[k.sandbox_id], marker) for k in kids] == [True, False]
    assert not any(_ram_holds(ram, marker) for ram in (pool / "snapshots").glob("*/memory.ram"))
    _assert_state_continues(parent, before)


def _lifecycle(servers: list[ServerProcess], ids: list[str]) -> tuple[str, dict[str, str]]:
    """The whole scenario; returns the snapshot id and the network slots the sandboxes held."""
    server = servers[-1]
    opts: dict[str, Any] = {
        "api_key": server.api_key,
        "api_url": server.url,
        "sandbox_url": server.url,
        "request_timeout": VM_LIMIT,
    }
    parent = Sandbox.create("base", timeout=900, **opts)
    ids.append(parent.sandbox_id)
    parent.files.write(STATE_FILE, "parent-state", request_timeout=120)
    parent.commands.run(COUNTER, timeout=120, request_timeout=120)
    time.sleep(1)
    before = _counter(parent)
    parent = _pause_restart_resume(servers, parent, opts, before)
    snapshot_id = _snapshot_children(parent, opts, before, ids)
    _fork_two(parent, before, ids, server.data_dir)
    slots = _slots(server.data_dir)
    assert sorted(slots.values()) == sorted(ids)  # one each, the paused sandbox's too
    for sandbox_id in ids:
        Sandbox.kill(sandbox_id, **opts)
    assert Sandbox.delete_snapshot(snapshot_id, **opts) is True
    return snapshot_id, slots


@pytest.mark.timeout(900)  # one cold TCG boot alone may take minutes on a loaded host
def test_lifecycle_through_server(qemu_settings: Settings) -> None:
    """Pause, server restart, resume; snapshot -> 2 sandboxes; fork 2; kill: the official SDK
    against ``forkyard serve`` on the qemu runtime; then nothing of the sandboxes is left on the
    host."""
    data = qemu_settings.data_dir / "lifecycle"
    ids: list[str] = []
    try:
        servers = [start_server(data, extra_env=SERVER_ENV)]
        try:
            snapshot_id, slots = _lifecycle(servers, ids)
        finally:
            kill_all_sandboxes(servers[-1])
            servers[-1].stop()
        settings = Settings(data_dir=data)
        for sandbox_id in ids:
            assert _host_leftovers(settings, sandbox_id) == {}, sandbox_id
        assert _slots(data) == {}
        host_links = [f"aeh{name.removeprefix('slot-')}" for name in slots]
        assert [link for link in host_links if leaks.link_exists(link)] == []
        assert not (data / "snapshots" / snapshot_id).exists()
    finally:
        # After a failure: whatever the server left (a paused sandbox keeps its netns).
        asyncio.run(QemuRuntime(Settings(data_dir=data)).cleanup_orphans(set()))
        ReflinkPool(data).destroy()
