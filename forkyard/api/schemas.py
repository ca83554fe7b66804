"""Request and response bodies of the control plane, field for field as in E2B's openapi.yml.

Requests are validated strictly (a string where an integer belongs is a 400, as with E2B's Go
server); responses are serialised by alias (``sandboxID``, ``envdVersion``, ...).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

#: E2B caps a sandbox's life at 24 hours.
MAX_TIMEOUT_SECONDS = 86_400
INT32_MAX = 2**31 - 1
#: Sandbox metadata limits (ours). E2B's API states none for sandbox metadata: it is bounded
#: only by its 16 MiB request limit (api/limits.py) and gRPC's default 4 MiB message on the way
#: to its orchestrator (a failure there, not a 400). 64 KiB keeps every listing and record small
#: while leaving room for what SDK users keep there (ids, tags, small JSON).
MAX_METADATA_KEY_BYTES = 256
MAX_METADATA_BYTES = 64 * 1024


def _bounded_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if not metadata:
        return metadata
    total = 0
    for key, value in metadata.items():
        key_bytes = len(key.encode())
        if key_bytes > MAX_METADATA_KEY_BYTES:
            raise ValueError(f"metadata key {key[:32]!r}... is longer than {MAX_METADATA_KEY_BYTES} bytes")
        total += key_bytes + len(value.encode())
    if total > MAX_METADATA_BYTES:
        raise ValueError(f"metadata of {total} bytes exceeds the limit of {MAX_METADATA_BYTES} bytes")
    return metadata


Metadata = Annotated[dict[str, str] | None, AfterValidator(_bounded_metadata)]


class _Request(BaseModel):
    # Unknown fields are ignored (newer SDKs send more than we know), wrong types are not.
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class _Response(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=False)


class NetworkEgress(_Request):
    """The egress fields create and update share. Entries are checked by
    ``forkyard.runtime.egress_policy.parse_egress``; the fields this node cannot honour are refused
    by the routes rather than ignored."""

    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    #: The resolvers (port 53) a sandbox whose ``allowOut`` names domains may query.
    dns_servers: list[str] | None = Field(None, alias="dnsServers", max_length=10)
    rules: dict[str, Any] | None = None
    egress_proxy: dict[str, Any] | None = Field(None, alias="egressProxy")


class SandboxNetworkConfig(NetworkEgress):
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    mask_request_host: str | None = Field(None, alias="maskRequestHost", max_length=253)
    https_ports: list[int] | None = Field(None, alias="httpsPorts")


class SandboxNetworkUpdateConfig(NetworkEgress):
    allow_internet_access: bool | None = None


class SandboxAutoResumeConfig(_Request):
    enabled: bool = False


class VolumeMount(_Request):
    name: str
    path: str


class NewSandbox(_Request):
    template_id: str = Field(alias="templateID", min_length=1, max_length=128)
    #: Omitted: ``settings.default_timeout_seconds`` (the SDKs document 300 s and send nothing).
    timeout: int | None = Field(None, ge=0, le=INT32_MAX)
    auto_pause: bool = Field(False, alias="autoPause")
    auto_pause_memory: bool = Field(True, alias="autoPauseMemory")
    auto_resume: SandboxAutoResumeConfig | None = Field(None, alias="autoResume")
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: SandboxNetworkConfig | None = None
    metadata: Metadata = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    mcp: dict[str, Any] | None = None
    volume_mounts: list[VolumeMount] | None = Field(None, alias="volumeMounts")


class SandboxTimeoutRequest(_Request):
    timeout: int = Field(ge=0, le=INT32_MAX)


class SandboxRefreshRequest(_Request):
    duration: int | None = Field(None, ge=0, le=3600)


class ConnectSandbox(_Request):
    timeout: int | None = Field(None, ge=0, le=INT32_MAX)
    memory: bool | None = None


class Sandbox(_Response):
    template_id: str = Field(serialization_alias="templateID")
    sandbox_id: str = Field(serialization_alias="sandboxID")
    alias: str | None = None
    client_id: str = Field(serialization_alias="clientID")
    envd_version: str = Field(serialization_alias="envdVersion")
    envd_access_token: str | None = Field(default=None, serialization_alias="envdAccessToken")
    traffic_access_token: str | None = Field(default=None, serialization_alias="trafficAccessToken")
    domain: str | None = None


class SandboxLifecycle(_Response):
    auto_resume: bool = Field(serialization_alias="autoResume")
    on_timeout: Literal["kill", "pause"] = Field(serialization_alias="onTimeout")


class NetworkInfo(_Response):
    allow_public_traffic: bool = Field(default=True, serialization_alias="allowPublicTraffic")
    allow_out: list[str] = Field(default_factory=list, serialization_alias="allowOut")
    deny_out: list[str] = Field(default_factory=list, serialization_alias="denyOut")
    #: Left out of the answer when unset (the SDKs read a missing key as "not set").
    mask_request_host: str | None = Field(default=None, serialization_alias="maskRequestHost")
    dns_servers: list[str] | None = Field(default=None, serialization_alias="dnsServers")


class ListedSandbox(_Response):
    template_id: str = Field(serialization_alias="templateID")
    alias: str | None = None
    sandbox_id: str = Field(serialization_alias="sandboxID")
    client_id: str = Field(serialization_alias="clientID")
    started_at: dt.datetime = Field(serialization_alias="startedAt")
    end_at: dt.datetime = Field(serialization_alias="endAt")
    cpu_count: int = Field(serialization_alias="cpuCount")
    memory_mb: int = Field(serialization_alias="memoryMB")
    disk_size_mb: int = Field(serialization_alias="diskSizeMB")
    metadata: dict[str, str] = Field(default_factory=dict)
    state: Literal["running", "paused"]
    envd_version: str = Field(serialization_alias="envdVersion")
    volume_mounts: list[dict[str, str]] = Field(default_factory=list, serialization_alias="volumeMounts")


class SandboxDetail(ListedSandbox):
    envd_access_token: str | None = Field(default=None, serialization_alias="envdAccessToken")
    allow_internet_access: bool | None = Field(default=None, serialization_alias="allowInternetAccess")
    domain: str | None = None
    network: NetworkInfo | None = None
    lifecycle: SandboxLifecycle | None = None


class SandboxMetric(_Response):
    timestamp: dt.datetime
    timestamp_unix: int = Field(serialization_alias="timestampUnix")
    cpu_count: int = Field(serialization_alias="cpuCount")
    cpu_used_pct: float = Field(serialization_alias="cpuUsedPct")
    mem_used: int = Field(serialization_alias="memUsed")
    mem_total: int = Field(serialization_alias="memTotal")
    mem_cache: int = Field(default=0, serialization_alias="memCache")
    disk_used: int = Field(serialization_alias="diskUsed")
    disk_total: int = Field(serialization_alias="diskTotal")


class SandboxLog(_Response):
    timestamp: dt.datetime
    line: str


class SandboxLogEntry(_Response):
    timestamp: dt.datetime
    message: str
    level: Literal["debug", "info", "warn", "error"]
    fields: dict[str, str] = Field(default_factory=dict)


class Template(_Response):
    template_id: str = Field(serialization_alias="templateID")
    build_id: str = Field(serialization_alias="buildID")
    cpu_count: int = Field(serialization_alias="cpuCount")
    memory_mb: int = Field(serialization_alias="memoryMB")
    disk_size_mb: int = Field(serialization_alias="diskSizeMB")
    public: bool = True
    aliases: list[str]
    names: list[str]
    created_at: dt.datetime = Field(serialization_alias="createdAt")
    updated_at: dt.datetime = Field(serialization_alias="updatedAt")
    created_by: None = Field(default=None, serialization_alias="createdBy")
    last_spawned_at: dt.datetime | None = Field(default=None, serialization_alias="lastSpawnedAt")
    spawn_count: int = Field(default=0, serialization_alias="spawnCount")
    build_count: int = Field(default=1, serialization_alias="buildCount")
    envd_version: str = Field(serialization_alias="envdVersion")
    build_status: Literal["building", "waiting", "ready", "error"] = Field(
        default="ready", serialization_alias="buildStatus"
    )


# -- template builds (E2B's build API) ----------------------------------------------------------


class TemplateBuildRequestV3(_Request):
    name: str | None = Field(default=None, max_length=128)
    alias: str | None = Field(default=None, max_length=128)
    tags: list[str] = Field(default_factory=list)
    cpu_count: int | None = Field(default=None, alias="cpuCount")
    memory_mb: int | None = Field(default=None, alias="memoryMB")


class TemplateStep(_Request):
    type: str
    args: list[str] = Field(default_factory=list)
    files_hash: str | None = Field(default=None, alias="filesHash")
    force: bool = False


class FromImageRegistry(_Request):
    """``GeneralRegistry`` / ``AWSRegistry`` / ``GCPRegistry`` (one shape, by ``type``)."""

    type: str
    username: str | None = None
    password: str | None = None
    aws_access_key_id: str | None = Field(default=None, alias="awsAccessKeyId")
    aws_secret_access_key: str | None = Field(default=None, alias="awsSecretAccessKey")
    aws_region: str | None = Field(default=None, alias="awsRegion")
    service_account_json: str | None = Field(default=None, alias="serviceAccountJson")


class TemplateBuildStartV2(_Request):
    from_image: str | None = Field(default=None, alias="fromImage")
    from_template: str | None = Field(default=None, alias="fromTemplate")
    from_image_registry: FromImageRegistry | None = Field(default=None, alias="fromImageRegistry")
    force: bool = False
    steps: list[TemplateStep] = Field(default_factory=list)
    start_cmd: str | None = Field(default=None, alias="startCmd")
    ready_cmd: str | None = Field(default=None, alias="readyCmd")


class AssignTemplateTagsRequest(_Request):
    target: str
    tags: list[str]


class DeleteTemplateTagsRequest(_Request):
    name: str
    tags: list[str]
