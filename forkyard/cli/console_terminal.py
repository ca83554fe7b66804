"""``forkyard sandbox connect``: this terminal attached to a PTY in the sandbox.

The PTY is envd's (``process.Start`` with a ``pty``), opened through the official SDK exactly as
``sandbox.pty.create`` does. Output is streamed on a thread; the main thread puts the local terminal
in raw mode (so Ctrl-C, Ctrl-D, arrows and tab reach the remote shell untouched), forwards
keystrokes with ``send_stdin`` and forwards the window size on SIGWINCH. It returns the remote
shell's exit code.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import threading
import tty
from collections.abc import Callable, Iterator
from functools import partial
from types import FrameType

from e2b import CommandExitException, PtySize, Sandbox

#: Ctrl-D: what a terminal sends at end of input; sent once when a piped stdin ends.
EOT = b"\x04"
READ_CHUNK = 4096


def terminal_size(fd: int) -> PtySize:
    try:
        cols, rows = os.get_terminal_size(fd)
    except OSError:  # not a terminal (piped input): the usual default
        cols, rows = 80, 24
    return PtySize(rows=rows, cols=cols)


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """Raw input while attached; the terminal's settings are restored on every way out."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class _Session:
    def __init__(self, sandbox: Sandbox, size: PtySize, envs: dict[str, str]) -> None:
        self.sandbox = sandbox
        self.handle = sandbox.pty.create(size, envs=envs, timeout=0)
        self.exit_code: int | None = None
        self.error: Exception | None = None
        self.done = threading.Event()
        # The pipe wakes the input loop's select() when the shell exits or the window changes.
        self._wake_r, self._wake_w = os.pipe()
        self._resized = False

    def pump_output(self) -> None:
        out = sys.stdout.buffer

        def write(data: bytes) -> None:
            out.write(data)
            out.flush()

        try:
            self.exit_code = self.handle.wait(on_pty=write).exit_code
        except CommandExitException as exc:
            self.exit_code = exc.exit_code
        except Exception as exc:  # reported by the caller once the terminal is restored
            self.error = exc
        finally:
            self.done.set()
            os.write(self._wake_w, b"x")

    def on_winch(self, _signum: int, _frame: FrameType | None) -> None:
        self._resized = True
        os.write(self._wake_w, b"w")

    def forward_input(self, fd: int) -> None:
        eof = False
        while not self.done.is_set():
            readable, _, _ = select.select([self._wake_r] if eof else [fd, self._wake_r], [], [])
            if self._wake_r in readable:
                os.read(self._wake_r, 64)
            if self._resized:
                self._resized = False
                self._quietly(lambda: self.sandbox.pty.resize(self.handle.pid, terminal_size(fd)))
            if fd in readable and not eof:
                data = os.read(fd, READ_CHUNK)
                if not data:  # piped input ended: end the shell's input as a terminal would
                    eof, data = True, EOT
                self._quietly(partial(self.sandbox.pty.send_stdin, self.handle.pid, data))

    def _quietly(self, call: Callable[[], object]) -> None:
        """Input racing the shell's exit fails harmlessly; other failures end the session."""
        try:
            call()
        except Exception:
            if not self.done.is_set():
                raise

    def close(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)


def attach(sandbox: Sandbox) -> int:
    """Run an interactive login shell in ``sandbox`` on this terminal; its exit code."""
    fd = sys.stdin.fileno()
    envs = {"TERM": os.environ.get("TERM") or "xterm-256color"}
    session = _Session(sandbox, terminal_size(fd), envs)
    pump = threading.Thread(target=session.pump_output, name="pty-output", daemon=True)
    previous = signal.signal(signal.SIGWINCH, session.on_winch)
    try:
        with raw_mode(fd):
            pump.start()
            session.forward_input(fd)
        pump.join(timeout=5)
    finally:
        signal.signal(signal.SIGWINCH, previous)
        session.close()
    if session.error is not None:
        raise session.error
    return session.exit_code if session.exit_code is not None else 1
