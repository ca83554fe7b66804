"""The gateway's hops to nodes, every one signed (forkyard/api/nodeauth.py).

Control-plane calls are small JSON exchanges: read whole, signed with their body's hash and sent
through one pooled httpx client. envd traffic (commands, file transfers, Connect streams) is
relayed to the owning node's sandbox proxy with the proxy's own pooled h11 connections
(forkyard/api/proxy.py ``Upstream``), both bodies streamed chunk by chunk and signed with
:data:`~forkyard.api.nodeauth.UNSIGNED_PAYLOAD`; Host-routed requests (``{port}-{id}.{domain}``)
reach the node as header-routed ones (``E2B-Sandbox-Id``/``-Port``), since the node's domain is
not the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import h11
import httpx
from starlette.types import Receive, Scope, Send

from forkyard.api import nodeauth
from forkyard.api.limits import STREAMED_PATHS
from forkyard.api.relay import (
    HOP_BY_HOP,
    SANDBOX_NOT_FOUND,
    WEBSOCKET_FAILURES,
    ClientGone,
    Connection,
    Downstream,
    Target,
    UploadTooLarge,
    Upstream,
    UpstreamError,
    connect_websocket,
    connection_tokens,
    exchange,
    is_ascii_number,
    relay_websocket,
    response_headers,
    send_error,
)
from forkyard.gateway.placement import NodeInfo

log = logging.getLogger(__name__)

#: Control-plane calls that create or restore sandboxes take as long as the node needs.
CONTROL_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=30.0)
_ROUTING = frozenset({"e2b-sandbox-id", "e2b-sandbox-port"})
#: Request headers that stay at the gateway (the API key was checked here).
_GATEWAY_ONLY = frozenset({"x-api-key", "authorization", nodeauth.SIGNATURE_HEADER, nodeauth.GATEWAY_HEADER})


class NodeUnreachable(Exception):
    """The node did not answer (connection refused, reset, timed out)."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


