"""Starts uvicorn with the envd app."""

from __future__ import annotations

import asyncio
import selectors

import uvicorn

from agentenv.envd.app import create_app
from agentenv.envd.settings import parse_settings


def poll_loop() -> asyncio.AbstractEventLoop:
    """An asyncio loop on poll(2), not epoll: gVisor (runsc 2022-12) refuses to checkpoint a TCP
    socket that still has waiters, and an epoll set keeps a waiter on every registered socket
    between calls, while poll's waiters live only during the (interruptible) call. Needed for
    pause/snapshot/fork of gVisor sandboxes (docs/SNAPSHOTS.md)."""
    return asyncio.SelectorEventLoop(selectors.PollSelector())


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        http="h11",
        loop="agentenv.envd.server:poll_loop",
        lifespan="on",
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=60,
        # Process and watch streams stay open indefinitely; don't let them hold a shutdown up.
        timeout_graceful_shutdown=3,
    )
