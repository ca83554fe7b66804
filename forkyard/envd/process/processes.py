"""Running processes: spawn (pipes or a PTY), fan output out to every attached stream, input, signals.

A process outlives the stream that started it: closing a Start stream (a background command whose
handle was dropped) only unsubscribes that stream. The process leaves the table once it has exited
and its end event went out to every subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import pty
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from forkyard.envd.process.spawn import Identity, Spawner, Stdio, identity_for
from forkyard.envd.proto.process_pb import ProcessConfig, ProcessEvent
from forkyard.envd.users import User

_READ_CHUNK = 64 * 1024
#: After the main process exits, output still buffered in the pipes is drained; a grandchild that
#: keeps the pipe open (``cmd &``) must not hold the end event back, so draining stops once output
#: pauses this long, and after _DRAIN_MAX at the latest.
_DRAIN_IDLE = 0.15
_DRAIN_MAX = 3.0


def _set_controlling_tty() -> None:  # runs in the child between fork and exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def describe_exit(returncode: int) -> ProcessEvent.EndEvent:
    """End event with Go's ProcessState wording (``exit status 1``, ``signal: killed``)."""
    if returncode >= 0:
        status = f"exit status {returncode}"
        end = ProcessEvent.EndEvent(exit_code=returncode, exited=True, status=status)
        if returncode != 0:
            end.error = status
        return end
    signum = -returncode
    try:
        name = (signal.strsignal(signum) or f"signal {signum}").lower()
    except ValueError:
        name = f"signal {signum}"
    status = f"signal: {name}"
    return ProcessEvent.EndEvent(exit_code=-1, exited=False, status=status, error=status)


OutputStream = Literal["stdout", "stderr", "pty"]
#: Output bytes buffered per attached stream by default. Within it a client may fall behind without
#: slowing the process (a background command whose handle nobody reads yet); past it the output
#: readers wait, so the process is slowed through its pipe, as a terminal would slow it, instead
#: of envd's memory growing with the output.
DEFAULT_STREAM_BUFFER_BYTES = 32 * 1024 * 1024
#: A client whose buffer stays full this long is dropped rather than holding the process up.
_STALLED_CLIENT_SECONDS = 10.0


class StreamOverflow:
    """Queue item telling a stream it was dropped for not keeping up."""


OVERFLOW = StreamOverflow()
StreamItem = ProcessEvent | StreamOverflow | None


def _payload_size(item: StreamItem) -> int:
    if isinstance(item, ProcessEvent) and item.event is not None and item.event.field == "data":
        data = item.event.value
        if isinstance(data, ProcessEvent.DataEvent) and data.output is not None:
            return len(data.output.value)
    return 0


