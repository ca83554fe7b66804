"""E2B's wire format shared by both edges, the node API and the cluster gateway: the bodies of
listed sandboxes, the list query's parameters (metadata, states, the ``nextToken`` cursor) and
the ``domain`` the SDKs build sandbox URLs from."""

from __future__ import annotations

import base64
import binascii
import urllib.parse

from forkyard.api.schemas import ListedSandbox
from forkyard.config import Settings
from forkyard.errors import Invalid
from forkyard.orchestrator.store import SandboxRecord
from forkyard.types import LISTED_STATES, SandboxState

#: ``GET /v2/sandboxes``: the largest page (openapi.yml ``limit`` maximum).
LIST_LIMIT_MAX = 100


def http_domain(settings: Settings) -> str:
    """The ``domain`` returned to SDKs over plain HTTP, so ``sandbox.get_host(port)`` gives a
    reachable ``{port}-{id}.{domain}`` (with the API port when serving on localhost). The HTTPS
    listener's is :func:`forkyard.api.tls.https_domain`."""
    if settings.domain == "localhost" and settings.port not in (80, 443):
        return f"localhost:{settings.port}"
    return settings.domain


def listed_fields(rec: SandboxRecord) -> dict[str, object]:
    return {
        "template_id": rec.template_id,
        "alias": rec.alias,
        "sandbox_id": rec.sandbox_id,
        "client_id": rec.client_id,
        "started_at": rec.started_at,
        "end_at": rec.end_at,
        "cpu_count": rec.cpu_count,
        "memory_mb": rec.memory_mb,
        "disk_size_mb": rec.disk_mb,
        "metadata": rec.metadata,
        "state": "paused" if rec.state == SandboxState.PAUSED else "running",
        "envd_version": rec.envd_version,
        "volume_mounts": [{"name": m.name, "path": m.path} for m in rec.instance.volume_mounts]
        if rec.instance
        else [],
    }


def listed_body(rec: SandboxRecord) -> dict[str, object]:
    return ListedSandbox.model_validate(listed_fields(rec)).to_json()


def parse_metadata_query(raw: str | None) -> dict[str, str]:
    """The SDKs send ``metadata=urlencode({quote(k): quote(v)})``: decode both layers."""
    if not raw:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise Invalid(f"invalid metadata query {raw!r}: expected key=value pairs joined by '&'") from None
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def parse_states(raw: list[str] | None) -> tuple[SandboxState, ...]:
    if not raw:
        return LISTED_STATES
    names = tuple(s.strip() for item in raw for s in item.split(",") if s.strip())
    bad = [s for s in names if s not in LISTED_STATES]
    if bad:
        raise Invalid(f"invalid state {bad[0]!r}: expected one of {', '.join(LISTED_STATES)}")
    return tuple(SandboxState(s) for s in names) or LISTED_STATES


def encode_cursor(rec: SandboxRecord) -> str:
    raw = f"{rec.started_at.timestamp():.6f}:{rec.seq}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(token: str) -> tuple[float, int]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        ts, seq = raw.split(":")
        return float(ts), int(seq)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise Invalid("invalid nextToken") from None
