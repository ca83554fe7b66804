"""The sandbox proxy: an ASGI dispatcher in front of the control plane.

A request is for a sandbox when it carries ``E2b-Sandbox-Id`` + ``E2b-Sandbox-Port`` (what the
SDKs send when ``E2B_SANDBOX_URL`` points here) or a Host of ``{port}-{sandbox_id}.{domain}``.
Such requests never reach FastAPI (envd's ``/health`` and ``/files`` would collide with the
control plane's paths); they are forwarded to ``http://<sandbox address>:<port>`` with both
bodies streamed chunk by chunk (uploads, downloads, Connect server and client streams) and
WebSockets relayed frame by frame. Upstream HTTP is h11 over pooled keep-alive asyncio connections
(``_Upstream``), not httpx: every SDK call crosses this hop, and httpx's layers cost 2-2.5 ms per
request here where h11 alone costs 0.25 ms (docs/LATENCY.md).

Errors the proxy itself answers are what E2B's edge proxy answers, because the SDKs key on the
messages: 502 ``... was not found`` (sandbox killed, timed out or unknown) and 502
``... port is not open`` (sandbox running, nothing listening).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import h11
import websockets
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection

from forkyard.config import Settings
from forkyard.envd.signature import expected_signature
from forkyard.orchestrator.ids import SANDBOX_ID_LOOSE_RE, normalise_sandbox_id
from forkyard.orchestrator.lifecycle import Orchestrator, Route
from forkyard.types import ENVD_PORT

log = logging.getLogger(__name__)

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


class _UploadTooLarge(Exception):
    pass


class _CutResponse(Exception):
    """The response must end without its final chunk (the server closes the connection)."""


class _ClientGone(Exception):
    pass


class UpstreamError(Exception):
    """The sandbox could not be reached, or broke off the exchange."""


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int


def _header(scope: Scope, name: bytes) -> str | None:
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
    sid = _header(scope, b"e2b-sandbox-id")
    port = _header(scope, b"e2b-sandbox-port")
    if sid and port:
        if not is_ascii_number(port):
            return Target(sandbox_id=normalise_sandbox_id(sid), port=-1)
        return Target(sandbox_id=normalise_sandbox_id(sid), port=int(port))
    host = _header(scope, b"host") or ""
    hostname = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    m = _HOST_RE.match(hostname.lower())
    domains = (domain,) if isinstance(domain, str) else domain
    if m and m.group("domain") in {d.lower() for d in domains}:
        return Target(sandbox_id=normalise_sandbox_id(m.group("sandbox")), port=int(m.group("port")))
    return None


def not_found_message(sandbox_id: str) -> str:
    # The SDKs recognise a gone sandbox by "was not found" (e2b.exceptions.SANDBOX_NOT_FOUND_MESSAGE).
    return f"The sandbox {sandbox_id} was not found"


def port_closed_message(sandbox_id: str, port: int) -> str:
    return f"The sandbox {sandbox_id} is running but port is not open (port {port})"


def _connection_tokens(scope: Scope) -> set[str]:
    """Headers the client named in ``Connection`` are hop-by-hop too (RFC 9110 7.6.1)."""
    value = _header(scope, b"connection") or ""
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def forward_headers(scope: Scope, target: Target) -> list[tuple[str, str]]:
    out = []
    drop = HOP_BY_HOP | ROUTING_HEADERS | _connection_tokens(scope)
    for key, value in scope.get("headers", []):
        name = key.decode("latin-1").lower()
        if name in drop:
            continue
        out.append((name, value.decode("latin-1")))
    client = scope.get("client")
    if client:
        out.append(("x-forwarded-for", str(client[0])))
    out.append(("x-forwarded-proto", "https" if scope.get("scheme") in ("https", "wss") else "http"))
    host = _header(scope, b"host")
    if host:
        out.append(("x-forwarded-host", host))
    return out


def upstream_host(route: Route, port: int) -> str:
    """The Host the sandbox sees: its ``network.maskRequestHost`` with ``${PORT}`` expanded
    (E2B's), else its own address."""
    if route.mask_request_host:
        return route.mask_request_host.replace("${PORT}", str(port))
    return f"{route.address}:{port}"


def response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in raw if k.decode("latin-1").lower() not in HOP_BY_HOP]


async def send_error(send: Send, code: int, message: str, sandbox_id: str | None = None) -> None:
    body: dict[str, Any] = {"code": code, "message": message}
    if sandbox_id:
        body["sandboxId"] = sandbox_id
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


class _Connection:
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


