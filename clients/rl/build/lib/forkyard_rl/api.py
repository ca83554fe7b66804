"""Connection settings and our API extension the SDK has no call for: rollback in place.

``POST /sandboxes/{sandboxID}/rollback`` with ``{"snapshotID": ...}`` (README, "API
extensions") is sent with httpx, using the connection the SDK resolved for the sandbox (API URL,
API key, request timeout), so whatever configured the SDK configures this too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from e2b import AsyncSandbox, ConnectionConfig, Sandbox

#: Seconds a rollback may take when the SDK's connection sets no request timeout: it is a kill
#: and a restore, seconds on a loaded node.
ROLLBACK_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True)
class Connection:
    """Explicit connection settings for the SDK calls this module makes; ``None`` fields are
    left to the SDK (``E2B_API_KEY``, ``E2B_API_URL``, ``E2B_SANDBOX_URL``, its defaults)."""

    api_key: str | None = None
    api_url: str | None = None
    sandbox_url: str | None = None
    request_timeout: float | None = None

    def opts(self) -> dict[str, Any]:
        """Keyword arguments for the SDK's class methods (``AsyncSandbox.create(**opts)``)."""
        fields = {
            "api_key": self.api_key,
            "api_url": self.api_url,
            "sandbox_url": self.sandbox_url,
            "request_timeout": self.request_timeout,
        }
        return {k: v for k, v in fields.items() if v is not None}


class RollbackError(Exception):
    """The server refused or failed a rollback; ``code`` and ``message`` are its answer."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def rollback_request(config: ConnectionConfig, sandbox_id: str, snapshot_id: str) -> dict[str, Any]:
    """The pieces of the request, for the async and the sync client alike."""
    timeout = config.request_timeout or ROLLBACK_TIMEOUT_SECONDS
    return {
        "url": f"{config.api_url.rstrip('/')}/sandboxes/{sandbox_id}/rollback",
        "json": {"snapshotID": snapshot_id},
        "headers": {**config.headers, "X-API-Key": config.api_key or ""},
        "timeout": max(timeout, ROLLBACK_TIMEOUT_SECONDS),
    }


def check_rollback(response: httpx.Response) -> None:
    if response.status_code < 300:
        return
    try:
        message = str(response.json().get("message", response.text))
    except ValueError:
        message = response.text
    raise RollbackError(response.status_code, message)


async def rollback(sandbox: AsyncSandbox, snapshot_id: str) -> None:
    """Put ``sandbox`` back to ``snapshot_id`` in place: files, processes and memory are the
    snapshot's, the id, timeout and metadata stay, and the ``sandbox`` object keeps working."""
    req = rollback_request(sandbox.connection_config, sandbox.sandbox_id, snapshot_id)
    timeout = req.pop("timeout")
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        check_rollback(await client.post(**req))


def rollback_sync(sandbox: Sandbox, snapshot_id: str) -> None:
    """:func:`rollback` for the SDK's synchronous ``Sandbox``."""
    req = rollback_request(sandbox.connection_config, sandbox.sandbox_id, snapshot_id)
    timeout = req.pop("timeout")
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        check_rollback(client.post(**req))
