"""What the gVisor runtime records of a sandbox (``SandboxInstance.state``, persisted by the
orchestrator as opaque JSON): read back on crash recovery, metrics and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from forkyard.runtime.state import RuntimeState

#: A sandbox's disk when its instance predates recording one (the templates' default).
DEFAULT_DISK_MB = 4096


@dataclass
class GvisorState(RuntimeState):
    #: The runsc container id (``paths.SandboxPaths.container_id``).
    container_id: str = ""
    #: The envd bundle mounted at ``/.forkyard`` (a stale-bundle sweep keeps the ones in use).
    envd_bundle: str = ""
    template_id: str = ""
    vcpus: int = 1
    memory_mb: int = 512
    disk_mb: int = DEFAULT_DISK_MB
    #: runsc's platform the sandbox runs on (``ptrace``, ``systrap``); snapshots record it.
    platform: str | None = None
    #: /usr/bin/sudo is mounted over by envd's (a restore needs the mounts its checkpoint had).
    sudo_shim: bool = False
