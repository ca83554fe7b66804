"""The HTTP relay both edges use: the node's sandbox proxy (:mod:`forkyard.api.proxy`) and the
cluster gateway's forwarding to nodes (:mod:`forkyard.gateway.forward`).

Upstream HTTP is h11 over pooled keep-alive asyncio connections (:class:`Upstream`), not httpx:
every SDK call crosses this hop, and httpx's layers cost 2-2.5 ms per request here where h11
alone costs 0.25 ms (docs/LATENCY.md). Request bodies stream from the client
(:class:`Downstream`), WebSockets are relayed frame by frame (:func:`relay_websocket`), and the
errors the edge answers itself have E2B's shape (:func:`send_error`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import h11
import websockets
from starlette.types import Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection

from forkyard.envd.http.signature import expected_signature
from forkyard.orchestrator.ids import normalise_sandbox_id

#: Hop-by-hop headers (RFC 9110 7.6.1) plus the ones the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
#: Routing headers that mean nothing to the sandbox.
ROUTING_HEADERS = frozenset({"e2b-sandbox-id", "e2b-sandbox-port", "e2b-traffic-access-token"})
#: envd operations marked ``x-internal`` in envd.yaml: only the orchestrator may call them, over
#: the host link, never through the public sandbox URL.
ENVD_INTERNAL_PATHS = frozenset({"/init", "/freeze", "/unfreeze", "/collapse", "/fsfreeze", "/fsthaw"})
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
_HOST_RE = re.compile(r"^(?P<port>[0-9]{1,5})-(?P<sandbox>[A-Za-z0-9-]+)\.(?P<domain>.+)$")
_CONNECT_TIMEOUT_S = 10.0
#: Idle upstream connections are dropped after this long (envd keeps them 60 s).
_IDLE_EXPIRY_S = 30.0
_MAX_IDLE_PER_ORIGIN = 32
_READ_CHUNK = 64 * 1024


class UploadTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


class UpstreamError(Exception):
    """The sandbox could not be reached, or broke off the exchange."""


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            decoded: str = value.decode("latin-1")
            return decoded
    return None


def is_ascii_number(text: str) -> bool:
    """Digits 0-9 only: ``str.isdigit`` also accepts ``²`` and other Unicode digits, on which
    ``int()`` fails (a 500) or which name ports nobody meant."""
    return text.isascii() and text.isdigit()


def find_target(scope: Scope, domain: str | tuple[str, ...]) -> Target | None:
    """The sandbox and port a request is for, or None when it is a control-plane request."""
    sid = header(scope, b"e2b-sandbox-id")
    port = header(scope, b"e2b-sandbox-port")
    if sid and port:
        if not is_ascii_number(port):
            return Target(sandbox_id=normalise_sandbox_id(sid), port=-1)
        return Target(sandbox_id=normalise_sandbox_id(sid), port=int(port))
    host = header(scope, b"host") or ""
    hostname = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    m = _HOST_RE.match(hostname.lower())
    domains = (domain,) if isinstance(domain, str) else domain
    if m and m.group("domain") in {d.lower() for d in domains}:
        return Target(sandbox_id=normalise_sandbox_id(m.group("sandbox")), port=int(m.group("port")))
    return None


#: E2B's proxy's words (infra: packages/shared/pkg/proxy/template), the sandbox in ``sandboxId``
#: beside them. The SDKs recognise a gone sandbox by "was not found" and a closed port by "port is
#: not open" (e2b.exceptions); E2B's JS suite compares the whole message.
SANDBOX_NOT_FOUND = "The sandbox was not found"
PORT_NOT_OPEN = "The sandbox is running but port is not open"


def connection_tokens(scope: Scope) -> set[str]:
    """Headers the client named in ``Connection`` are hop-by-hop too (RFC 9110 7.6.1)."""
    value = header(scope, b"connection") or ""
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def canonical_header_name(name: str) -> str:
    """``x-forwarded-for`` -> ``X-Forwarded-For``: the casing E2B's proxy (Go's net/http, which
    canonicalises every name) gives the headers a sandbox's server receives. ASGI hands us names in
    lower case, and servers that echo or log names verbatim (Python's http.server) show the case."""
    return "-".join(part[:1].upper() + part[1:] for part in name.lower().split("-"))


def forward_headers(scope: Scope, target: Target) -> list[tuple[str, str]]:
    """The request's end-to-end headers for the sandbox, named as E2B's proxy names them, with
    the ``X-Forwarded-*`` headers added."""
    out = []
    drop = HOP_BY_HOP | ROUTING_HEADERS | connection_tokens(scope)
    for key, value in scope.get("headers", []):
        name = key.decode("latin-1").lower()
        if name in drop:
            continue
        out.append((canonical_header_name(name), value.decode("latin-1")))
    client = scope.get("client")
    if client:
        out.append(("X-Forwarded-For", str(client[0])))
    out.append(("X-Forwarded-Proto", "https" if scope.get("scheme") in ("https", "wss") else "http"))
    host = header(scope, b"host")
    if host:
        out.append(("X-Forwarded-Host", host))
    return out


def response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in raw if k.decode("latin-1").lower() not in HOP_BY_HOP]


