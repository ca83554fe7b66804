"""Runtime selection (forkyard.runtime.kinds) on this real host."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from forkyard.config import FirecrackerSettings, QemuSettings, Settings
from forkyard.errors import Invalid, http_status
from forkyard.runtime.firecracker.runtime import FirecrackerRuntime
from forkyard.runtime.firecracker_version import binary_version_problem
from forkyard.runtime.kinds import (
    firecracker_unusable_reason,
    get_runtime,
    runtime_names,
    select_runtime,
)
from forkyard.runtime.kvm import cpu_has_hardware_virtualisation, kvm_device_unusable_reason


def test_runtime_names() -> None:
    assert runtime_names() == ["gvisor", "qemu", "firecracker"]


def test_auto_falls_back_to_gvisor_with_a_reason_per_runtime(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, runtime="auto")
    fc_reason = firecracker_unusable_reason(settings)
    runtime, reasons = select_runtime(settings)
    if fc_reason is None:
        assert runtime.name == "firecracker"
        assert set(reasons) == {"gvisor", "qemu"}
    else:
        assert runtime.name == "gvisor"
        assert reasons["firecracker"] == fc_reason
        assert "qemu" in reasons
        print(f"auto -> gvisor; firecracker: {fc_reason}")


def test_explicit_runtime_and_template_override_win(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, runtime="qemu")
    runtime, reasons = select_runtime(settings)
    assert runtime.name == "qemu" and set(reasons) == {"gvisor", "firecracker"}
    runtime, reasons = select_runtime(settings, template_override="firecracker")
    assert runtime.name == "firecracker"
    assert "template override" in reasons["qemu"]


def test_unknown_runtime_is_invalid(tmp_path: Path) -> None:
    # Settings refuse the name already; a template's runtime field reaches get_runtime unchecked.
    with pytest.raises(pydantic.ValidationError):
        Settings(data_dir=tmp_path, runtime="vmware")  # type: ignore[arg-type]
    with pytest.raises(Invalid) as info:
        get_runtime("vmware", Settings(data_dir=tmp_path))  # type: ignore[arg-type]
    assert http_status(info.value) == 400 and "vmware" in info.value.message


def test_runtimes_use_the_settings_they_were_built_with(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-qemu")
    settings = Settings(data_dir=tmp_path, qemu=QemuSettings(qemu_path=missing))
    reason = get_runtime("qemu", settings).probe()
    assert reason is not None and missing in reason


def test_kvm_probe_reports_missing_device_and_cpu_flags(tmp_path: Path) -> None:
    missing = kvm_device_unusable_reason(str(tmp_path / "kvm"))
    assert missing is not None and "cannot be opened" in missing
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 hypervisor\n")
    assert not cpu_has_hardware_virtualisation(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu vmx sse2\n")
    assert cpu_has_hardware_virtualisation(cpuinfo)


def test_firecracker_pvm_mode_needs_its_own_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKYARD_FIRECRACKER__PVM", "1")
    monkeypatch.setenv("FORKYARD_FIRECRACKER__PVM_BINARY", str(tmp_path / "no-such-firecracker-pvm"))
    settings = Settings(data_dir=tmp_path)
    assert settings.firecracker.binary == str(tmp_path / "no-such-firecracker-pvm")
    reason = firecracker_unusable_reason(settings)
    assert reason is not None and "no-such-firecracker-pvm" in reason
    assert "FORKYARD_FIRECRACKER__PVM_KERNEL" in reason
    assert FirecrackerRuntime(settings).probe() == reason


def _fake_firecracker(tmp_path: Path, printed: str) -> Path:
    """An executable that answers ``--version`` like a firecracker release would."""
    binary = tmp_path / f"firecracker-{abs(hash(printed))}"
    binary.write_text(f"#!/bin/sh\necho '{printed}'\n")
    binary.chmod(0o755)
    return binary


@pytest.mark.parametrize(
    ("printed", "problem"),
    [
        ("Firecracker v1.12.1", None),
        ("Firecracker v1.17.0", None),
        ("Firecracker v1.7.0", "v1.7.0 is not supported"),
        ("Firecracker v2.0.0", "v2.0.0 is not supported"),
        ("something else", "printed no version"),
    ],
)
def test_firecracker_binary_of_an_unsupported_version_is_refused(
    tmp_path: Path, printed: str, problem: str | None
) -> None:
    binary = _fake_firecracker(tmp_path, printed)
    assert (binary_version_problem(str(binary)) is None) == (problem is None)
    settings = Settings(data_dir=tmp_path, firecracker=FirecrackerSettings(firecracker_path=str(binary)))
    reason = firecracker_unusable_reason(settings)
    if problem is not None:
        assert reason is not None and problem in reason
    else:
        assert reason is None or "not supported" not in reason