class _Upstream:
    """Keep-alive connections to sandboxes, by (address, port), and the ones in use, by
    sandbox: when a sandbox stops (kill, pause, death) :meth:`close_sandbox` ends every exchange
    with it at once instead of leaving clients to their read timeouts."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: dict[str, set[_Connection]] = {}
        #: The address each sandbox with busy connections was reached at.
        self._hosts: dict[str, str] = {}

    async def connect(self, host: str, port: int, sandbox_id: str) -> _Connection:
        conn = await self._open(host, port)
        self._busy.setdefault(sandbox_id, set()).add(conn)
        self._hosts[sandbox_id] = host
        return conn

    async def _open(self, host: str, port: int) -> _Connection:
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
        return _Connection(reader, writer)

    def discard(self, sandbox_id: str, conn: _Connection) -> None:
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

    def release(self, host: str, port: int, conn: _Connection) -> None:
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
    upstream: _Upstream,
    host: str,
    port: int,
    key: str,
    request: h11.Request,
    body: AsyncIterator[bytes] | None,
    *,
    peer: str,
) -> tuple[_Connection, h11.Response]:
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


class _ConnectFrames:
    """Where a Connect streaming response's envelopes (5-byte head: flags, big-endian length)
    begin, so that an end-stream message can be added between two of them."""

    def __init__(self, content_type: str) -> None:
        self.streaming = content_type.lower().startswith("application/connect+")
        self._head = b""
        self._left = 0  # bytes of the current envelope's message still to come

    def feed(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            if self._left:
                step = min(self._left, len(view))
                self._left -= step
                view = view[step:]
                continue
            need = 5 - len(self._head)
            self._head += bytes(view[:need])
            view = view[need:]
            if len(self._head) == 5:
                self._left = int.from_bytes(self._head[1:], "big")
                self._head = b""

    def at_boundary(self) -> bool:
        return not self._head and not self._left


def connect_end_stream(code: str, message: str) -> bytes:
    """A Connect end-stream envelope (flags 0x02, always JSON) carrying an error."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return b"\x02" + len(body).to_bytes(4, "big") + body


def stream_cut_message(sandbox_id: str) -> str:
    """E2B's words when the sandbox goes away mid-stream (the SDKs then probe its health)."""
    return f"the connection to sandbox {sandbox_id} ended before the stream completed"


