"""A cap on control-plane request bodies, as E2B's API has one.

E2B's API server wraps every request in ``limits.RequestSizeLimiter(maxUploadLimit)``
(gin-contrib/size, packages/api/main.go in e2b-dev/infra: ``maxUploadLimit = 1 << 24``, 16 MiB)
and answers a larger body with 413. Sandbox traffic never reaches this middleware: the proxy
in front of it forwards that with its own limit (``FORKYARD_MAX_UPLOAD_BYTES``).

The body is read here, up to the limit, and handed on whole: control-plane bodies are small
JSON documents, and a route must not have started on a body that turns out too large.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forkyard.api.errors import error_response

#: E2B's ``maxUploadLimit`` (packages/api/main.go).
MAX_REQUEST_BYTES = 16 << 20
#: How much of a refused body is read before answering (beyond it, the connection is closed).
_DRAIN_BYTES = 64 << 20
#: Template build context uploads stream to disk with a limit of their own: E2B sends them to a
#: presigned object-storage URL, outside its API and its limit.
STREAMED_PATHS = re.compile(r"^/templates/[^/]+/files/[^/]+/upload$|^/volumecontent/[^/]+/file$")


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            text = value.decode("latin-1")
            return int(text) if text.isascii() and text.isdigit() else None
    return None


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int = MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or STREAMED_PATHS.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            body = message.get("body", b"")
            total += len(body)
            if total > self.limit:
                await self._refuse(scope, receive, send, more=message.get("more_body", False))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, more: bool = True) -> None:
        # Read (and drop) the rest first, up to a bound: most HTTP/1.1 clients only look at the
        # answer once their body is sent, and see a reset connection otherwise.
        drained = 0
        while more and drained < _DRAIN_BYTES:
            part = await receive()
            if part["type"] == "http.disconnect" or not part.get("more_body", False):
                break
            drained += len(part.get("body", b""))
        text = f"request body exceeds the limit of {self.limit} bytes"
        await error_response(413, text, {"Connection": "close"})(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the client's own messages (a disconnect, for routes that wait)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
