"""The sandbox proxy: an ASGI dispatcher in front of the control plane.

A request is for a sandbox when it carries ``E2b-Sandbox-Id`` + ``E2b-Sandbox-Port`` (what the
SDKs send when ``E2B_SANDBOX_URL`` points here) or a Host of ``{port}-{sandbox_id}.{domain}``.
Such requests never reach FastAPI (envd's ``/health`` and ``/files`` would collide with the
control plane's paths); they are forwarded to ``http://<sandbox address>:<port>`` with both
bodies streamed chunk by chunk (uploads, downloads, Connect server and client streams) and
WebSockets relayed frame by frame, by the relay the gateway uses too (:mod:`forkyard.api.relay`).

Errors the proxy itself answers are what E2B's edge proxy answers, because the SDKs key on the
messages: 502 ``The sandbox was not found`` (sandbox killed, timed out or unknown) and 502
``The sandbox is running but port is not open`` (sandbox running, nothing listening; with ``port``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection

from forkyard.api.relay import (
    ENVD_INTERNAL_PATHS,
    PORT_NOT_OPEN,
    SANDBOX_NOT_FOUND,
    TRAFFIC_TOKEN_HEADER,
    WEBSOCKET_FAILURES,
    ClientGone,
    Connection,
    Downstream,
    SignedFilesUrl,
    Target,
    UploadTooLarge,
    Upstream,
    UpstreamError,
    cancel,
    connect_websocket,
    exchange,
    find_target,
    forward_headers,
    header,
    is_ascii_number,
    relay_websocket,
    response_headers,
    send_error,
)
from forkyard.config import Settings
from forkyard.orchestrator.ids import SANDBOX_ID_LOOSE_RE
from forkyard.orchestrator.lifecycle import Orchestrator
from forkyard.orchestrator.route_table import Route
from forkyard.types import ENVD_PORT

log = logging.getLogger(__name__)


class _CutResponse(Exception):
    """The response must end without its final chunk (the server closes the connection)."""


def upstream_host(route: Route, port: int) -> str:
    """The Host the sandbox sees: its ``network.maskRequestHost`` with ``${PORT}`` expanded
    (E2B's), else its own address."""
    if route.mask_request_host:
        return route.mask_request_host.replace("${PORT}", str(port))
    return f"{route.address}:{port}"


class _UpstreamResponse:
    """A sandbox's answer: status and headers read, the body streamed by ``aiter_raw``."""

    def __init__(self, upstream: Upstream, route: Route, port: int, conn: Connection, head: h11.Response):
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


class SandboxProxy:
    """ASGI middleware: sandbox traffic is proxied, everything else goes to ``app``."""

    def __init__(self, app: ASGIApp, settings: Settings, orchestrator: Callable[[], Orchestrator]) -> None:
        self.app = app
        self.settings = settings
        self._orchestrator = orchestrator
        self._upstream = Upstream()
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
            return None, (502, SANDBOX_NOT_FOUND)
        route = self._orchestrator().route(target.sandbox_id)
        if route is None:
            return None, (502, SANDBOX_NOT_FOUND)
        if target.port == ENVD_PORT and scope.get("path", "") in ENVD_INTERNAL_PATHS:
            return None, (403, f"{scope['path']} is internal to the orchestrator")
        if route.traffic_access_token and target.port != ENVD_PORT:
            presented = header(scope, TRAFFIC_TOKEN_HEADER.encode())
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

    def _gone(self, target: Target) -> bool:
        """Connecting to the sandbox failed: is it gone (else its port is closed)?"""
        return self._orchestrator().route(target.sandbox_id) is None

    # -- HTTP ----------------------------------------------------------------------------------

    async def _wake(self, target: Target) -> None:
        """A sandbox with no route may be paused with ``autoResume``: this traffic resumes it
        (E2B's auto-resume on an SDK call or a request to one of its ports)."""
        if (
            SANDBOX_ID_LOOSE_RE.fullmatch(target.sandbox_id)
            and self._orchestrator().route(target.sandbox_id) is None
        ):
            await self._orchestrator().wake(target.sandbox_id)

    async def _http(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        await self._wake(target)
        route, refusal = self._resolve(scope, target)
        limit = self.settings.max_upload_bytes
        down = Downstream(receive, limit)
        if refusal or route is None:
            code, message = refusal or (502, SANDBOX_NOT_FOUND)
            await down.drain()
            await send_error(send, code, message, target.sandbox_id)
            return
        length = header(scope, b"content-length")
        if length and is_ascii_number(length) and int(length) > limit:
            # Read the body anyway: most HTTP/1.1 clients only look at the answer once sent.
            await down.drain()
            await send_error(send, 413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
            return
        has_body = bool(length and length != "0") or header(scope, b"transfer-encoding") is not None
        headers = [("Host", upstream_host(route, target.port)), *forward_headers(scope, target)]
        if has_body and not length:
            headers.append(("Transfer-Encoding", "chunked"))
        request = h11.Request(method=scope["method"], target=self._target(scope), headers=headers)
        if not has_body:
            down.body_done = True
        watcher = asyncio.ensure_future(down.wait_disconnect()) if not has_body else None
        try:
            exchange = self._exchange(route, target.port, request, down.body() if has_body else None)
            response = await self._send_upstream(exchange, watcher)
        except UploadTooLarge:
            cancel(watcher)
            await down.drain()
            await send_error(send, 413, f"request body exceeds the limit of {limit} bytes")
            return
        except ClientGone:
            cancel(watcher)
            return
        except (UpstreamError, OSError) as exc:
            cancel(watcher)
            log.debug("proxy to %s:%s failed: %s", target.sandbox_id, target.port, exc)
            if self._gone(target):
                await send_error(send, 502, SANDBOX_NOT_FOUND, target.sandbox_id)
            else:
                await send_error(send, 502, PORT_NOT_OPEN, target.sandbox_id, port=target.port)
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
        down: Downstream,
        watcher: asyncio.Future[None] | None,
        sandbox_id: str,
    ) -> None:
        async def pump() -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": response_headers(response.headers),
                }
            )
            async for chunk in response.aiter_raw():
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
                    # The sandbox went away mid-response (killed, timed out): the body is cut
                    # off, no final chunk, as E2B's proxy (Go's ReverseProxy aborts the
                    # handler). The SDKs see the transport fail, probe the sandbox's health and
                    # report it killed; a cleanly ended body would look complete ("Command
                    # ended without an end event"), and an `unavailable` end-stream is worded
                    # by the JS SDK and Python before 2.6x as a timeout.
                    log.debug("upstream ended mid-response: %s", exc)
                    raise _CutResponse(f"the sandbox {sandbox_id} went away mid-response")
        finally:
            cancel(pumping)
            cancel(watcher)
            await response.aclose()

    # -- WebSocket -----------------------------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        await self._wake(target)
        route, refusal = self._resolve(scope, target)
        if refusal or route is None:
            await send({"type": "websocket.close", "code": 1011, "reason": (refusal or (502, ""))[1][:120]})
            return
        headers = [
            (k, v) for k, v in forward_headers(scope, target) if not k.lower().startswith("sec-websocket-")
        ]
        try:
            upstream = await connect_websocket(
                self._url(scope, route, target.port, scheme="ws"), headers, scope
            )
        except WEBSOCKET_FAILURES as exc:
            log.debug("websocket to %s:%s failed: %s", target.sandbox_id, target.port, exc)
            await send(
                {
                    "type": "websocket.close",
                    "code": 1011,
                    "reason": SANDBOX_NOT_FOUND if self._gone(target) else PORT_NOT_OPEN,
                }
            )
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        sockets = self._sockets.setdefault(route.sandbox_id, set())
        sockets.add(upstream)
        try:
            await relay_websocket(receive, send, upstream)
        finally:
            sockets.discard(upstream)
            if not sockets and self._sockets.get(route.sandbox_id) is sockets:
                del self._sockets[route.sandbox_id]