class _UpstreamResponse:
    """A sandbox's answer: status and headers read, the body streamed by ``aiter_raw``."""

    def __init__(self, upstream: _Upstream, route: Route, port: int, conn: _Connection, head: h11.Response):
        self.status_code = head.status_code
        self.headers: list[tuple[bytes, bytes]] = list(head.headers)
        self._release = lambda: upstream.release(route.address, port, conn)
        self._discard = lambda: upstream.discard(route.sandbox_id, conn)
        self._conn = conn
        self._done = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (transfer coding removed, content coding kept)."""
        while not self._done:
            event = await self._conn.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._done = True
            else:
                raise UpstreamError("the sandbox closed the connection mid-response")

    async def aclose(self) -> None:
        self._discard()
        if self._done:
            self._release()
        else:
            self._conn.close()


class _Downstream:
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
                raise _ClientGone()
            chunk: bytes = msg.get("body", b"")
            self.received += len(chunk)
            if self.received > self._limit:
                raise _UploadTooLarge()
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


class SandboxProxy:
    """ASGI middleware: sandbox traffic is proxied, everything else goes to ``app``."""

    def __init__(self, app: ASGIApp, settings: Settings, orchestrator: Callable[[], Orchestrator]) -> None:
        self.app = app
        self.settings = settings
        self._orchestrator = orchestrator
        self._upstream = _Upstream()
        #: Open WebSocket relays, by sandbox (ended like HTTP exchanges by :meth:`sandbox_left`).
        self._sockets: dict[str, set[ClientConnection]] = {}

    async def aclose(self) -> None:
        self._upstream.close()

    def sandbox_left(self, sandbox_id: str) -> None:
        """The sandbox stopped being reachable (the orchestrator's detach listener): end every
        stream with it now (commands, PTYs, watches), as E2B's do when a sandbox is killed."""
        ended = self._upstream.close_sandbox(sandbox_id)
        for socket in self._sockets.pop(sandbox_id, set()):
            socket.transport.abort()  # a closing handshake would wait for the dead peer
            ended += 1
        if ended:
            log.info("ended %d open streams to sandbox %s", ended, sandbox_id)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            # Plain-HTTP names (``domain``) and the HTTPS sandbox URLs (``sandbox_domain``).
            target = find_target(scope, (self.settings.domain, self.settings.sandbox_domain))
            if target is None and scope["type"] == "http" and scope.get("path") == "/files":
                target = self._signed_target(scope)
            if target is not None:
                if scope["type"] == "http":
                    await self._http(scope, receive, send, target)
                else:
                    await self._websocket(scope, receive, send, target)
                return
        await self.app(scope, receive, send)

    def _signed_target(self, scope: Scope) -> Target | None:
        """envd of the sandbox whose token signs this ``/files`` URL. With ``E2B_SANDBOX_URL``
        the SDKs' ``download_url``/``upload_url`` are ``{E2B_SANDBOX_URL}/files?...&signature=``:
        no routing header, no sandbox host name (a browser or curl sends nothing else). envd
        checks the signature (and its expiry, with E2B's message) again; None: not signed."""
        signed = SignedFilesUrl.of(scope)
        if signed is None:
            return None
        for route in self._orchestrator().routes():
            if route.envd_access_token and signed.signed_with(route.envd_access_token):
                return Target(sandbox_id=route.sandbox_id, port=ENVD_PORT)
        return None

    # -- shared checks -------------------------------------------------------------------------

    def _resolve(self, scope: Scope, target: Target) -> tuple[Route | None, tuple[int, str] | None]:
        """The route to the sandbox, or the (status, message) to refuse the request with."""
        if target.port < 1 or target.port > 65535:
            return None, (400, f"invalid sandbox port {target.port}")
        if not SANDBOX_ID_LOOSE_RE.fullmatch(target.sandbox_id):
            return None, (502, not_found_message(target.sandbox_id))
        route = self._orchestrator().route(target.sandbox_id)
        if route is None:
            return None, (502, not_found_message(target.sandbox_id))
        if target.port == ENVD_PORT and scope.get("path", "") in ENVD_INTERNAL_PATHS:
            return None, (403, f"{scope['path']} is internal to the orchestrator")
        if route.traffic_access_token and target.port != ENVD_PORT:
            presented = _header(scope, TRAFFIC_TOKEN_HEADER.encode())
            if presented != route.traffic_access_token:
                return None, (403, f"sandbox {target.sandbox_id} requires a valid {TRAFFIC_TOKEN_HEADER}")
        return route, None

    def _target(self, scope: Scope) -> str:
        """The request target as the client sent it (raw path, query)."""
        path = scope.get("raw_path") or scope.get("path", "/").encode()
        raw_path = path.decode("latin-1") if isinstance(path, bytes) else str(path)
        query = scope.get("query_string", b"").decode("latin-1")
        return raw_path + (f"?{query}" if query else "")

    def _url(self, scope: Scope, route: Route, port: int, scheme: str = "http") -> str:
        return f"{scheme}://{route.address}:{port}{self._target(scope)}"

    def _unreachable(self, target: Target) -> tuple[int, str]:
        """What to answer when connecting to the sandbox failed: gone, or port closed."""
        if self._orchestrator().route(target.sandbox_id) is None:
            return 502, not_found_message(target.sandbox_id)
        return 502, port_closed_message(target.sandbox_id, target.port)

    # -- HTTP ----------------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        route, refusal = self._resolve(scope, target)
        limit = self.settings.max_upload_bytes
        down = _Downstream(receive, limit)
        if refusal or route is None:
            code, message = refusal or (502, not_found_message(target.sandbox_id))
            await down.drain()
            await send_error(send, code, message, target.sandbox_id)
            return
        length = _header(scope, b"content-length")
        if length and is_ascii_number(length) and int(length) > limit:
            # Read the body anyway: most HTTP/1.1 clients only look at the answer once sent.
            await down.drain()
            await send_error(send, 413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
            return
        has_body = bool(length and length != "0") or _header(scope, b"transfer-encoding") is not None
        headers = [("host", upstream_host(route, target.port)), *forward_headers(scope, target)]
        if has_body and not length:
            headers.append(("transfer-encoding", "chunked"))
        request = h11.Request(method=scope["method"], target=self._target(scope), headers=headers)
        if not has_body:
            down.body_done = True
        watcher = asyncio.ensure_future(down.wait_disconnect()) if not has_body else None
        try:
            exchange = self._exchange(route, target.port, request, down.body() if has_body else None)
            response = await self._send_upstream(exchange, watcher)
        except _UploadTooLarge:
            _cancel(watcher)
            await down.drain()
            await send_error(send, 413, f"request body exceeds the limit of {limit} bytes")
            return
        except _ClientGone:
            _cancel(watcher)
            return
        except (UpstreamError, OSError) as exc:
            _cancel(watcher)
            log.debug("proxy to %s:%s failed: %s", target.sandbox_id, target.port, exc)
            code, message = self._unreachable(target)
            await send_error(send, code, message, target.sandbox_id)
            return
        if response is None:  # the client went away while we waited for the sandbox
            return
        with contextlib.suppress(_CutResponse):  # the server closes the connection: a cut body
            await self._stream_response(response, send, down, watcher, target.sandbox_id)

    async def _exchange(
        self, route: Route, port: int, request: h11.Request, body: AsyncIterator[bytes] | None
    ) -> _UpstreamResponse:
        """Send the request (streaming its body) and read the response head."""
        conn, head = await exchange(
            self._upstream, route.address, port, route.sandbox_id, request, body, peer="the sandbox"
        )
        return _UpstreamResponse(self._upstream, route, port, conn, head)

    async def _send_upstream(
        self,
        exchange: Coroutine[Any, Any, _UpstreamResponse],
        watcher: asyncio.Future[None] | None,
    ) -> _UpstreamResponse | None:
        """The response, or None when the client went away first."""
        sending: asyncio.Future[_UpstreamResponse] = asyncio.ensure_future(exchange)
        if watcher is None:
            return await sending
        pending: list[asyncio.Future[Any]] = [sending, watcher]
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if sending in done:
            return sending.result()
        sending.cancel()
        with contextlib.suppress(BaseException):
            resp = await sending
            await resp.aclose()
        return None

    async def _stream_response(
        self,
        response: _UpstreamResponse,
        send: Send,
        down: _Downstream,
        watcher: asyncio.Future[None] | None,
        sandbox_id: str,
    ) -> None:
        content_type = dict(response.headers).get(b"content-type", b"").decode("latin-1")
        frames = _ConnectFrames(content_type)

        async def pump() -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": response_headers(response.headers),
                }
            )
            async for chunk in response.aiter_raw():
                if frames.streaming:
                    frames.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        if watcher is None:
            watcher = asyncio.ensure_future(down.wait_disconnect())
        pumping = asyncio.ensure_future(pump())
        try:
            done, _ = await asyncio.wait({pumping, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pumping in done:
                exc = pumping.exception()
                if exc is not None and not isinstance(exc, (UpstreamError, OSError)):
                    raise exc
                if exc is not None:
                    log.debug("upstream ended mid-response: %s", exc)
                    await self._end_cut_response(send, frames, sandbox_id)
        finally:
            _cancel(pumping)
            _cancel(watcher)
            await response.aclose()

    async def _end_cut_response(self, send: Send, frames: _ConnectFrames, sandbox_id: str) -> None:
        """The sandbox went away mid-response. A Connect stream (a command's output, a watch)
        ends with E2B's ``unavailable`` error, which the SDKs turn into their sandbox-gone
        errors; a stream cut inside an envelope, or any other body, is cut off (no final chunk),
        a transport failure the SDKs probe the sandbox's health after. A cleanly ended body
        would look complete ("Command ended without an end event")."""
        if frames.streaming and frames.at_boundary():
            end = connect_end_stream("unavailable", stream_cut_message(sandbox_id))
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": end, "more_body": False})
            return
        raise _CutResponse(f"the sandbox {sandbox_id} went away mid-response")

    # -- WebSocket -----------------------------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        route, refusal = self._resolve(scope, target)
        if refusal or route is None:
            await send({"type": "websocket.close", "code": 1011, "reason": (refusal or (502, ""))[1][:120]})
            return
        headers = [(k, v) for k, v in forward_headers(scope, target) if not k.startswith("sec-websocket-")]
        try:
            upstream = await connect_websocket(
                self._url(scope, route, target.port, scheme="ws"), headers, scope
            )
        except WEBSOCKET_FAILURES as exc:
            log.debug("websocket to %s:%s failed: %s", target.sandbox_id, target.port, exc)
            await send(
                {"type": "websocket.close", "code": 1011, "reason": self._unreachable(target)[1][:120]}
            )
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        sockets = self._sockets.setdefault(route.sandbox_id, set())
        sockets.add(upstream)
        try:
            await _relay_websocket(receive, send, upstream)
        finally:
            sockets.discard(upstream)
            if not sockets and self._sockets.get(route.sandbox_id) is sockets:
                del self._sockets[route.sandbox_id]


async def _relay_websocket(receive: Receive, send: Send, upstream: ClientConnection) -> None:
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
            _cancel(t)
        await upstream.close()


def _cancel(task: asyncio.Future[Any] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
