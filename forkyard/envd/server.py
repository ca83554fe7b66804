"""Starts uvicorn with the envd app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import selectors
import sys
from types import FrameType
from typing import TYPE_CHECKING

from forkyard.envd import hardening, lean
from forkyard.envd.settings import parse_settings

if TYPE_CHECKING:
    from uvicorn import Server

#: uvicorn's exit status when the server could not start (uvicorn.config.STARTUP_FAILURE).
STARTUP_FAILURE = 3


def poll_loop() -> asyncio.AbstractEventLoop:
    """An asyncio loop on poll(2), not epoll: gVisor (runsc 2022-12) refuses to checkpoint a TCP
    socket that still has waiters, and an epoll set keeps a waiter on every registered socket
    between calls, while poll's waiters live only during the (interruptible) call. Needed for
    pause/snapshot/fork of gVisor sandboxes (docs/SNAPSHOTS.md)."""
    return asyncio.SelectorEventLoop(selectors.PollSelector())


def _quiet(server_class: type[Server]) -> type[Server]:
    """uvicorn's ``Server`` without its 10 Hz tick: its ``main_loop`` wakes every 100 ms to see
    whether a signal asked it to exit (and to refresh the Date header). An idle sandbox spent
    ~10 ms of CPU per second on such wake-ups under gVisor, and every idle sandbox on a node does
    it. Here the main loop waits until the signal handler wakes it."""

    class QuietServer(server_class):  # type: ignore[valid-type,misc]
        _exit_requested: asyncio.Event | None = None
        _loop: asyncio.AbstractEventLoop | None = None

        async def main_loop(self) -> None:
            self._loop = asyncio.get_running_loop()
            self._exit_requested = asyncio.Event()
            if not await self.on_tick(0):  # sets the default headers once
                await self._exit_requested.wait()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            if self._loop is not None and self._exit_requested is not None:
                self._loop.call_soon_threadsafe(self._exit_requested.set)

    return QuietServer


def log_to_stderr(level: str) -> None:
    """envd's own loggers (``forkyard.envd.*``) at ``--log-level``; uvicorn configures only its own."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:  %(name)s: %(message)s"))
    envd_log = logging.getLogger("forkyard.envd")
    envd_log.addHandler(handler)
    envd_log.setLevel(level.upper())


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    log_to_stderr(settings.log_level)
    # Before anything else runs: nothing in the sandbox may stop envd or read its memory.
    hardening.protect_from_tracing()
    # envd's memory is in every checkpoint image: keep what it never uses out (lean.py), before
    # anything imports connectrpc or uvicorn.
    lean.defer_http_client()
    config_class, server_class = lean.uvicorn_server()
    from forkyard.envd.http.app import create_app

    quiet_server = _quiet(server_class)

    config = config_class(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        http="h11",
        # envd has no WebSocket routes; "auto" would import the websockets package and its C
        # extension into every sandbox's memory image.
        ws="none",
        loop="forkyard.envd.server:poll_loop",
        lifespan="on",
        log_level=settings.log_level,
        access_log=False,
        # Refreshed by uvicorn's 10 Hz tick, which envd does not run (_quiet); no client needs it.
        date_header=False,
        timeout_keep_alive=60,
        # Process and watch streams stay open indefinitely; don't let them hold a shutdown up.
        timeout_graceful_shutdown=3,
    )
    # What uvicorn.run does for one process without reload.
    server = quiet_server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