def _origin(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


class NodeClient:
    """Signed control-plane calls to nodes."""

    def __init__(self, secrets: Sequence[str], gateway_id: str) -> None:
        self.secrets = list(secrets)
        self.gateway_id = gateway_id
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(timeout=CONTROL_TIMEOUT, limits=limits, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(
        self,
        node: NodeInfo,
        method: str,
        target: str,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
        *,
        keep_authorization: bool = False,
    ) -> Reply:
        """``target`` (path and query, as the client sent them) on ``node``, signed.
        ``keep_authorization``: the client's ``Authorization`` goes on (a volume's token, which the
        node checks; never the API key, which the gateway checked)."""
        dropped = HOP_BY_HOP | _GATEWAY_ONLY | {"content-length"}
        if keep_authorization:
            dropped -= {"authorization"}
        sent = [(k, v) for k, v in headers if k.lower() not in dropped]
        # Template build context uploads are streamed at the node: it checks no body hash for them.
        streamed = STREAMED_PATHS.match(target.split("?", 1)[0]) is not None
        digest = nodeauth.UNSIGNED_PAYLOAD if streamed else nodeauth.body_hash(body)
        signed = nodeauth.signed_headers(self.secrets, self.gateway_id, method, target, digest)
        try:
            resp = await self._http.request(
                method, node.url + target, content=body, headers=[*sent, *signed.items()]
            )
        except httpx.TransportError as exc:
            raise NodeUnreachable(f"node {node.node_id} at {node.url}: {exc!r}") from exc
        kept = [
            (k, v) for k, v in resp.headers.multi_items() if k.lower() not in HOP_BY_HOP | {"content-length"}
        ]
        return Reply(resp.status_code, kept, resp.content)


class EnvdRelay:
    """envd (and any sandbox port) traffic to the node that runs the sandbox."""

    def __init__(self, secrets: Sequence[str], gateway_id: str, max_upload_bytes: int) -> None:
        self.secrets = list(secrets)
        self.gateway_id = gateway_id
        self.limit = max_upload_bytes
        self._upstream = Upstream()

    def close(self) -> None:
        self._upstream.close()

    def _headers(self, scope: Scope, target: Target, host: str, method: str) -> list[tuple[str, str]]:
        drop = HOP_BY_HOP | _ROUTING | _GATEWAY_ONLY | connection_tokens(scope)
        out = [("host", host)]
        for key, value in scope.get("headers", []):
            name = key.decode("latin-1").lower()
            if name not in drop:
                out.append((name, value.decode("latin-1")))
        out += [("e2b-sandbox-id", target.sandbox_id), ("e2b-sandbox-port", str(target.port))]
        signed = nodeauth.signed_headers(
            self.secrets, self.gateway_id, method, nodeauth.request_target(scope), nodeauth.UNSIGNED_PAYLOAD
        )
        return out + list(signed.items())

    async def http(self, scope: Scope, receive: Receive, send: Send, target: Target, node: NodeInfo) -> int:
        """Relay one exchange; returns the node's status (0: the node could not be reached)."""
        host, port = _origin(node.url)
        down = Downstream(receive, self.limit)
        length = next(
            (v.decode() for k, v in scope.get("headers", []) if k.lower() == b"content-length"), None
        )
        chunked = any(k.lower() == b"transfer-encoding" for k, _ in scope.get("headers", []))
        has_body = bool(length and length != "0") or chunked
        if length and is_ascii_number(length) and int(length) > self.limit:
            await down.drain()
            await send_error(
                send, 413, f"request body of {length} bytes exceeds the limit of {self.limit} bytes"
            )
            return 413
        headers = self._headers(scope, target, f"{host}:{port}", scope["method"])
        if has_body and not length:
            headers.append(("transfer-encoding", "chunked"))
        request = h11.Request(method=scope["method"], target=nodeauth.request_target(scope), headers=headers)
        if not has_body:
            down.body_done = True
        try:
            conn, head = await self._exchange(
                host, port, target.sandbox_id, request, down.body() if has_body else None
            )
        except UploadTooLarge:
            await down.drain()
            await send_error(send, 413, f"request body exceeds the limit of {self.limit} bytes")
            return 413
        except ClientGone:
            return 499
        except (UpstreamError, OSError) as exc:
            log.info("relay to %s on %s failed: %s", target.sandbox_id, node.node_id, exc)
            await send_error(send, 502, SANDBOX_NOT_FOUND, target.sandbox_id)
            return 0
        await self._stream_back(conn, head, host, port, target.sandbox_id, send, down)
        return head.status_code

    async def _exchange(
        self, host: str, port: int, key: str, request: h11.Request, body: AsyncIterator[bytes] | None
    ) -> tuple[Connection, h11.Response]:
        return await exchange(self._upstream, host, port, key, request, body, peer="the node")

    async def _stream_back(
        self,
        conn: Connection,
        head: h11.Response,
        host: str,
        port: int,
        key: str,
        send: Send,
        down: Downstream,
    ) -> None:
        done = False

        async def pump() -> None:
            nonlocal done
            await send(
                {
                    "type": "http.response.start",
                    "status": head.status_code,
                    "headers": response_headers(list(head.headers)),
                }
            )
            while True:
                event = await conn.next_event()
                if isinstance(event, h11.Data):
                    await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
                elif isinstance(event, h11.EndOfMessage):
                    done = True
                    break
                else:
                    raise UpstreamError("the node closed the connection mid-response")
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        watcher = asyncio.ensure_future(down.wait_disconnect())
        pumping = asyncio.ensure_future(pump())
        try:
            await asyncio.wait({pumping, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pumping.done() and pumping.exception() is not None:
                exc = pumping.exception()
                if not isinstance(exc, (UpstreamError, OSError)):
                    raise exc  # type: ignore[misc]
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            for task in (pumping, watcher):
                if not task.done():
                    task.cancel()
            self._upstream.discard(key, conn)
            if done:
                self._upstream.release(host, port, conn)
            else:
                conn.close()

    async def websocket(
        self, scope: Scope, receive: Receive, send: Send, target: Target, node: NodeInfo
    ) -> None:
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        host, port = _origin(node.url)
        headers = [
            (k, v)
            for k, v in self._headers(scope, target, f"{host}:{port}", "GET")
            if k != "host" and not k.startswith("sec-websocket-")
        ]
        try:
            upstream = await connect_websocket(
                f"ws://{host}:{port}{nodeauth.request_target(scope)}", headers, scope
            )
        except WEBSOCKET_FAILURES as exc:
            log.info("websocket relay to %s on %s failed: %s", target.sandbox_id, node.node_id, exc)
            await send({"type": "websocket.close", "code": 1011, "reason": SANDBOX_NOT_FOUND})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        await relay_websocket(receive, send, upstream)