class OutputQueue(asyncio.Queue[StreamItem]):
    """A queue that is full by bytes of output held, not by number of events."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self._budget = budget
        self._held = 0

    def full(self) -> bool:
        return self._held >= self._budget

    def _put(self, item: StreamItem) -> None:
        super()._put(item)
        self._held += _payload_size(item)

    def _get(self) -> StreamItem:
        item = super()._get()
        self._held -= _payload_size(item)
        return item


def _data_event(stream: OutputStream, chunk: bytes) -> ProcessEvent:
    output: Oneof[OutputStream, bytes] = Oneof(stream, chunk)
    data: Oneof[Literal["data"], ProcessEvent.DataEvent] = Oneof(
        "data",
        ProcessEvent.DataEvent(output=output),  # type: ignore[arg-type]  # one of the three streams
    )
    return ProcessEvent(event=data)


@dataclass(eq=False)
class ManagedProcess:
    config: ProcessConfig
    tag: str | None
    proc: subprocess.Popen[bytes]
    exited: asyncio.Future[int]
    pty_fd: int | None
    #: our end of its stdin pipe; None when stdin is disabled, closed, or a PTY
    stdin_fd: int | None = None
    stdin_enabled: bool = False
    #: our ends of its stdout/stderr pipes, or the PTY master
    outputs: tuple[tuple[OutputStream, int], ...] = ()
    buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES
    subscribers: set[OutputQueue] = field(default_factory=set)
    end: ProcessEvent | None = None
    _last_output: float = 0.0
    #: output readers currently waiting for a slow client (see _drain)
    _publishing: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def subscribe(self) -> OutputQueue:
        queue = OutputQueue(self.buffer_bytes)
        if self.end is not None:  # exited between lookup and attach: hand over the end at once
            queue.put_nowait(self.end)
            queue.put_nowait(None)
        else:
            self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: OutputQueue) -> None:
        self.subscribers.discard(queue)
        _empty(queue)  # releases a reader waiting for room in it

    async def publish(self, item: ProcessEvent | None) -> None:
        for queue in list(self.subscribers):
            if queue not in self.subscribers:
                continue  # left while we waited for another client
            if not queue.full():
                queue.put_nowait(item)
                continue
            try:
                await asyncio.wait_for(queue.put(item), timeout=_STALLED_CLIENT_SECONDS)
            except TimeoutError:
                self.subscribers.discard(queue)
                _empty(queue)
                queue.put_nowait(OVERFLOW)

    async def output(self, stream: OutputStream, chunk: bytes) -> None:
        self._publishing += 1
        try:
            await self.publish(_data_event(stream, chunk))
        finally:
            self._publishing -= 1
            self._last_output = time.monotonic()

    # --- input ---------------------------------------------------------------------------------
    def _stdin_unavailable(self, why: str) -> ConnectError:
        return ConnectError(Code.FAILED_PRECONDITION, f"stdin of process {self.pid} {why}")

    async def write_stdin(self, data: bytes) -> None:
        if self.pty_fd is not None:  # a PTY has one input: the terminal
            await self.write_pty(data)
            return
        if not self.stdin_enabled:
            raise self._stdin_unavailable("is not enabled (start it with stdin=True)")
        if self.stdin_fd is None:
            raise self._stdin_unavailable("is closed")
        try:
            await write_all(self.stdin_fd, data)
        except (BrokenPipeError, ConnectionResetError):
            raise self._stdin_unavailable("is closed") from None

    async def write_pty(self, data: bytes) -> None:
        if self.pty_fd is None:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid} has no PTY")
        try:
            await write_all(self.pty_fd, data)  # a full terminal input buffer waits for the program
        except OSError as exc:
            raise ConnectError(Code.FAILED_PRECONDITION, f"PTY of process {self.pid}: {exc}") from None

    def close_stdin(self) -> None:
        if self.pty_fd is not None:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                "closing stdin is not supported for PTY processes; send Ctrl+D (0x04) instead",
            )
        if not self.stdin_enabled:
            raise self._stdin_unavailable("is not enabled (start it with stdin=True)")
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None

    def resize(self, cols: int, rows: int) -> None:
        if self.pty_fd is None:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid} has no PTY to resize")
        if cols <= 0 or rows <= 0:
            raise ConnectError(Code.INVALID_ARGUMENT, "PTY size needs cols and rows greater than 0")
        _set_winsize(self.pty_fd, cols, rows)

    def send_signal(self, signum: int) -> None:
        if self.end is not None:
            return
        # Each process leads its own session, so the group takes the command's children with it.
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)
        except PermissionError:
            os.kill(self.pid, signum)

    def close_fds(self) -> None:
        """Once it exited and its output was read: our pipe ends and the PTY master."""
        for _, fd in self.outputs:
            os.close(fd)
        self.outputs = ()
        self.pty_fd = None  # it was one of the outputs
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None


class ProcessTable:
    def __init__(self, spawner: Spawner, stream_buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES) -> None:
        self._spawner = spawner
        self._stream_buffer_bytes = stream_buffer_bytes
        self._by_pid: dict[int, ManagedProcess] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def list(self) -> list[ManagedProcess]:
        return list(self._by_pid.values())

    def find(self, pid: int | None = None, tag: str | None = None) -> ManagedProcess:
        if pid is not None:
            found = self._by_pid.get(pid)
            if found is not None:
                return found
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
        for proc in self._by_pid.values():
            if tag is not None and proc.tag == tag:
                return proc
        raise ConnectError(Code.NOT_FOUND, f"process with tag '{tag}' not found")

    async def start(
        self,
        config: ProcessConfig,
        *,
        user: User,
        cwd: str,
        env: dict[str, str],
        tag: str | None,
        stdin: bool,
        pty_size: tuple[int, int] | None,
        argv: Sequence[str] | None = None,
    ) -> ManagedProcess:
        """Spawn and register. No output is read before the caller's next await, so a caller
        that subscribes right away sees everything. ``argv`` (default: the config's command)
        is what actually runs; ``config`` is what List reports."""
        command = list(argv) if argv is not None else [config.cmd, *config.args]
        launch = _Launch(self._spawner, command, cwd, env, identity_for(user.uid, user.gid, user.groups))
        try:
            if pty_size is not None:
                managed = await launch.on_pty(config, tag, pty_size)
            else:
                managed = await launch.with_pipes(config, tag, stdin)
        except OSError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, f"failed to start '{config.cmd}': {exc}") from None
        managed.buffer_bytes = self._stream_buffer_bytes
        self._by_pid[managed.pid] = managed
        task = asyncio.create_task(self._supervise(managed), name=f"envd-process-{managed.pid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return managed

    async def _supervise(self, managed: ManagedProcess) -> None:
        readers = [asyncio.create_task(_read_output(managed, name, fd)) for name, fd in managed.outputs]
        try:
            returncode = await managed.exited
            await _drain(managed, readers)
        finally:
            for reader in readers:
                reader.cancel()
            # Let the readers unregister before the fds are closed (and their numbers reused).
            await asyncio.gather(*readers, return_exceptions=True)
            managed.close_fds()
        ended: Oneof[Literal["end"], ProcessEvent.EndEvent] = Oneof("end", describe_exit(returncode))
        managed.end = ProcessEvent(event=ended)  # from here on, new subscribers get it directly
        await managed.publish(managed.end)
        await managed.publish(None)
        managed.subscribers.clear()
        self._by_pid.pop(managed.pid, None)

    async def shutdown(self) -> None:
        for managed in self.list():
            managed.send_signal(signal.SIGKILL)


@dataclass
class _Launch:
    """One command to start: on pipes or on a PTY."""

    spawner: Spawner
    argv: list[str]
    cwd: str
    env: dict[str, str]
    user: Identity | None

    async def with_pipes(self, config: ProcessConfig, tag: str | None, stdin: bool) -> ManagedProcess:
        ours: list[int] = []
        theirs: list[int] = []
        try:
            stdio = Stdio(
                stdin=child_pipe(ours, theirs, child_reads=True) if stdin else subprocess.DEVNULL,
                stdout=child_pipe(ours, theirs),
                stderr=child_pipe(ours, theirs),
            )
            popen = await self.spawner.start(
                self.argv, cwd=self.cwd, env=self.env, user=self.user, stdio=stdio
            )
        except BaseException:
            close_all(ours)
            raise
        finally:
            close_all(theirs)
        stdin_fd = ours.pop(0) if stdin else None
        out_fd, err_fd = ours
        return ManagedProcess(
            config=config,
            tag=tag,
            proc=popen,
            exited=self.spawner.wait(popen),
            pty_fd=None,
            stdin_fd=stdin_fd,
            stdin_enabled=stdin,
            outputs=(("stdout", out_fd), ("stderr", err_fd)),
        )

    async def on_pty(self, config: ProcessConfig, tag: str | None, size: tuple[int, int]) -> ManagedProcess:
        """The child gets a new session with the PTY's slave as controlling terminal; envd keeps
        the master (non-blocking) for output and input."""
        master, slave = pty.openpty()
        try:
            _set_winsize(slave, *size)
            popen = await self.spawner.start(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                user=self.user,
                stdio=Stdio(slave, slave, slave),
                controlling_tty=_set_controlling_tty,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        exited = self.spawner.wait(popen)
        return ManagedProcess(
            config=config, tag=tag, proc=popen, exited=exited, pty_fd=master, outputs=(("pty", master),)
        )


def child_pipe(ours: list[int], theirs: list[int], *, child_reads: bool = False) -> int:
    """A pipe between envd and a child to be: envd's end (non-blocking) goes to ``ours``, the
    child's to ``theirs`` (closed once it started) and is returned, for its Stdio."""
    read_end, write_end = os.pipe()
    mine, childs = (write_end, read_end) if child_reads else (read_end, write_end)
    os.set_blocking(mine, False)
    ours.append(mine)
    theirs.append(childs)
    return childs


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _empty(queue: OutputQueue) -> None:
    while not queue.empty():
        queue.get_nowait()


async def _fd_ready(fd: int, register: Callable[..., None], unregister: Callable[[int], object]) -> None:
    """Until ``fd`` is readable/writable. Registered only while waiting: a readable pipe left
    registered while we wait for a slow client would spin the event loop."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    register(fd, wake)
    try:
        await ready
    finally:
        unregister(fd)


async def read_chunk(fd: int) -> bytes:
    """The next chunk from a non-blocking pipe or PTY master; b"" at the end (for a PTY: every
    slave end closed, which reads as EIO)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            await _fd_ready(fd, loop.add_reader, loop.remove_reader)
        except OSError as exc:
            if exc.errno == errno.EIO:
                return b""
            raise


async def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` into a non-blocking pipe or PTY, waiting while it is full."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await _fd_ready(fd, loop.add_writer, loop.remove_writer)


async def _read_output(managed: ManagedProcess, name: OutputStream, fd: int) -> None:
    while chunk := await read_chunk(fd):
        await managed.output(name, chunk)


async def _drain(managed: ManagedProcess, readers: list[asyncio.Task[None]]) -> None:
    """Read what the exited process left in its pipes/PTY until EOF, or until the output pauses
    (a grandchild holds the pipe open). Time spent waiting for slow clients doesn't count."""
    quiet_budget = _DRAIN_MAX
    pending = {r for r in readers if not r.done()}
    while pending and quiet_budget > 0:
        _, pending = await asyncio.wait(pending, timeout=_DRAIN_IDLE)
        if managed._publishing:
            continue
        if time.monotonic() - managed._last_output >= _DRAIN_IDLE:
            break
        quiet_budget -= _DRAIN_IDLE
