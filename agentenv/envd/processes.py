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
import termios
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from agentenv.envd.proto.process_pb import ProcessConfig, ProcessEvent
from agentenv.envd.users import User

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
    proc: asyncio.subprocess.Process
    pty_fd: int | None
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
    async def write_stdin(self, data: bytes) -> None:
        if self.pty_fd is not None:  # a PTY has one input: the terminal
            await self.write_pty(data)
            return
        writer = self.proc.stdin
        if writer is None:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"stdin of process {self.pid} is not enabled (start it with stdin=True)",
            )
        if writer.is_closing():
            raise ConnectError(Code.FAILED_PRECONDITION, f"stdin of process {self.pid} is closed")
        try:
            writer.write(data)
            await writer.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise ConnectError(Code.FAILED_PRECONDITION, f"stdin of process {self.pid} is closed") from None

    async def write_pty(self, data: bytes) -> None:
        if self.pty_fd is None:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid} has no PTY")
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.pty_fd, view)
            except BlockingIOError:
                await asyncio.sleep(0.005)  # terminal input buffer full: let the program read
                continue
            except OSError as exc:
                raise ConnectError(Code.FAILED_PRECONDITION, f"PTY of process {self.pid}: {exc}") from None
            view = view[written:]

    def close_stdin(self) -> None:
        if self.pty_fd is not None:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                "closing stdin is not supported for PTY processes; send Ctrl+D (0x04) instead",
            )
        writer = self.proc.stdin
        if writer is None:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"stdin of process {self.pid} is not enabled (start it with stdin=True)",
            )
        writer.close()

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


class ProcessTable:
    def __init__(self, stream_buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES) -> None:
        self._stream_buffer_bytes = stream_buffer_bytes
        self._by_pid: dict[int, ManagedProcess] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._spawning = 0

    def list(self) -> list[ManagedProcess]:
        return list(self._by_pid.values())

    def pids(self) -> set[int] | None:
        """Pids envd waits for itself; None while a spawn is in flight (see reaper)."""
        return None if self._spawning else set(self._by_pid)

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
    ) -> ManagedProcess:
        """Spawn and register. No output is read before the caller's next await, so a caller
        that subscribes right away sees everything."""
        self._spawning += 1
        try:
            if pty_size is not None:
                proc, master = await _spawn_on_pty(config, cwd, env, user, pty_size)
            else:
                proc, master = await _spawn_with_pipes(config, cwd, env, user, stdin), None
        except OSError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, f"failed to start '{config.cmd}': {exc}") from None
        finally:
            self._spawning -= 1
        managed = ManagedProcess(
            config=config, tag=tag, proc=proc, pty_fd=master, buffer_bytes=self._stream_buffer_bytes
        )
        self._by_pid[proc.pid] = managed
        task = asyncio.create_task(self._supervise(managed), name=f"envd-process-{proc.pid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return managed

    async def _supervise(self, managed: ManagedProcess) -> None:
        readers = _start_readers(managed)
        try:
            returncode = await managed.proc.wait()
            await _drain(managed, readers)
        finally:
            for reader in readers:
                reader.cancel()
            # Let the readers unregister before the fd is closed (and its number reused).
            await asyncio.gather(*readers, return_exceptions=True)
            if managed.pty_fd is not None:
                asyncio.get_running_loop().remove_reader(managed.pty_fd)
                os.close(managed.pty_fd)
                managed.pty_fd = None
            if managed.proc.stdin is not None:
                managed.proc.stdin.close()
        ended: Oneof[Literal["end"], ProcessEvent.EndEvent] = Oneof("end", describe_exit(returncode))
        managed.end = ProcessEvent(event=ended)  # from here on, new subscribers get it directly
        await managed.publish(managed.end)
        await managed.publish(None)
        managed.subscribers.clear()
        self._by_pid.pop(managed.pid, None)

    async def shutdown(self) -> None:
        for managed in self.list():
            managed.send_signal(signal.SIGKILL)


async def _exec(
    config: ProcessConfig, cwd: str, env: dict[str, str], user: User, **stdio: Any
) -> asyncio.subprocess.Process:
    """Start the command as ``user`` in a session of its own (it leads the group signals go to)."""
    uid, gid, groups = _identity(user)
    return await asyncio.create_subprocess_exec(
        config.cmd,
        *config.args,
        cwd=cwd,
        env=env,
        start_new_session=True,
        user=uid,
        group=gid,
        extra_groups=groups,
        **stdio,
    )


async def _spawn_with_pipes(
    config: ProcessConfig, cwd: str, env: dict[str, str], user: User, stdin: bool
) -> asyncio.subprocess.Process:
    stdin_pipe = asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL
    pipe = asyncio.subprocess.PIPE
    return await _exec(config, cwd, env, user, stdin=stdin_pipe, stdout=pipe, stderr=pipe)


async def _spawn_on_pty(
    config: ProcessConfig, cwd: str, env: dict[str, str], user: User, size: tuple[int, int]
) -> tuple[asyncio.subprocess.Process, int]:
    """The child gets a new session with the PTY's slave as controlling terminal; envd keeps the
    master (non-blocking) for output and input."""
    master, slave = pty.openpty()
    try:
        _set_winsize(slave, *size)
        proc = await _exec(
            config, cwd, env, user, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_set_controlling_tty
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    os.set_blocking(master, False)
    return proc, master


def _identity(user: User) -> tuple[int | None, int | None, list[int] | None]:
    """Drop to the user only when envd may (root); a non-root envd runs everything as itself."""
    if os.geteuid() != 0:
        return None, None, None
    return user.uid, user.gid, user.groups


def _start_readers(managed: ManagedProcess) -> list[asyncio.Task[None]]:
    if managed.pty_fd is not None:
        return [asyncio.create_task(_read_pty(managed, managed.pty_fd))]
    readers = []
    pipes: tuple[tuple[OutputStream, asyncio.StreamReader | None], ...] = (
        ("stdout", managed.proc.stdout),
        ("stderr", managed.proc.stderr),
    )
    for name, stream in pipes:
        if stream is not None:
            readers.append(asyncio.create_task(_read_pipe(managed, name, stream)))
    return readers


def _empty(queue: OutputQueue) -> None:
    while not queue.empty():
        queue.get_nowait()


async def _read_pipe(managed: ManagedProcess, name: OutputStream, stream: asyncio.StreamReader) -> None:
    while chunk := await stream.read(_READ_CHUNK):
        await managed.output(name, chunk)


async def _read_pty(managed: ManagedProcess, fd: int) -> None:
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    try:
        while True:
            await readable.wait()
            readable.clear()
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EIO:  # every slave end closed: the terminal hung up
                    return
                raise
            if not chunk:
                return
            await managed.output("pty", chunk)
    finally:
        loop.remove_reader(fd)


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
