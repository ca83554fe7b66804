"""The types every layer passes around, and the host/envd contract constants.

This module imports nothing of the project (the way Firecracker keeps ``vmm_config`` apart from
the VMM and its API): storage, runtimes, the orchestrator and the API all build on it, and the
envd bundle ships it beside ``forkyard.envd``.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
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
#: Set to a path, envd keeps the sandbox's environment variables (``POST /init``'s) in that file
#: (JSON, rewritten when they change): the code interpreter's server checks it per cell with a
#: ``stat`` instead of asking envd's ``/envs`` (forkyard/interpreter/contexts.py).
ENVD_ENVS_FILE_ENV = "FORKYARD_ENVD_ENVS_FILE"
#: Where the gVisor runtime has envd keep them (the interpreter's ``ENVS_FILE``).
SANDBOX_ENVS_FILE = "/run/forkyard/envs.json"
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


# The groups of states, named once (the sandbox store, the lifecycle, the gateway and the node role
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
    def from_state(cls, saved: Mapping[str, Any]) -> VolumeMount:
        return cls(
            name=str(saved["name"]),
            volume_id=str(saved["volume_id"]),
            source=str(saved["source"]),
            path=str(saved["path"]),
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


#: Where the sandboxes' network namespaces are (``ip netns``'s directory).
NETNS_DIR = Path("/var/run/netns")


@dataclass(frozen=True)
class SandboxNetwork:
    """A sandbox's private link: its network namespace, the veth pair and the /30 of its slot
    (made and torn down by ``runtime.network``). Every runtime's sandboxes have one; it is a
    fact of the instance (:attr:`SandboxInstance.network`), not of one runtime."""

    sandbox_id: str
    netns: str
    slot: int
    host_if: str
    sandbox_if: str
    host_ip: str
    sandbox_ip: str
    prefixlen: int = 30
    allow_internet_access: bool = True

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SandboxNetwork:
        return cls(**state)


@dataclass
class SandboxInstance:
    """A live sandbox as the runtime left it; the orchestrator persists it (:meth:`to_json`) so
    that a restarted server can re-attach or clean up.

    The facts the layers above need are typed fields. ``state`` is the runtime's own record,
    JSON, opaque to everything else: only the runtime named by ``runtime`` reads it, through its
    own state class (``GvisorState``, ``FirecrackerState``, ``QemuState``)."""

    sandbox_id: str
    runtime: str
    #: Base URL at which the host reaches the sandbox's envd, e.g. ``http://10.213.0.2:49983``.
    envd_url: str
    #: Address of the sandbox on its private link; ports other than envd's are reached here too.
    address: str
    #: The runtime's private record (see the class docstring).
    state: dict[str, Any] = field(default_factory=dict)
    #: The template root the sandbox's disk stands on (snapshots record it; a filesystem-only
    #: resume and a rollback check it).
    template_rootfs: str | None = None
    #: The sandbox's network link; None while it has none (a paused-to-disk sandbox gave its
    #: slot back, a placeholder never had one).
    network: SandboxNetwork | None = None
    #: The volumes bound into the sandbox (kept across pause, resume and forks: every restore
    #: binds them again).
    volume_mounts: tuple[VolumeMount, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SandboxInstance:
        """An instance as :meth:`to_json` wrote it, or as nodes before the typed fields did: those
        kept ``template_rootfs`` and ``network`` inside the runtime's ``state`` (recovery reads
        such rows back after an upgrade)."""
        state = dict(data.get("state") or {})
        rootfs = data.get("template_rootfs", state.get(_OLD_TEMPLATE_ROOTFS_KEY))
        net = data.get("network", state.get(_OLD_NETWORK_KEY))
        return cls(
            sandbox_id=data["sandbox_id"],
            runtime=data["runtime"],
            envd_url=data["envd_url"],
            address=data["address"],
            state=state,
            template_rootfs=str(rootfs) if rootfs else None,
            network=SandboxNetwork.from_state(net) if isinstance(net, Mapping) and net else None,
            volume_mounts=tuple(VolumeMount.from_state(v) for v in data.get("volume_mounts") or ()),
        )

    @classmethod
    def placeholder(cls, sandbox_id: str, runtime: str) -> SandboxInstance:
        """What a kill is handed for a sandbox whose runtime never reported an instance (a create
        that failed half-way): runtimes find its leftovers by the sandbox id."""
        return cls(sandbox_id=sandbox_id, runtime=runtime, envd_url="", address="", state={})


#: Where instances written before the typed fields kept them (inside ``state``).
_OLD_TEMPLATE_ROOTFS_KEY = "template_rootfs"
_OLD_NETWORK_KEY = "network"


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
