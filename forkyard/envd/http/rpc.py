"""Connect RPC wiring: our message classes and handlers as connectrpc ASGI applications.

Both codecs are served (binary ``application/proto`` and JSON, which the SDK uses:
``application/json`` unary, ``application/connect+json`` streams).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from connectrpc.method import IdempotencyLevel, MethodInfo
from connectrpc.request import RequestContext
from connectrpc.server import ConnectASGIApplication, Endpoint

from forkyard.envd.filesystem.service import FilesystemService
from forkyard.envd.process.service import ProcessService
from forkyard.envd.proto import filesystem_pb as fs
from forkyard.envd.proto import process_pb as pr

PROCESS_SERVICE = "process.Process"
FILESYSTEM_SERVICE = "filesystem.Filesystem"
#: Large enough for SendInput chunks and metadata-heavy requests; file data goes over /files.
READ_MAX_BYTES = 16 * 1024 * 1024
#: What connect-go says when a handler's context passes its ``Connect-Timeout-Ms`` deadline.
DEADLINE_MESSAGE = "context deadline exceeded"

StreamHandler = Callable[[Any, RequestContext[Any, Any]], AsyncIterator[Any]]


def with_deadline(handler: StreamHandler) -> StreamHandler:
    """End a server stream with ``deadline_exceeded`` once its ``Connect-Timeout-Ms`` has passed.

    connect-go (E2B's envd) gives each handler a context with that deadline; connectrpc's
    Python server only parses the header. The async SDK bounds a command's or watch's stream
    by it, so without this its ``timeout`` never fires while the process stays quiet.
    """

    async def bounded(request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        remaining_ms = ctx.timeout_ms
        stream = handler(request, ctx)
        if remaining_ms is None:
            async for item in stream:
                yield item
            return
        deadline = asyncio.get_running_loop().time() + max(0.0, remaining_ms) / 1000
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline) as scope:
                        item = await anext(stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if scope.expired():
                        raise ConnectError(Code.DEADLINE_EXCEEDED, DEADLINE_MESSAGE) from None
                    raise
                yield item
        finally:
            close = getattr(stream, "aclose", None)  # a cancelled generator is closed already
            if close is not None:
                await close()

    return bounded


def _method(service: str, name: str, request: type[Any], response: type[Any]) -> MethodInfo[Any, Any]:
    return MethodInfo(
        name=name,
        service_name=service,
        input=request,
        output=response,
        idempotency_level=IdempotencyLevel.UNKNOWN,
    )


class _ServiceApp(ConnectASGIApplication[Any]):
    def __init__(
        self, service_name: str, service: object, endpoints: Callable[[Any], Mapping[str, Any]]
    ) -> None:
        self._service_name = service_name
        super().__init__(service=service, endpoints=endpoints, read_max_bytes=READ_MAX_BYTES, codecs=CODECS)

    @property
    def path(self) -> str:
        return f"/{self._service_name}"


def _process_endpoints(svc: ProcessService) -> Mapping[str, Any]:
    def m(name: str, req: type[Any], res: type[Any]) -> MethodInfo[Any, Any]:
        return _method(PROCESS_SERVICE, name, req, res)

    prefix = f"/{PROCESS_SERVICE}/"
    return {
        prefix + "List": Endpoint.unary(m("List", pr.ListRequest, pr.ListResponse), svc.list),
        prefix + "Connect": Endpoint.server_stream(
            m("Connect", pr.ConnectRequest, pr.ConnectResponse), with_deadline(svc.connect)
        ),
        prefix + "Start": Endpoint.server_stream(
            m("Start", pr.StartRequest, pr.StartResponse), with_deadline(svc.start)
        ),
        prefix + "Update": Endpoint.unary(m("Update", pr.UpdateRequest, pr.UpdateResponse), svc.update),
        prefix + "StreamInput": Endpoint.client_stream(
            m("StreamInput", pr.StreamInputRequest, pr.StreamInputResponse), svc.stream_input
        ),
        prefix + "SendInput": Endpoint.unary(
            m("SendInput", pr.SendInputRequest, pr.SendInputResponse), svc.send_input
        ),
        prefix + "SendSignal": Endpoint.unary(
            m("SendSignal", pr.SendSignalRequest, pr.SendSignalResponse), svc.send_signal
        ),
        prefix + "CloseStdin": Endpoint.unary(
            m("CloseStdin", pr.CloseStdinRequest, pr.CloseStdinResponse), svc.close_stdin
        ),
    }


def _filesystem_endpoints(svc: FilesystemService) -> Mapping[str, Any]:
    def m(name: str, req: type[Any], res: type[Any]) -> MethodInfo[Any, Any]:
        return _method(FILESYSTEM_SERVICE, name, req, res)

    prefix = f"/{FILESYSTEM_SERVICE}/"
    return {
        prefix + "Stat": Endpoint.unary(m("Stat", fs.StatRequest, fs.StatResponse), svc.stat),
        prefix + "MakeDir": Endpoint.unary(m("MakeDir", fs.MakeDirRequest, fs.MakeDirResponse), svc.make_dir),
        prefix + "Move": Endpoint.unary(m("Move", fs.MoveRequest, fs.MoveResponse), svc.move),
        prefix + "ListDir": Endpoint.unary(m("ListDir", fs.ListDirRequest, fs.ListDirResponse), svc.list_dir),
        prefix + "Remove": Endpoint.unary(m("Remove", fs.RemoveRequest, fs.RemoveResponse), svc.remove),
        prefix + "WatchDir": Endpoint.server_stream(
            m("WatchDir", fs.WatchDirRequest, fs.WatchDirResponse), with_deadline(svc.watch_dir)
        ),
        prefix + "CreateWatcher": Endpoint.unary(
            m("CreateWatcher", fs.CreateWatcherRequest, fs.CreateWatcherResponse), svc.create_watcher
        ),
        prefix + "GetWatcherEvents": Endpoint.unary(
            m("GetWatcherEvents", fs.GetWatcherEventsRequest, fs.GetWatcherEventsResponse),
            svc.get_watcher_events,
        ),
        prefix + "RemoveWatcher": Endpoint.unary(
            m("RemoveWatcher", fs.RemoveWatcherRequest, fs.RemoveWatcherResponse), svc.remove_watcher
        ),
    }


def process_app(service: ProcessService) -> ConnectASGIApplication[Any]:
    return _ServiceApp(PROCESS_SERVICE, service, _process_endpoints)


def filesystem_app(service: FilesystemService) -> ConnectASGIApplication[Any]:
    return _ServiceApp(FILESYSTEM_SERVICE, service, _filesystem_endpoints)


class _StrictDecode:
    """A codec whose undecodable input is the client's fault (INVALID_ARGUMENT), not a server error."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"cannot decode {message_class.__name__} ({self.name()}): {exc}"
            ) from None


CODECS: list[Codec[Any, Any]] = [_StrictDecode(proto_binary_codec()), _StrictDecode(proto_json_codec())]
