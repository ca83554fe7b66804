"""Whether this host's /dev/kvm can run guests: asked by every runtime that can use KVM
(gVisor's kvm platform, QEMU's accelerator, Firecracker) and by the runtime catalogue (kinds.py)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

#: ``_IO(KVMIO, 0x00)``; the stable KVM API version every usable /dev/kvm reports.
KVM_GET_API_VERSION = 0xAE00
KVM_API_VERSION = 12


def kvm_unusable_reason(device: str = "/dev/kvm", *, pvm: bool = False) -> str | None:
    """None when ``device`` is a KVM that can run guests, else why not.

    A host kernel can expose /dev/kvm without VT-x/AMD-V (nested setups serving KVM through PVM):
    such a /dev/kvm answers ioctls but cannot boot ordinary guests, so the CPU flags count too,
    unless ``pvm`` (PVM guests need no vmx/svm, only the host's kvm_pvm module).
    """
    reason = kvm_device_unusable_reason(device)
    if reason is not None:
        return reason
    if pvm:
        if not pvm_host_available():
            return "PVM mode requested but the host kernel has no kvm_pvm module loaded"
        return None
    if not cpu_has_hardware_virtualisation():
        if pvm_host_available():
            return (
                f"{device} works but the CPU has no vmx/svm: only PVM guests can run "
                "(set FORKYARD_FIRECRACKER__PVM=1 with a PVM firecracker and guest kernel)"
            )
        return f"{device} works but the CPU has no vmx/svm flag, so KVM cannot boot guests"
    return None


def kvm_device_unusable_reason(device: str = "/dev/kvm") -> str | None:
    """None when ``device`` opens and answers KVM_GET_API_VERSION with the stable version."""
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"{device} cannot be opened: {exc.strerror}"
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as exc:
        return f"KVM_GET_API_VERSION on {device} failed: {exc.strerror}"
    finally:
        os.close(fd)
    if version != KVM_API_VERSION:
        return f"{device} reports KVM API version {version}, expected {KVM_API_VERSION}"
    return None


def cpu_has_hardware_virtualisation(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return bool(flags & {"vmx", "svm"})
    return False


def pvm_host_available() -> bool:
    """Whether the host kernel has the PVM hypervisor (``kvm_pvm`` module) loaded."""
    return Path("/sys/module/kvm_pvm").exists()
