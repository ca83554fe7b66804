"""Which isolation runtimes exist, and which one this node uses.

Runtimes are imported lazily: importing this catalogue must not pull in (or fail on) the code
of a runtime the node never uses.
"""

from __future__ import annotations

import importlib
import shutil

from forkyard.config import Settings
from forkyard.errors import Invalid
from forkyard.runtime.base import Runtime
from forkyard.runtime.firecracker_version import binary_version_problem
from forkyard.runtime.kvm import kvm_unusable_reason
from forkyard.types import RUNTIME_NAMES, RuntimeName

#: name -> "module:ClassName"
_RUNTIMES: dict[RuntimeName, str] = {
    "gvisor": "forkyard.runtime.gvisor.runtime:GvisorRuntime",
    "qemu": "forkyard.runtime.qemu.runtime:QemuRuntime",
    "firecracker": "forkyard.runtime.firecracker.runtime:FirecrackerRuntime",
}


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


def firecracker_unusable_reason(settings: Settings) -> str | None:
    """None when the firecracker runtime can run with ``settings.firecracker``, else why not."""
    fc = settings.firecracker
    problems = []
    if shutil.which(fc.binary) is None:
        problems.append(f"firecracker binary {fc.binary!r} not found")
    elif (version := binary_version_problem(fc.binary)) is not None:
        problems.append(version)
    if fc.pvm and (fc.pvm_kernel is None or not fc.pvm_kernel.is_file()):
        problems.append("PVM mode needs FORKYARD_FIRECRACKER__PVM_KERNEL, an existing PVM guest vmlinux")
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
        why = "template override" if template_override else f"FORKYARD_RUNTIME={settings.runtime}"
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
    reasons["qemu"] = "auto never picks qemu (select it with FORKYARD_RUNTIME=qemu)"
    return get_runtime("gvisor", settings), reasons
