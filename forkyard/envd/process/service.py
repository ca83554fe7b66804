"""``process.Process``: Start, Connect, List, SendInput, StreamInput, SendSignal, Update, CloseStdin."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from forkyard.envd.process.loginenv import LoginEnvironments, LoginKey, login_script
from forkyard.envd.process.processes import ManagedProcess, ProcessTable, StreamOverflow
from forkyard.envd.proto.process_pb import (
    CloseStdinRequest,
    CloseStdinResponse,
    ConnectRequest,
    ConnectResponse,
    ListRequest,
    ListResponse,
    ProcessConfig,
    ProcessEvent,
    ProcessInfo,
    ProcessInput,
    ProcessSelector,
    SendInputRequest,
    SendInputResponse,
    SendSignalRequest,
    SendSignalResponse,
    Signal,
    StartRequest,
    StartResponse,
    StreamInputRequest,
    StreamInputResponse,
    UpdateRequest,
    UpdateResponse,
)
from forkyard.envd.rpc_common import keepalive_interval, request_user, with_keepalives
from forkyard.envd.state import EnvdState
from forkyard.envd.users import User, resolve_path

_KEEPALIVE_EVENT: Oneof[Literal["keepalive"], ProcessEvent.KeepAlive] = Oneof(
    "keepalive", ProcessEvent.KeepAlive()
)
_KEEPALIVE = ProcessEvent(event=_KEEPALIVE_EVENT)
_SIGNALS = {Signal.SIGTERM: signal.SIGTERM, Signal.SIGKILL: signal.SIGKILL}


def _start_event(pid: int) -> ProcessEvent:
    started: Oneof[Literal["start"], ProcessEvent.StartEvent] = Oneof(
        "start", ProcessEvent.StartEvent(pid=pid)
    )
    return ProcessEvent(event=started)


class ProcessService:
    def __init__(self, state: EnvdState, table: ProcessTable, logins: LoginEnvironments) -> None:
        self._state = state
        self._table = table
        self._logins = logins

    # --- streams -------------------------------------------------------------------------------
    async def start(
        self, request: StartRequest, ctx: RequestContext[StartRequest, StartResponse]
    ) -> AsyncIterator[StartResponse]:
        config = request.process
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        user = request_user(self._state, ctx)
        pty_size = None
        if request.pty is not None:
            size = request.pty.size
            cols, rows = (size.cols, size.rows) if size is not None else (80, 24)
            pty_size = (cols or 80, rows or 24)
        # Unset means true, for SDKs older than the flag (process.proto).
        stdin = request.stdin if request.has_field("stdin") else True
        cwd = self._cwd(config, user)
        env = self._state.process_env(user, dict(config.envs))
        argv = None
        script = login_script(config, stdin=stdin, pty=pty_size is not None)
        if script is not None:  # `bash -l -c`: start it in the captured login if there is one
            login = self._logins.lookup(LoginKey.of(user, cwd, env))
            if login is not None:
                argv, cwd, env = login.argv(script), login.cwd, login.env
        managed = await self._table.start(
            config,
            user=user,
            cwd=cwd,
            env=env,
            tag=request.tag if request.has_field("tag") else None,
            stdin=stdin,
            pty_size=pty_size,
            argv=argv,
        )
        async for event in self._follow(managed, ctx):
            yield StartResponse(event=event)

    async def connect(
        self, request: ConnectRequest, ctx: RequestContext[ConnectRequest, ConnectResponse]
    ) -> AsyncIterator[ConnectResponse]:
        managed = self._select(request.process)
        async for event in self._follow(managed, ctx):
            yield ConnectResponse(event=event)

    async def _follow(
        self, managed: ManagedProcess, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[ProcessEvent]:
        queue = managed.subscribe()  # before the first await, so no output is missed
        try:
            yield _start_event(managed.pid)
            events: AsyncIterator[ProcessEvent | StreamOverflow] = with_keepalives(
                queue, keepalive_interval(ctx), _KEEPALIVE
            )
            async for event in events:
                if isinstance(event, ProcessEvent):
                    yield event
                else:  # dropped: it took no output for too long
                    raise ConnectError(
                        Code.ABORTED,  # not RESOURCE_EXHAUSTED: the SDK reads that as a rate limit
                        f"stream fell behind process {managed.pid}'s output and was dropped; connect again",
                    )
        finally:
            # A client leaving only detaches it; the process keeps running.
            managed.unsubscribe(queue)

    # --- unary ---------------------------------------------------------------------------------
    async def list(
        self, request: ListRequest, ctx: RequestContext[ListRequest, ListResponse]
    ) -> ListResponse:
        return ListResponse(
            processes=[ProcessInfo(config=p.config, pid=p.pid, tag=p.tag) for p in self._table.list()]
        )

    async def send_input(
        self, request: SendInputRequest, ctx: RequestContext[SendInputRequest, SendInputResponse]
    ) -> SendInputResponse:
        await self._write(self._select(request.process), request.input)
        return SendInputResponse()

    async def stream_input(
        self,
        requests: AsyncIterator[StreamInputRequest],
        ctx: RequestContext[StreamInputRequest, StreamInputResponse],
    ) -> StreamInputResponse:
        managed: ManagedProcess | None = None
        async for message in requests:
            event = message.event.value if message.event is not None else None
            if isinstance(event, StreamInputRequest.StartEvent):
                managed = self._select(event.process)
            elif isinstance(event, StreamInputRequest.DataEvent):
                if managed is None:
                    raise ConnectError(Code.FAILED_PRECONDITION, "the first message must be a start event")
                await self._write(managed, event.input)
            # keepalives only keep the stream open
        return StreamInputResponse()

    async def send_signal(
        self, request: SendSignalRequest, ctx: RequestContext[SendSignalRequest, SendSignalResponse]
    ) -> SendSignalResponse:
        signum = _SIGNALS.get(request.signal)
        if signum is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal!r}")
        self._select(request.process).send_signal(signum)
        return SendSignalResponse()

    async def update(
        self, request: UpdateRequest, ctx: RequestContext[UpdateRequest, UpdateResponse]
    ) -> UpdateResponse:
        managed = self._select(request.process)
        if request.pty is not None and request.pty.size is not None:
            managed.resize(request.pty.size.cols, request.pty.size.rows)
        return UpdateResponse()

    async def close_stdin(
        self, request: CloseStdinRequest, ctx: RequestContext[CloseStdinRequest, CloseStdinResponse]
    ) -> CloseStdinResponse:
        self._select(request.process).close_stdin()
        return CloseStdinResponse()

    # --- helpers -------------------------------------------------------------------------------
    def _select(self, selector: ProcessSelector | None) -> ManagedProcess:
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=int(pid)):
                return self._table.find(pid=pid)
            case Oneof(field="tag", value=str(tag)):
                return self._table.find(tag=tag)
        raise ConnectError(Code.INVALID_ARGUMENT, "a process selector (pid or tag) is required")

    async def _write(self, managed: ManagedProcess, data: ProcessInput | None) -> None:
        match data.input if data is not None else None:
            case Oneof(field="stdin", value=chunk):
                await managed.write_stdin(chunk)
            case Oneof(field="pty", value=chunk):
                await managed.write_pty(chunk)
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "input needs stdin or pty data")

    def _cwd(self, config: ProcessConfig, user: User) -> str:
        if config.has_field("cwd") and config.cwd:
            cwd = resolve_path(config.cwd, user)
            if not os.path.isdir(cwd):
                raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist or is not a directory")
            return cwd
        return self._state.command_cwd(user)
