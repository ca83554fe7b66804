"""Bits every Connect handler needs: the acting user, keepalive pacing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from forkyard.envd.state import EnvdState
from forkyard.envd.users import User, username_from_authorization
from forkyard.errors import Unauthenticated

#: The SDK asks for this interval in seconds (e2b.connection_config.KEEPALIVE_PING_HEADER).
KEEPALIVE_HEADER = "keepalive-ping-interval"
DEFAULT_KEEPALIVE_SECONDS = 50.0
_MIN_KEEPALIVE_SECONDS = 0.5

T = TypeVar("T")


def request_user(state: EnvdState, ctx: RequestContext[Any, Any]) -> User:
    """The user the RPC acts as; the only error kind that reaches the Connect services, so it is
    turned into its Connect code here."""
    try:
        return state.user(username_from_authorization(ctx.request_headers.get("authorization")))
    except Unauthenticated as exc:
        raise ConnectError(Code.UNAUTHENTICATED, exc.message) from None


def keepalive_interval(ctx: RequestContext[Any, Any]) -> float:
    raw = ctx.request_headers.get(KEEPALIVE_HEADER)
    if not raw:
        return DEFAULT_KEEPALIVE_SECONDS
    try:
        return max(_MIN_KEEPALIVE_SECONDS, float(raw))
    except ValueError:
        return DEFAULT_KEEPALIVE_SECONDS


async def with_keepalives(queue: asyncio.Queue[T | None], interval: float, keepalive: T) -> AsyncIterator[T]:
    """Items of ``queue`` until its ``None`` sentinel, with ``keepalive`` whenever it is quiet.

    Keepalives also let the Connect server notice a client that went away (it checks for a
    disconnect each time a message is sent).
    """
    while True:
        try:
            item = queue.get_nowait()  # busy stream: skip the timer wait_for sets up
        except asyncio.QueueEmpty:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=interval)
            except TimeoutError:
                yield keepalive
                continue
        if item is None:
            return
        yield item
