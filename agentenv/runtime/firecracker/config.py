"""Firecracker-only settings (``AGENTENV_FIRECRACKER_*``), kept beside the runtime that reads them."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class FirecrackerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENTENV_FIRECRACKER_")

    #: Run guests under PVM (KVM without vmx/svm): needs a PVM-enabled host kernel,
    #: a PVM build of firecracker and a PVM guest kernel (docs/KVM.md).
    pvm: bool = False
    pvm_binary: str = "firecracker-pvm"
    #: Guest kernel for PVM mode (an uncompressed vmlinux built with CONFIG_PVM_GUEST).
    pvm_kernel: Path | None = None
    #: Guest kernel for ordinary KVM mode; None: the one `agentenv image build` produced.
    kernel: Path | None = None
    #: Serve guest memory of restored snapshots through userfaultfd instead of a private file mapping.
    uffd: bool = False
    #: Seconds to wait for the API socket and for envd after InstanceStart.
    boot_timeout: float = 30.0
