"""Gateway -> node authentication (cluster mode, docs/CLUSTER.md "Auth between roles").

Every request a gateway sends a node carries ``X-Forkyard-Node-Signature: t=<unix>,s=<hex>``, the
HMAC-SHA256 under a shared secret (``FORKYARD_NODE_SECRETS``; the first signs, any verifies, so a
secret is rotated by listing the new one first, then dropping the old one) of::

    f"{t}\\n{METHOD}\\n{path?query}\\n{sha256(body) hex}"

and ``X-Forkyard-Gateway: <gateway id>``. Streamed bodies (envd traffic through the node's proxy
and template build context uploads) are not read ahead by the gateway: their body hash is
:data:`UNSIGNED_PAYLOAD`, which a node accepts for exactly those requests. A node in the node
role answers anything unsigned, badly signed or older than :data:`MAX_SKEW_SECONDS` with 401 in
E2B's shape; only ``/health`` (no information, for load balancers' and orchestrators' probes)
answers unsigned. A valid signature stands in for the API key: the gateway checked the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Sequence

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forkyard.api.limits import STREAMED_PATHS
from forkyard.api.relay import find_target
from forkyard.config import Settings
from forkyard.errors import Unauthenticated

SIGNATURE_HEADER = "x-forkyard-node-signature"
GATEWAY_HEADER = "x-forkyard-gateway"
#: The body hash of a request whose body the gateway streams instead of reading it first.
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
MAX_SKEW_SECONDS = 60.0
#: Set in the ASGI scope's ``state`` once a request's signature checked out.
SIGNED_BY = "forkyard_gateway"
_HEADER_RE = re.compile(r"^t=(?P<t>[0-9]{1,12}),s=(?P<s>[0-9a-f]{64})$")
_UNSIGNED_PATHS = frozenset({"/health"})


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(secret: str, timestamp: int, method: str, target: str, digest: str) -> str:
    message = f"{timestamp}\n{method.upper()}\n{target}\n{digest}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, method: str, target: str, digest: str, now: float | None = None) -> str:
    """The signature header's value for a request (``target``: path and ``?query`` as sent)."""
    timestamp = int(time.time() if now is None else now)
    return f"t={timestamp},s={_mac(secret, timestamp, method, target, digest)}"


def signed_headers(
    secrets: Sequence[str], gateway_id: str, method: str, target: str, digest: str
) -> dict[str, str]:
    return {SIGNATURE_HEADER: sign(secrets[0], method, target, digest), GATEWAY_HEADER: gateway_id}


def verify(
    secrets: Sequence[str],
    header: str | None,
    method: str,
    target: str,
    digest: str,
    now: float | None = None,
) -> None:
    """Raise :class:`Unauthenticated` (saying why) unless ``header`` signs this request under one
    of ``secrets`` within :data:`MAX_SKEW_SECONDS` of ``now``."""
    if not header:
        raise Unauthenticated("this is a cluster node: it answers only requests signed by a gateway")
    m = _HEADER_RE.match(header.strip())
    if m is None:
        raise Unauthenticated(f"malformed {SIGNATURE_HEADER} header")
    timestamp = int(m.group("t"))
    if abs((time.time() if now is None else now) - timestamp) > MAX_SKEW_SECONDS:
        raise Unauthenticated(f"stale gateway signature (more than {MAX_SKEW_SECONDS:.0f} s of clock skew)")
    presented = m.group("s")
    # Every secret is compared (constant time each): timing says nothing about which one matched.
    matches = [hmac.compare_digest(presented, _mac(s, timestamp, method, target, digest)) for s in secrets]
    if not any(matches):
        raise Unauthenticated("invalid gateway signature")


def request_target(scope: Scope) -> str:
    """Path and query exactly as the client sent them (what the gateway signed)."""
    raw = scope.get("raw_path") or scope.get("path", "/").encode()
    path = raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)
    query = scope.get("query_string", b"").decode("latin-1")
    return path + (f"?{query}" if query else "")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            text: str = value.decode("latin-1")
            return text
    return None


async def _unauthorized(send: Send, message: str) -> None:
    data = json.dumps({"code": 401, "message": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send(
        {"type": "http.response.start", "status": 401, "headers": [*headers, (b"should-retry", b"false")]}
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


class NodeAuth:
    """ASGI middleware of the node role, outermost (in front of the sandbox proxy too)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.secrets = list(settings.node_secrets)
        self.domains = (settings.domain, settings.sandbox_domain)

    def _probe(self, scope: Scope) -> bool:
        """The node's own ``/health`` (envd's, through the proxy, needs the signature)."""
        return scope.get("path") in _UNSIGNED_PATHS and find_target(scope, self.domains) is None

    def _streamed(self, scope: Scope) -> bool:
        """Requests whose body the gateway streams (signed with :data:`UNSIGNED_PAYLOAD`)."""
        return (
            scope["type"] == "websocket"
            or find_target(scope, self.domains) is not None
            or bool(STREAMED_PATHS.match(scope.get("path", "")))
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._probe(scope):
            await self.app(scope, receive, send)
            return
        header = _header(scope, SIGNATURE_HEADER.encode())
        method = scope.get("method", "GET")
        target = request_target(scope)
        if self._streamed(scope):
            problem = self._check(header, method, target, UNSIGNED_PAYLOAD)
        else:
            body, receive = await _buffer(receive)
            problem = self._check(header, method, target, body_hash(body))
        if problem is not None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": problem[:120]})
            else:
                await _unauthorized(send, problem)
            return
        scope.setdefault("state", {})[SIGNED_BY] = _header(scope, GATEWAY_HEADER.encode()) or "gateway"
        await self.app(scope, receive, send)

    def _check(self, header: str | None, method: str, target: str, digest: str) -> str | None:
        try:
            verify(self.secrets, header, method, target, digest)
        except Unauthenticated as exc:
            return exc.message
        return None


async def _buffer(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body (control-plane bodies are small: the body limit behind caps them)
    and a ``receive`` that hands it on once, then passes through (to see a disconnect)."""
    chunks: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    body = b"".join(chunks)
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


async def require_gateway_signature(request: Request) -> None:
    """Stands in for ``require_api_key`` in the node role (``app.dependency_overrides``)."""
    if not request.scope.get("state", {}).get(SIGNED_BY):
        raise Unauthenticated("this is a cluster node: it answers only requests signed by a gateway")
