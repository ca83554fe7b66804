"""What the microVM runtimes share (forkyard.runtime.microvm) and what QEMU decides without a VM:
the accelerator, its command line, which snapshots it can restore; the state-file writes."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from forkyard.config import FirecrackerSettings, QemuSettings, Settings
from forkyard.errors import Conflict, Gone, NotFound, Unavailable
from forkyard.runtime.firecracker.runtime import FirecrackerRuntime
from forkyard.runtime.kvm import kvm_unusable_reason
from forkyard.runtime.microvm.host import pid_alive
from forkyard.runtime.microvm.runtime import (
    SNAPSHOT_META,
    Boot,
    claim_dir,
    read_snapshot,
    write_marker,
)
from forkyard.runtime.microvm.state import MicroVMState
from forkyard.runtime.network import SandboxNetwork
from forkyard.runtime.qemu.runtime import QemuRuntime, vm_paths
from forkyard.storage import atomic
from forkyard.storage.images import GuestImages, GuestKernel
from forkyard.types import SnapshotRef


def _images(root: Path) -> GuestImages:
    kernel = GuestKernel(root / "vmlinux", root / "initramfs.cpio", "6.1.0-test-cloud-amd64")
    images = GuestImages(kernel, root / "base.ext4", root / "envd.ext4", root / "upper.ext4")
    for artifact in (kernel.vmlinux, kernel.initramfs, images.base, images.envd):
        artifact.write_bytes(b"artifact")
    return images


def _qemu(tmp_path: Path, accel: str) -> QemuRuntime:
    return QemuRuntime(Settings(data_dir=tmp_path, qemu=QemuSettings(accel=accel)))  # type: ignore[arg-type]


# -- QEMU: the accelerator ---------------------------------------------------------------------


@pytest.mark.parametrize("accel", ["kvm", "tcg"])
def test_qemu_runs_the_accelerator_it_is_told(tmp_path: Path, accel: str) -> None:
    runtime = _qemu(tmp_path, accel)
    assert runtime.accel == accel
    cmd = runtime.command(_images(tmp_path), vm_paths(runtime.settings, "q1"), vcpus=2, memory_mb=256)
    machine, cpu = cmd[cmd.index("-M") + 1], cmd[cmd.index("-cpu") + 1]
    if accel == "kvm":
        assert (machine, cpu) == ("microvm,accel=kvm", "host")
    else:
        # TCG: legacy timers as references and the TSC frequency on the kernel command line.
        assert (machine, cpu) == ("microvm,accel=tcg,pit=on,pic=on,rtc=on", "max")
        assert "tsc_early_khz=" in cmd[cmd.index("-append") + 1]


def test_qemu_auto_is_kvm_exactly_when_kvm_can_boot_guests(tmp_path: Path) -> None:
    expected = "kvm" if kvm_unusable_reason() is None else "tcg"
    assert _qemu(tmp_path, "auto").accel == expected


def test_qemu_told_to_use_an_unusable_kvm_says_why(tmp_path: Path) -> None:
    kvm_reason = kvm_unusable_reason()
    if kvm_reason is not None and _qemu(tmp_path, "tcg").probe() is None:
        assert _qemu(tmp_path, "kvm").probe() == f"FORKYARD_QEMU__ACCEL=kvm, but {kvm_reason}"
    else:
        pytest.skip(f"needs qemu and root, and a KVM that cannot boot guests (kvm: {kvm_reason})")


def test_a_snapshot_restores_only_under_the_accelerator_it_was_taken_with(tmp_path: Path) -> None:
    images = _images(tmp_path)
    snapshot = SnapshotRef("s1", tmp_path / "s1")
    taken_under_kvm = Boot(images, 1, 256, snapshot, {"accel": "kvm"})
    _qemu(tmp_path, "kvm")._check_restorable(taken_under_kvm)
    with pytest.raises(Unavailable, match="taken under kvm; QEMU here runs tcg"):
        _qemu(tmp_path, "tcg")._check_restorable(taken_under_kvm)


def test_firecracker_restores_only_snapshots_of_its_own_mode(tmp_path: Path) -> None:
    boot = Boot(_images(tmp_path), 1, 256, SnapshotRef("s1", tmp_path / "s1"), {"pvm": True})
    pvm = Settings(data_dir=tmp_path, firecracker=FirecrackerSettings(pvm=True))
    FirecrackerRuntime(pvm)._check_restorable(boot)
    with pytest.raises(Unavailable, match="PVM mode"):
        FirecrackerRuntime(Settings(data_dir=tmp_path))._check_restorable(boot)


# -- shared: snapshots, sandbox directories ----------------------------------------------------


def test_read_snapshot_names_what_is_missing(tmp_path: Path) -> None:
    images = _images(tmp_path)
    source = SnapshotRef("s1", tmp_path / "s1")
    source.path.mkdir()
    with pytest.raises(NotFound, match="not a qemu snapshot"):
        read_snapshot(source, "memory.bin", "qemu")
    (source.path / "memory.bin").write_bytes(b"ram")
    meta = {"images": images.to_json(), "vcpus": 2, "memory_mb": 256, "accel": "tcg"}
    (source.path / SNAPSHOT_META).write_text(json.dumps(meta))
    boot = read_snapshot(source, "memory.bin", "qemu")
    assert (boot.images, boot.vcpus, boot.memory_mb, boot.snapshot) == (images, 2, 256, source)
    assert boot.meta["accel"] == "tcg"
    images.base.unlink()
    with pytest.raises(Gone, match=r"s1 cannot be restored: .*base"):
        read_snapshot(source, "memory.bin", "qemu")


def test_a_sandbox_directory_is_claimed_once_unless_a_pause_kept_it(tmp_path: Path) -> None:
    paths = vm_paths(Settings(data_dir=tmp_path), "q1")
    assert claim_dir("q1", paths) is None and paths.root.is_dir()
    write_marker(paths, MicroVMState(pid=1))
    with pytest.raises(Conflict, match="already exists"):
        claim_dir("q1", paths)
    net = SandboxNetwork("q1", "ae-q1", 3, "aeh3", "aes3", "10.213.0.13", "10.213.0.14")
    write_marker(paths, MicroVMState.paused_with(net))
    assert claim_dir("q1", paths) == net


# -- state files -------------------------------------------------------------------------------


def test_state_files_are_flushed_before_they_replace_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.json"
    target.write_text("{}\n")
    synced: list[Path] = []
    real_fsync = atomic.os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    atomic.write_json_atomic(target, {"pid": 7})
    assert json.loads(target.read_text()) == {"pid": 7}
    # The temp file's data before the rename, then the directory's entry of the rename.
    assert [p.name.startswith(".state.json.") for p in synced] == [True, False]
    assert synced[1] == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_state_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "state.json"
    target.write_text('{"pid": 1}\n')

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_json_atomic(target, {"pid": 2})
    assert json.loads(target.read_text()) == {"pid": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_vmm_still_in_nsenter_counts_as_the_vmm() -> None:
    """``nsenter --net=... -- firecracker ...`` before its exec: the VMM, not a dead one (under
    load, the wait for its API socket gave up on it and the clean-up left the VMM running)."""
    script = "import time; time.sleep(30)"
    argv = ["bash", "-c", 'exec -a nsenter "$0" -c "$1" -- /usr/bin/firecracker --api-sock /s/sbx1/api.sock']
    proc = subprocess.Popen([*argv, sys.executable, script])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).cmdline()[:1] != ["nsenter"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pid_alive(proc.pid, "firecracker", "/s/sbx1")
        assert not pid_alive(proc.pid, "firecracker", "/s/sbx2")  # another sandbox's
        assert not pid_alive(proc.pid, "qemu")
    finally:
        proc.kill()
        proc.wait()
    assert not pid_alive(proc.pid, "firecracker")
