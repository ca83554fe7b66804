"""Which isolation runtimes exist, and which one this node uses.

Runtimes are imported lazily: importing the registry must not pull in (or fail on) the code
of a runtime the node never uses.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
from pathlib import Path

from agentenv.config import Settings
from agentenv.errors import Invalid
from agentenv.runtime.base import Runtime
from agentenv.types import RUNTIME_NAMES, RuntimeName

#: name -> "module:ClassName"
_RUNTIMES: dict[RuntimeName, str] = {
    "gvisor": "agentenv.runtime.gvisor.runtime:GvisorRuntime",
    "qemu": "agentenv.runtime.qemu.runtime:QemuRuntime",
    "firecracker": "agentenv.runtime.firecracker.runtime:FirecrackerRuntime",
}

#: ``_IO(KVMIO, 0x00)``; the stable KVM API version every usable /dev/kvm reports.
KVM_GET_API_VERSION = 0xAE00
KVM_API_VERSION = 12


def runtime_names() -> list[RuntimeName]:
    return list(RUNTIME_NAMES)


def _runtime_class(name: RuntimeName) -> type[Runtime]:
    try:
        target = _RUNTIMES[name]
    except KeyError:
        raise Invalid(f"unknown runtime {name!r}; expected one of {', '.join(_RUNTIMES)} or 'auto'") from None
    module_name, class_name = target.split(":")
    cls: type[Runtime] = getattr(importlib.import_module(module_name), class_name)
    return cls


def get_runtime(name: RuntimeName, settings: Settings) -> Runtime:
    """An instance of the runtime called ``name``, built with ``settings`` (no availability
    check: see ``probe``). A name that is no runtime is ``Invalid``."""
    return _runtime_class(name)(settings)


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
                "(set AGENTENV_FIRECRACKER__PVM=1 with a PVM firecracker and guest kernel)"
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


def firecracker_unusable_reason(settings: Settings) -> str | None:
    """None when the firecracker runtime can run with ``settings.firecracker``, else why not."""
    fc = settings.firecracker
    problems = []
    if shutil.which(fc.binary) is None:
        problems.append(f"firecracker binary {fc.binary!r} not found")
    if fc.pvm and (fc.pvm_kernel is None or not fc.pvm_kernel.is_file()):
        problems.append("PVM mode needs AGENTENV_FIRECRACKER__PVM_KERNEL, an existing PVM guest vmlinux")
    kvm_reason = kvm_unusable_reason(pvm=fc.pvm)
    if kvm_reason is not None:
        problems.append(kvm_reason)
    # Both reasons are reported: fixing only one of them would not make firecracker usable.
    return "; ".join(problems) + " (see docs/KVM.md)" if problems else None


def select_runtime(
    settings: Settings, template_override: RuntimeName | None = None
) -> tuple[Runtime, dict[str, str]]:
    """The runtime to use, plus per runtime not chosen the reason why (for the start-up log).

    A template override wins over ``settings.runtime``; an explicit name wins over ``auto``.
    ``auto`` is firecracker when it can run here, else gvisor.
    """
    requested = template_override or settings.runtime
    if requested != "auto":
        chosen = get_runtime(requested, settings)
        why = "template override" if template_override else f"AGENTENV_RUNTIME={settings.runtime}"
        others = [name for name in _RUNTIMES if name != requested]
        return chosen, {name: f"not selected ({why} chose {requested})" for name in others}

    reasons: dict[str, str] = {}
    fc_reason = firecracker_unusable_reason(settings)
    if fc_reason is None:
        return get_runtime("firecracker", settings), {
            "gvisor": "auto: firecracker is usable and preferred",
            "qemu": "auto: firecracker is usable and preferred",
        }
    reasons["firecracker"] = fc_reason
    reasons["qemu"] = "auto never picks qemu (select it with AGENTENV_RUNTIME=qemu)"
    return get_runtime("gvisor", settings), reasons
