"""Process-wide settings, read from ``FORKYARD_*`` environment variables.

Every value has a zero-configuration default so that a single node works out of the box. Each
runtime's own settings are nested under its name (``FORKYARD_GVISOR__PLATFORM=systrap``); the
settings object is built once (the CLI, tests) and handed to whatever needs it: nothing below
reads the environment on its own.

Imports nothing of the project.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

RuntimeChoice = Literal["auto", "gvisor", "qemu", "firecracker"]
RunscPlatform = Literal["auto", "ptrace", "systrap", "kvm"]


class GvisorSettings(BaseModel):
    runsc_path: str = "runsc"
    #: ``auto`` measures which platform starts a sandbox here (kvm only with vmx/svm).
    platform: RunscPlatform = "auto"


class QemuSettings(BaseModel):
    qemu_path: str = "qemu-system-x86_64"
    #: ``auto``: KVM when /dev/kvm can boot guests, else TCG.
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    #: Guest RAM: ``file`` maps a file in the reflink pool (a snapshot reflinks it and saves only
    #: device state; a restore maps a reflink clone); ``stream``: anonymous RAM migrated to and
    #: from a file (the earlier path, kept selectable for the bench).
    memory: Literal["file", "stream"] = "file"
    #: QEMU processes kept started (``-incoming defer``) per VM shape, waiting for a restore.
    prespawn: int = 2


class FirecrackerSettings(BaseModel):
    firecracker_path: str = "firecracker"
    #: Run guests under PVM (KVM without vmx/svm): needs a PVM-enabled host kernel,
    #: a PVM build of firecracker and a PVM guest kernel (docs/KVM.md).
    pvm: bool = False
    pvm_binary: str = "firecracker-pvm"
    #: Guest kernel for PVM mode (an uncompressed vmlinux built with CONFIG_PVM_GUEST).
    pvm_kernel: Path | None = None
    #: Guest kernel for ordinary KVM mode; None: the one `forkyard image build` produced.
    kernel: Path | None = None
    #: Serve guest memory of restored snapshots through userfaultfd instead of a private file mapping.
    uffd: bool = False
    #: Seconds to wait for the API socket and for envd after InstanceStart.
    boot_timeout: float = 30.0
    #: A freeze (the first pause tier) first inflates the balloon over the guest's available memory
    #: but this much (MiB), so a frozen microVM gives its free and cache pages back to the host;
    #: the thaw deflates it. 0 or less: frozen microVMs keep their memory.
    freeze_balloon_keep_mib: int = 48
    #: Seconds a freeze waits for the guest to inflate the balloon (it freezes with what it got):
    #: under KVM a guest gives hundreds of MiB in well under a second; the pause waits this long
    #: at most.
    freeze_balloon_seconds: float = 2.0

    @property
    def binary(self) -> str:
        return self.pvm_binary if self.pvm else self.firecracker_path


class S3Settings(BaseModel):
    """The snapshot and template store (``FORKYARD_S3__*``). Neither ``bucket`` nor ``directory``
    set (the default): snapshots live on this node's disk only, durable once committed there."""

    #: Bucket on any S3-compatible service; with ``endpoint_url`` for anything but AWS.
    bucket: str = ""
    endpoint_url: str | None = None
    region: str = "us-east-1"
    #: Credentials; None: boto3's own chain (environment, ~/.aws, instance role).
    access_key_id: str | None = None
    secret_access_key: str | None = None
    #: Key prefix inside the bucket (several clusters may share one).
    prefix: str = "forkyard/"
    #: Instead of a bucket: a directory with the same layout (a distributed file system mount).
    directory: Path | None = None
    #: Cap on this node's copies of durable snapshots (memory images and disk layers), LRU
    #: evicted past it; what a running or paused sandbox stands on is never evicted. 0: no cap.
    cache_max_mib: int = 20480
    #: Size of the content-addressed chunks files and layer archives are cut into.
    chunk_mib: int = 8
    #: Chunks transferred at once (each upload or fetch holds this many in memory).
    concurrency: int = 4
    #: Also store template root file systems (once per template build) so that a node without
    #: the template can restore its snapshots.
    upload_templates: bool = True
    #: A chunk nothing names is deleted only once it is this old: an upload running elsewhere
    #: may be about to name it (uploads refresh the chunks they reuse).
    gc_grace_seconds: float = 600.0

    @property
    def enabled(self) -> bool:
        return bool(self.bucket) or self.directory is not None


