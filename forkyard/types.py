"""The types every layer passes around, and the host/envd contract constants.

This module imports nothing of the project (the way Firecracker keeps ``vmm_config`` apart from
the VMM and its API): storage, runtimes, the orchestrator and the API all build on it, and the
envd bundle ships it beside ``forkyard.envd``.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

#: Port envd listens on inside every sandbox (E2B's).
ENVD_PORT = 49983
#: The envd version we report; the SDK gates features on it (e2b/envd/versions.py).
ENVD_VERSION = "0.6.4"
#: Environment variable a runtime may hand envd its access token in (instead of ``POST /init``).
ENVD_ACCESS_TOKEN_ENV = "FORKYARD_ENVD_ACCESS_TOKEN"
#: Set to 1, envd does file operations with the rights of the request's user (ours, docs/HARDENING.md);
#: unset, as root with what is created given to the user (E2B's envd).
ENVD_FILES_AS_USER_ENV = "FORKYARD_ENVD_FILES_AS_USER"
#: The template's final WORKDIR, handed to envd by the runtime: its default directory for commands.
ENVD_DEFAULT_WORKDIR_ENV = "FORKYARD_ENVD_DEFAULT_WORKDIR"
#: The account E2B templates create; envd's default user when a template has it.
SANDBOX_USER = "user"
#: envd's ``/init`` field (ours, not E2B's): ``false`` when the sandbox has run on, watched, since
#: its previous ``/init`` (a warm-pool sandbox initialised after its restore, now claimed; a frozen
#: one thawed), so envd keeps its captured logins without new watches and stat signatures.
#: Absent: revalidate, as after any restore.
ENVD_INIT_REVALIDATE = "forkyardRevalidate"
#: PATH of envd and of the processes it starts when nothing else sets one.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

RuntimeName = Literal["gvisor", "qemu", "firecracker"]
RUNTIME_NAMES: tuple[RuntimeName, ...] = ("gvisor", "qemu", "firecracker")


class SandboxState(enum.StrEnum):
    """Where a sandbox is in its lifecycle (the orchestrator's state machine, docs/ARCHITECTURE.md).

    ``creating``, ``pausing``, ``resuming`` and ``killing`` are transient: only crash recovery
    finds a record in them. The API shows ``running`` and ``paused``."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    KILLING = "killing"
    KILLED = "killed"


# The groups of states, named once (the registry, the lifecycle, the gateway and the node role
# ask these questions of records).
_S = SandboxState
#: A record in these still owns host resources a paused one does not (a process, or one being
#: made or freed): start-up recovery re-attaches or cleans them up.
LIVE_STATES: tuple[SandboxState, ...] = (_S.CREATING, _S.RUNNING, _S.PAUSING, _S.RESUMING, _S.KILLING)
#: Everything not killed: what a node holds, and what a lost node's loss kills.
HELD_STATES: tuple[SandboxState, ...] = (*LIVE_STATES, _S.PAUSED)
#: What the API lists and shows (E2B's ``running`` and ``paused``).
LISTED_STATES: tuple[SandboxState, ...] = (_S.RUNNING, _S.PAUSED)
#: What an SDK can still reach (any other state answers 404).
REACHABLE_STATES: tuple[SandboxState, ...] = (_S.RUNNING, _S.PAUSED, _S.PAUSING, _S.RESUMING, _S.CREATING)
#: Counted against a node's ``max_sandboxes`` and slots: running or on the way there (a paused
#: sandbox keeps its place without holding a slot).
ADMITTED_STATES: tuple[SandboxState, ...] = (_S.CREATING, _S.RUNNING, _S.RESUMING)
#: What start-up recovery keeps of the runtimes' resources (a paused sandbox's disk, a pausing
#: one's checkpoint under way).
KEPT_BY_RECOVERY: tuple[SandboxState, ...] = (_S.RUNNING, _S.PAUSED, _S.PAUSING)


@dataclass(frozen=True)
class TemplateImage:
    """What a runtime needs of a template: its read-only root file system and limits."""

    template_id: str
    #: Read-only base root file system directory (shared by every sandbox of the template).
    rootfs: Path
    vcpus: int = 2
    memory_mb: int = 512
    disk_mb: int = 4096
    #: Per-template runtime override, or None for the node default.
    runtime: RuntimeName | None = None
    #: The build's final WORKDIR: where commands start by default (None: the user's home).
    workdir: str | None = None


@dataclass(frozen=True)
class EgressPolicy:
    """A sandbox's outbound rules beyond its defaults (E2B's ``network.allowOut``/``denyOut``):
    normalised IPv4 networks (``a.b.c.d/n``). ``allow_out`` beats ``deny_out``, the defaults
    (private ranges denied) and a closed internet; nothing opens the host or other sandboxes."""

    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    #: Domain rules of ``allowOut`` (``example.com``, ``*.example.com``, ``*``), lowercase:
    #: matched on TLS SNI (port 443) and HTTP Host (port 80) by the node's egress proxy.
    allow_domains: tuple[str, ...] = ()
    #: Resolvers the sandbox may query (port 53) because ``allow_domains`` needs names resolved.
    resolvers: tuple[str, ...] = ()


@dataclass(frozen=True)
class VolumeMount:
    """A volume (a directory of this node, E2B's ``Volume``) bound into a sandbox at ``path``."""

    name: str
    volume_id: str
    #: The volume's directory on the host.
    source: str
    #: Where the sandbox sees it (absolute, normalised).
    path: str

    def to_state(self) -> dict[str, str]:
        return {"name": self.name, "volume_id": self.volume_id, "source": self.source, "path": self.path}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> VolumeMount:
        return cls(
            name=str(state["name"]),
            volume_id=str(state["volume_id"]),
            source=str(state["source"]),
            path=str(state["path"]),
        )


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    template: TemplateImage
    #: Environment variables for every process envd starts (merged under per-process envs).
    envs: dict[str, str] = field(default_factory=dict)
    allow_internet_access: bool = True
    #: Outbound rules beyond the defaults (None: the defaults only).
    egress: EgressPolicy | None = None
    #: Token envd requires in ``X-Access-Token`` (None: no token, the E2B default for non-secure sandboxes).
    envd_access_token: str | None = None
    #: Made ahead of demand (a warm-pool sandbox, a standby): it runs at a low CPU weight until
    #: ``Runtime.claimed``, so making one never takes CPU from sandboxes in use.
    ahead_of_demand: bool = False
    #: Volumes bound into the sandbox (``volumeMounts``); a restore keeps its checkpoint's instead.
    volumes: tuple[VolumeMount, ...] = ()


#: The keys of :attr:`SandboxInstance.state` every runtime writes (read through its properties).
TEMPLATE_ROOTFS_KEY = "template_rootfs"
NETWORK_KEY = "network"
#: Written by the runtimes that mount volumes (a list of :meth:`VolumeMount.to_state`).
VOLUMES_KEY = "volumes"


@dataclass
class SandboxInstance:
    """A live sandbox as the runtime left it. ``state`` is runtime-private and JSON-serialisable:
    the orchestrator persists it so that a restarted server can re-attach or clean up."""

    sandbox_id: str
    runtime: str
    #: Base URL at which the host reaches the sandbox's envd, e.g. ``http://10.213.0.2:49983``.
    envd_url: str
    #: Address of the sandbox on its private link; ports other than envd's are reached here too.
    address: str
    state: dict[str, Any] = field(default_factory=dict)

    # The facts every runtime records in its state that the layers above need: read through
    # these, never the runtime's dict (its keys are the runtime's own business).

    @property
    def template_rootfs(self) -> str | None:
        """The template root the sandbox's disk stands on (snapshots record it; a filesystem-only
        resume and a rollback check it)."""
        value = self.state.get(TEMPLATE_ROOTFS_KEY)
        return str(value) if value else None

    @property
    def network_state(self) -> dict[str, Any] | None:
        """The runtime's record of the sandbox's network link (``runtime.network.SandboxNetwork``
        state), None where it keeps none."""
        value = self.state.get(NETWORK_KEY)
        return value if isinstance(value, dict) and value else None

    @property
    def volume_mounts(self) -> tuple[VolumeMount, ...]:
        """The volumes bound into the sandbox (kept across pause, resume and forks)."""
        value = self.state.get(VOLUMES_KEY)
        return tuple(VolumeMount.from_state(v) for v in value) if isinstance(value, list) else ()

    @classmethod
    def placeholder(cls, sandbox_id: str, runtime: str) -> SandboxInstance:
        """What a kill is handed for a sandbox whose runtime never reported an instance (a create
        that failed half-way): runtimes find its leftovers by the sandbox id."""
        return cls(sandbox_id=sandbox_id, runtime=runtime, envd_url="", address="", state={})


@dataclass(frozen=True)
class SandboxMetrics:
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int


@dataclass(frozen=True)
class SnapshotRef:
    """A snapshot on local disk: ``path`` holds the memory image and the disk layer.

    ``parent`` is the snapshot this one is incremental to (None for a full snapshot)."""

    snapshot_id: str
    path: Path
    parent: SnapshotRef | None = None


#: Lists the committed snapshots of a runtime (see ``Runtime.collect_garbage``).
LiveSnapshots = Callable[[], Awaitable[list[SnapshotRef]]]