async def send_error(
    send: Send, code: int, message: str, sandbox_id: str | None = None, port: int | None = None
) -> None:
    body: dict[str, Any] = {"code": code, "message": message}
    if sandbox_id:
        body["sandboxId"] = sandbox_id
    if port is not None:
        body["port"] = port
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                # Answers of the proxy itself are final; nothing gets better by retrying.
                (b"should-retry", b"false"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


class Connection:
    """One HTTP/1.1 connection to a sandbox port."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.http = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self._unsent = b""

    def reusable(self) -> bool:
        """Not closed by the sandbox while idle (EOF arrives without a pending read) nor stale."""
        fresh = time.monotonic() - self.idle_since < _IDLE_EXPIRY_S
        return fresh and not self.reader.at_eof() and not self.writer.is_closing()

    def hold(self, event: h11.Event) -> None:
        """Send ``event`` with the next one: a request head goes out in one segment with the
        start of its body (one read for the sandbox's server, not two)."""
        self._unsent += self.http.send(event) or b""

    async def send(self, event: h11.Event) -> None:
        data = self._unsent + (self.http.send(event) or b"")
        self._unsent = b""
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def next_event(self) -> object:
        """The next h11 event (callers tell them apart by type)."""
        try:
            while True:
                event = self.http.next_event()
                if event is not h11.NEED_DATA:
                    return event
                self.http.receive_data(await self.reader.read(_READ_CHUNK))  # b"": EOF
        except h11.RemoteProtocolError as exc:
            raise UpstreamError(f"bad HTTP from the sandbox: {exc}") from exc

    def close(self) -> None:
        self.writer.close()


class Upstream:
    """Keep-alive connections to sandboxes, by (address, port), and the ones in use, by
    sandbox: when a sandbox stops (kill, pause, death) :meth:`close_sandbox` ends every exchange
    with it at once instead of leaving clients to their read timeouts."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._busy: dict[str, set[Connection]] = {}
        #: The address each sandbox with busy connections was reached at.
        self._hosts: dict[str, str] = {}

    async def connect(self, host: str, port: int, sandbox_id: str) -> Connection:
        conn = await self._open(host, port)
        self._busy.setdefault(sandbox_id, set()).add(conn)
        self._hosts[sandbox_id] = host
        return conn

    async def _open(self, host: str, port: int) -> Connection:
        idle = self._idle.get((host, port), [])
        while idle:
            conn = idle.pop()
            if conn.reusable():
                return conn
            conn.close()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"connecting to {host}:{port}: {exc!r}") from exc
        return Connection(reader, writer)

    def discard(self, sandbox_id: str, conn: Connection) -> None:
        """``conn`` is no longer in use (closed or back in the pool)."""
        busy = self._busy.get(sandbox_id)
        if busy is not None:
            busy.discard(conn)
            if not busy:
                del self._busy[sandbox_id]
                self._hosts.pop(sandbox_id, None)

    def close_sandbox(self, sandbox_id: str) -> int:
        """Close every connection to the sandbox, in use or idle; returns how many were in use.
        A reader blocked on one sees EOF now, so its exchange ends (502, or a cut body)."""
        host = self._hosts.pop(sandbox_id, None)
        busy = self._busy.pop(sandbox_id, set())
        for conn in busy:
            conn.close()
        for (idle_host, _), idle in self._idle.items():
            if idle_host == host:
                for conn in idle:
                    conn.close()
                idle.clear()
        return len(busy)

    def release(self, host: str, port: int, conn: Connection) -> None:
        """Back to the pool when the exchange completed on both sides, else closed."""
        idle = self._idle.setdefault((host, port), [])
        if (
            conn.http.our_state is h11.DONE
            and conn.http.their_state is h11.DONE
            and len(idle) < _MAX_IDLE_PER_ORIGIN
        ):
            conn.http.start_next_cycle()
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def exchange(
    upstream: Upstream,
    host: str,
    port: int,
    key: str,
    request: h11.Request,
    body: AsyncIterator[bytes] | None,
    *,
    peer: str,
) -> tuple[Connection, h11.Response]:
    """Send ``request`` on a pooled connection to ``host:port`` (streaming ``body``) and read
    the response head; the connection is dropped from the pool on any failure. ``peer`` names
    the other end in errors ("the sandbox", "the node")."""
    conn = await upstream.connect(host, port, key)
    try:
        conn.hold(request)
        if body is not None:
            with contextlib.suppress(OSError):  # the peer answered before reading it all
                async for chunk in body:
                    await conn.send(h11.Data(data=chunk))
                await conn.send(h11.EndOfMessage())
        else:
            await conn.send(h11.EndOfMessage())
        while True:
            event = await conn.next_event()
            if isinstance(event, h11.Response):
                return conn, event
            if not isinstance(event, h11.InformationalResponse):  # 1xx: the answer follows
                raise UpstreamError(f"{peer} closed the connection without answering")
    except BaseException:
        upstream.discard(key, conn)
        conn.close()
        raise


#: What a failed upstream websocket handshake raises.
WEBSOCKET_FAILURES = (OSError, websockets.InvalidHandshake, TimeoutError)


async def connect_websocket(
    url: str, headers: list[tuple[str, str]], scope: Scope
) -> websockets.ClientConnection:
    """Open the upstream side of a relayed websocket with the client's subprotocols."""
    return await websockets.connect(
        url,
        additional_headers=headers,
        subprotocols=scope.get("subprotocols") or None,
        max_size=None,
        open_timeout=10,
        proxy=None,
    )


@dataclass(frozen=True)
class SignedFilesUrl:
    """The signature part of a signed ``/files`` URL (the SDKs' ``download_url``/``upload_url``)."""

    signature: str
    path: str
    operation: str
    user: str
    expiration: int | None

    @classmethod
    def of(cls, scope: Scope) -> SignedFilesUrl | None:
        params = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        signature = (params.get("signature") or [""])[0]
        if not signature:
            return None
        raw_expiration = (params.get("signature_expiration") or [""])[0]
        return cls(
            signature=signature,
            path=(params.get("path") or [""])[0],
            operation="read" if scope.get("method") == "GET" else "write",
            user=(params.get("username") or [""])[0],
            expiration=int(raw_expiration) if is_ascii_number(raw_expiration) else None,
        )

    def signed_with(self, token: str) -> bool:
        expected = expected_signature(self.path, self.operation, self.user, token, self.expiration)
        return hmac.compare_digest(self.signature, expected)


class Downstream:
    """The client side of one proxied HTTP exchange: its request body as an async iterator
    (with the size limit enforced), and a way to notice the client going away."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self._limit = limit
        self.received = 0
        self.body_done = False
        self.disconnected = asyncio.Event()

    async def body(self) -> AsyncIterator[bytes]:
        while not self.body_done:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected.set()
                raise ClientGone()
            chunk: bytes = msg.get("body", b"")
            self.received += len(chunk)
            if self.received > self._limit:
                raise UploadTooLarge()
            if not msg.get("more_body", False):
                self.body_done = True
            if chunk:
                yield chunk

    async def drain(self) -> None:
        """Read (and drop) what is left of the request body, e.g. before answering 413."""
        while not self.body_done:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected.set()
                return
            if not msg.get("more_body", False):
                self.body_done = True

    async def wait_disconnect(self) -> None:
        while not self.disconnected.is_set():
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected.set()


async def relay_websocket(receive: Receive, send: Send, upstream: ClientConnection) -> None:
    async def client_to_upstream() -> None:
        while True:
            msg: Message = await receive()
            if msg["type"] == "websocket.disconnect":
                await upstream.close(code=msg.get("code", 1000))
                return
            if msg.get("bytes") is not None:
                await upstream.send(msg["bytes"])
            elif msg.get("text") is not None:
                await upstream.send(msg["text"])

    async def upstream_to_client() -> None:
        try:
            async for data in upstream:
                if isinstance(data, bytes):
                    await send({"type": "websocket.send", "bytes": data})
                else:
                    await send({"type": "websocket.send", "text": data})
        except websockets.ConnectionClosed:
            pass
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": code if code != 1006 else 1011})

    tasks = [asyncio.ensure_future(client_to_upstream()), asyncio.ensure_future(upstream_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            cancel(t)
        await upstream.close()


def cancel(task: asyncio.Future[Any] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