class RegistryMirror(BaseModel):
    """Where template builds pull one registry's images from instead (``FORKYARD_REGISTRY_MIRRORS``,
    JSON: ``{"docker.io": {"location": "mirror.internal:5000", "username": ..., "password": ...}}``
    or ``{"docker.io": "mirror.internal:5000"}``). The registry itself is tried only after the
    mirror failed (containers' ``registries.conf`` mirrors, which skopeo reads)."""

    #: ``host[:port][/path]``: an image ``<registry>/<name>`` is pulled as ``<location>/<name>``.
    location: str
    #: Credentials of the mirror (none: anonymous pulls).
    username: str | None = None
    password: str | None = None
    #: Plain HTTP, or TLS without verifying the certificate. Mirrors on loopback always are.
    insecure: bool = False

    @model_validator(mode="before")
    @classmethod
    def _location_alone(cls, value: object) -> object:
        return {"location": value} if isinstance(value, str) else value

    @field_validator("location")
    @classmethod
    def _plain_location(cls, value: str) -> str:
        location = value.strip().removeprefix("https://").removeprefix("http://").rstrip("/")
        if not location or any(c.isspace() for c in location) or "://" in location:
            raise ValueError(f"a mirror's location is host[:port][/path], got {value!r}")
        return location

    def __repr__(self) -> str:  # a stray log of the settings shows no secret
        return f"RegistryMirror(location={self.location!r}, username={self.username!r})"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FORKYARD_", env_nested_delimiter="__")

    host: str = "127.0.0.1"
    port: int = 3000
    #: Root of all node state: templates, sandboxes, snapshots, the SQLite database.
    data_dir: Path = Path("/var/lib/forkyard")
    #: API keys accepted in ``X-API-Key``. Empty means: generate one at start-up and print it.
    api_keys: list[str] = []
    #: ``auto`` picks firecracker when KVM with vmx/svm and a binary exist, else gvisor.
    runtime: RuntimeChoice = "auto"
    gvisor: GvisorSettings = GvisorSettings()
    qemu: QemuSettings = QemuSettings()
    firecracker: FirecrackerSettings = FirecrackerSettings()
    s3: S3Settings = S3Settings()
    #: Domain used for ``{port}-{sandbox_id}.{domain}`` Host routing.
    domain: str = "localhost"
    #: Sandbox URLs over HTTPS (forkyard/api/tls.py): ``sandbox.get_host(port)`` is
    #: ``{port}-{sandbox_id}.{sandbox_domain}:{tls_port}``; two labels at least (TLS wildcards).
    sandbox_domain: str = "forkyard.localhost"
    #: Port of the HTTPS listener (on ``host``) serving sandbox URLs; 0 turns it off.
    tls_port: int = 3443
    #: ``address:port`` of the DNS responder for ``*.{sandbox_domain}`` (forkyard/api/dns.py), e.g.
    #: ``127.0.0.153:53``; empty: none (the README shows the resolver set-ups).
    dns_listen: str = ""
    #: Where the responder forwards every other name (``address[:port]``); empty: the first
    #: nameserver of /etc/resolv.conf that is not the responder itself.
    dns_upstream: str = ""
    #: ``address[:port]`` of the DNS server the egress proxy resolves domain-allowed names with
    #: (``allow_out`` domains, forkyard/runtime/egress_proxy.py); empty: the host's resolver.
    egress_resolver: str = ""
    #: Template builds' registry mirrors (forkyard/storage/images.py): registry host (``docker.io``
    #: for Docker Hub's names, ``ghcr.io``, ...) -> its mirror. Every image pull of a build tries
    #: the mirror first; air-gapped nodes pull only from their mirrors.
    registry_mirrors: dict[str, RegistryMirror] = {}
    #: Subnet sandboxes get their /30 links from (host side .1, sandbox side .2).
    sandbox_subnet: str = "10.213.0.0/16"
    default_timeout_seconds: int = 300
    #: Where built templates live (default ``{data_dir}/templates``); lets a throw-away data
    #: directory (tests) use the shared, cached templates without copying them.
    templates_path: Path | None = None
    #: envd does file operations with the rights of the request's user (ours, docs/HARDENING.md)
    #: instead of as root with what it creates given to the user (E2B's envd, the default).
    envd_files_as_user: bool = False
    #: Largest request body the envd proxy forwards (uploads); bigger ones get 413.
    max_upload_bytes: int = 1 << 30
    #: Templates are snapshots: the first create of a template also boots one sandbox of it in
    #: the background and snapshots it with envd running; later creates restore that snapshot.
    template_snapshots: bool = True
    #: Build ``code-interpreter-v1`` (E2B's code interpreter) in the background at start-up when
    #: the templates directory lacks it or has it from an older spec (`make run` turns it on;
    #: forkyard/orchestrator/code_interpreter.py).
    build_code_interpreter: bool = False
    #: Templates whose snapshot is made at start-up and kept in a warm pool of restored sandboxes.
    warm_pool_templates: list[str] = ["base"]
    #: Warm pool watermarks: a claim that leaves fewer than ``low`` ready sandboxes refills the
    #: pool up to ``high``. ``high = 0`` turns pooling off.
    warm_pool_low: int = 1
    warm_pool_high: int = 2
    #: A refill (warm pool or standbys) starts once no sandbox was claimed for this long, so a
    #: claimed sandbox's first commands do not share the cores with a restore (0: at once).
    pool_refill_quiet_ms: int = 1000
    #: Standbys: a user snapshot restored more than once keeps this many sandboxes restored from it
    #: ahead of demand (0 turns standbys off), for at most ``snapshot_standby_snapshots`` snapshots.
    snapshot_standbys: int = 2
    snapshot_standby_snapshots: int = 4
    #: A snapshot's standbys grow to the largest group of creates from it (creates arriving at
    #: once), up to this many, while the node has memory to spare (``orchestrator/standbys.py``).
    snapshot_standbys_max: int = 16
    #: Tiered pause: a pause freezes the sandbox in place (memory, network and address kept; a
    #: resume thaws it in milliseconds). False: every pause checkpoints to disk.
    pause_freeze: bool = True
    #: A sandbox frozen this long is moved to disk (checkpointed, its memory freed).
    pause_disk_after_seconds: float = 120.0
    #: While the node has less memory available than this, the longest-frozen sandboxes are
    #: moved to disk, one at a time.
    pause_min_available_mib: int = 1024
    #: The metadata key that picks a sandbox's OCI image when a create names no template (slime's
    #: convention: ``SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY``; forkyard/api/image_sandboxes.py). The
    #: image is built into a template on first use. Empty: metadata is only metadata.
    sandbox_image_metadata_key: str = "forkyard.image"
    #: The database (SQLAlchemy async URL). Empty: SQLite at ``db_path`` (single node);
    #: a cluster shares one PostgreSQL: ``postgresql+asyncpg://user@host:port/db``.
    database_url: str = ""
    #: This node's name in the database (every sandbox row carries its owner's). Empty: the host name.
    node_id: str = ""
    #: The URL gateways reach this node at (``forkyard node serve``); empty: ``http://{host}:{port}``.
    node_url: str = ""
    #: Shared HMAC secrets between gateways and nodes (forkyard/api/nodeauth.py): the first signs,
    #: any verifies (rotate by listing two). Required by ``forkyard node serve`` and ``gateway``.
    node_secrets: list[str] = []
    #: How often a node writes its capacity into the database's ``nodes`` row.
    node_heartbeat_seconds: float = 5.0
    #: A node whose heartbeat is older than this is marked lost by the gateways, its sandboxes killed.
    node_lost_after_seconds: float = 30.0
    #: Most sandboxes (creating, running, resuming) this node holds at once; a create or fork child
    #: past it answers 429 like E2B's concurrency limit. 0: no count limit (the heartbeat's
    #: ``slots_free`` is then the available memory in 512 MiB slots alone).
    max_sandboxes: int = 0
    #: Free space (MiB) the data dir must keep for a create or fork child to be admitted; below it
    #: the create answers 507 like E2B's full disk, before anything is written (a sandbox started
    #: on the last free pages would fail at its first write, and so would its snapshot). 0: no check.
    disk_reserve_mb: int = 64
    #: The role this process serves in (set by the command, not by users): ``single`` (``serve``),
    #: ``node`` (``node serve``) or ``gateway``.
    role: Literal["single", "node", "gateway"] = "single"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "forkyard.sqlite3"

    @property
    def resolved_database_url(self) -> str:
        """The database URL: ``database_url``, else the node's SQLite file."""
        return self.database_url or f"sqlite+aiosqlite:///{self.db_path}"

    @property
    def node_name(self) -> str:
        """``node_id``, else the host name."""
        return self.node_id or socket.gethostname()

    @property
    def node_address(self) -> str:
        """``node_url``, else ``http://{host}:{port}`` (what gateways reach this node at)."""
        return (self.node_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def templates_dir(self) -> Path:
        return self.templates_path or self.data_dir / "templates"

    def effective_api_keys(self) -> list[str]:
        """The configured keys, or one stable generated key stored in the data directory."""
        if self.api_keys:
            return self.api_keys
        key_file = self.data_dir / "api-key"
        if not key_file.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            key_file.write_text("e2b_" + secrets.token_hex(20) + "\n")
            key_file.chmod(0o600)
        return [key_file.read_text().strip()]
