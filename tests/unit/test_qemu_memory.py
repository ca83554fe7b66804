"""QEMU guest RAM as a file and spare QEMUs, without a VM: the command lines a mode gives, which
mode a start follows, and the spare pool's bookkeeping over real processes."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from forkyard.config import QemuSettings, Settings
from forkyard.runtime.microvm.host import pid_alive
from forkyard.runtime.microvm.runtime import Boot
from forkyard.runtime.qemu.runtime import UPPER_FDSET, QemuRuntime, QemuState, vm_paths
from forkyard.runtime.qemu.spares import Shape, Spare, SparePool
from forkyard.storage.images import GuestImages, GuestKernel
from forkyard.types import SnapshotRef


def _images(root: Path, name: str = "base") -> GuestImages:
    kernel = GuestKernel(root / f"{name}.vmlinux", root / "initramfs.cpio", "6.1.0-test-cloud-amd64")
    images = GuestImages(kernel, root / f"{name}.ext4", root / "envd.ext4", root / "upper.ext4")
    for artifact in (kernel.vmlinux, kernel.initramfs, images.base, images.envd):
        artifact.write_bytes(b"artifact")
    return images


def _qemu(tmp_path: Path, **qemu: object) -> QemuRuntime:
    return QemuRuntime(Settings(data_dir=tmp_path, qemu=QemuSettings(accel="tcg", **qemu)))  # type: ignore[arg-type]


def test_file_memory_maps_the_ram_file_shared(tmp_path: Path) -> None:
    runtime = _qemu(tmp_path)
    paths = vm_paths(runtime.settings, "q1")
    cmd = runtime.command(_images(tmp_path), paths, vcpus=1, memory_mb=1024, memory="file", incoming="defer")
    assert cmd[cmd.index("-M") + 1].endswith(",memory-backend=ram0")
    backend = cmd[cmd.index("-object") + 1]
    # share=on: guest writes go to the file (a snapshot reflinks it); the size is -m's.
    assert backend == f"memory-backend-file,id=ram0,size=1024M,mem-path={paths.layer_dir}/memory.ram,share=on"
    assert cmd[cmd.index("-m") + 1] == "1024"
    assert cmd[-2:] == ["-incoming", "defer"]


def test_stream_memory_is_anonymous(tmp_path: Path) -> None:
    runtime = _qemu(tmp_path, memory="stream")
    cmd = runtime.command(_images(tmp_path), vm_paths(runtime.settings, "q1"), vcpus=1, memory_mb=256)
    assert "-object" not in cmd and "memory-backend" not in cmd[cmd.index("-M") + 1]


def test_a_spare_gets_its_upper_drive_by_descriptor(tmp_path: Path) -> None:
    """QEMU reopens a drive by name when it activates it after an incoming migration; a spare's
    file is renamed by then, so it goes as an fd set (one descriptor per access mode)."""
    runtime = _qemu(tmp_path)
    paths = runtime.spare_paths("0123abcd")
    cmd = runtime.command(
        _images(tmp_path), paths, vcpus=1, memory_mb=256, memory="file", tap="aeq0123abcd", upper_fds=(7, 8)
    )
    drives = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-drive"]
    assert f"id=upper,file=/dev/fdset/{UPPER_FDSET},format=raw,if=none,cache=unsafe" in drives
    assert [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-add-fd"] == [
        f"fd=7,set={UPPER_FDSET}",
        f"fd=8,set={UPPER_FDSET}",
    ]
    assert "tap,id=net0,ifname=aeq0123abcd,script=no,downscript=no" in cmd
    assert str(paths.root) in " ".join(cmd)  # what pid checks of an adopted spare look for


def test_a_restore_follows_its_snapshot_and_a_boot_the_setting(tmp_path: Path) -> None:
    runtime = _qemu(tmp_path, memory="file")
    images = _images(tmp_path)
    snap = SnapshotRef("s1", tmp_path / "s1")
    assert runtime._memory_of(Boot(images, 1, 256)) == "file"
    # A snapshot from before RAM files records no mode: it is a stream.
    assert runtime._memory_of(Boot(images, 1, 256, snap, {})) == "stream"
    assert runtime._memory_of(Boot(images, 1, 256, snap, {"memory": "file"})) == "file"
    streaming = _qemu(tmp_path, memory="stream")
    assert streaming._memory_of(Boot(images, 1, 256, snap, {"memory": "file"})) == "file"
    state = QemuState()
    streaming._extra_state(Boot(images, 1, 256, snap, {"memory": "file"}), state)
    assert state.memory == "file"


# -- the spare pool, over real processes ---------------------------------------------------------


class SleepSpares:
    """Spares that are real `sleep` processes: the pool's bookkeeping is what is tested."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Spare] = []
        self.discarded: list[str] = []
        self._procs: dict[int, asyncio.subprocess.Process] = {}

    async def spawn(self, shape: Shape) -> Spare:
        proc = await asyncio.create_subprocess_exec("sleep", "600")
        spare = Spare(f"{len(self.started):08x}", shape.key, proc.pid, self.tmp_path)
        self.started.append(spare)
        self._procs[proc.pid] = proc
        return spare

    async def discard(self, spare: Spare) -> None:
        self.discarded.append(spare.token)
        proc = self._procs[spare.pid]
        if proc.returncode is None:
            proc.kill()
        await proc.wait()

    def alive(self, spare: Spare) -> bool:
        return pid_alive(spare.pid, "sleep")


def test_spares_fill_serve_one_shape_and_die_on_close(tmp_path: Path) -> None:
    backing = SleepSpares(tmp_path)
    one, other = Shape(_images(tmp_path), 1, 256), Shape(_images(tmp_path, "other"), 1, 256)

    async def scenario() -> None:
        pool = SparePool(2, backing.spawn, backing.discard, backing.alive)
        pool.want(one)
        assert await pool.wait_ready(one, 2, limit_s=10)
        assert pool.take(other) is None  # another shape's restore gets none
        taken = pool.take(one)
        assert taken is not None and backing.alive(taken)
        assert taken.token not in pool.tokens()
        pool.want(one)  # refilled after use
        assert await pool.wait_ready(one, 2, limit_s=10)
        # A spare that died meanwhile is skipped and discarded.
        dead = next(s for s in backing.started if s.token in pool.tokens())
        os.kill(dead.pid, signal.SIGKILL)
        await backing._procs[dead.pid].wait()
        alive = pool.take(one)
        assert alive is not None and alive.token != dead.token
        # Another shape replaces the spares of the first.
        pool.want(other)
        assert await pool.wait_ready(other, 2, limit_s=10)
        assert pool.ready(one) == 0
        await pool.close()
        assert pool.tokens() == set()
        left = [s for s in backing.started if s.token not in (taken.token, alive.token)]
        assert not any(backing.alive(s) for s in left)
        await backing.discard(taken)
        await backing.discard(alive)

    asyncio.run(scenario())


def test_no_spares_when_the_setting_is_zero(tmp_path: Path) -> None:
    backing = SleepSpares(tmp_path)
    shape = Shape(_images(tmp_path), 1, 256)

    async def scenario() -> None:
        pool = SparePool(0, backing.spawn, backing.discard, backing.alive)
        pool.want(shape)
        assert not await pool.wait_ready(shape, 1, limit_s=0.2)
        assert pool.take(shape) is None

    asyncio.run(scenario())
    assert backing.started == []


@pytest.mark.parametrize("prespawn", [0, 3])
def test_the_pool_is_sized_by_the_setting(tmp_path: Path, prespawn: int) -> None:
    assert _qemu(tmp_path, prespawn=prespawn).spares.size == prespawn
