"""Sandboxes as they come up: a fork's children and N sandboxes from a snapshot, each handed out the
moment it answers, not when the last one does.

Two calls of ours (README, "API extensions"), answered as NDJSON, one line per sandbox as it is
up: ``POST /sandboxes/{id}/fork/stream`` (a running or paused parent; a paused one stays paused)
and ``POST /snapshots/{id}/sandboxes`` (``count`` creates from a stored snapshot in one call).
Against a server without them (E2B's own) the same iterators fall back to the SDK: one ``fork``
call (its children all at once, at most 20 per call) and ``count`` concurrent creates from the
snapshot, each handed out as it returns.

Each line becomes an SDK ``AsyncSandbox`` by the SDK's own ``connect`` (its timeout is
``lifetime`` from then on, the server-side backstop for a trainer that dies).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from forkyard_rl.api import Connection

if TYPE_CHECKING:
    from e2b import AsyncSandbox, ConnectionConfig

#: Seconds between two lines a streaming call may take (a restore on a loaded node, plus the queue
#: of restores before it).
STREAM_READ_TIMEOUT_SECONDS = 300.0
#: The SDK refuses more per fork call (its ``validate_fork_count``).
SDK_MAX_FORK_COUNT = 20


@dataclass(frozen=True)
class Started:
    """One sandbox of a streaming call: up (``sandbox``; ``template_id`` as the server reports it,
    a fork child's checkpoint) or failed (``error``)."""

    sandbox: AsyncSandbox | None
    template_id: str | None = None
    error: Exception | None = None


class StreamError(Exception):
    """The server refused the whole call; ``code`` and ``message`` are its answer (E2B's shape)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class _NoExtension(Exception):
    """The server does not have the route (E2B's own API): use the SDK's calls instead."""


async def fork_stream(
    parent: AsyncSandbox, count: int, *, lifetime: int = 300, use_extension: bool = True
) -> AsyncIterator[Started]:
    """``count`` children of ``parent`` (running, or paused: it stays paused), each yielded as soon
    as it is up. ``lifetime``: their server-side timeout in seconds."""
    if count < 1:
        raise ValueError("fork at least one child")
    config = parent.connection_config
    url = f"/sandboxes/{parent.sandbox_id}/fork/stream"
    try:
        if not use_extension:
            raise _NoExtension
        async for started in _stream(config, url, {"count": count, "timeout": lifetime}, lifetime):
            yield started
    except _NoExtension:
        for start in range(0, count, SDK_MAX_FORK_COUNT):
            n = min(SDK_MAX_FORK_COUNT, count - start)
            for child in await parent.fork(timeout=lifetime, count=n):
                if isinstance(child, Exception):
                    yield Started(None, error=child)
                else:
                    yield Started(child)


async def from_snapshot(
    snapshot_id: str,
    count: int,
    *,
    lifetime: int = 300,
    metadata: dict[str, str] | None = None,
    envs: dict[str, str] | None = None,
    connection: Connection | None = None,
    use_extension: bool = True,
) -> AsyncIterator[Started]:
    """``count`` sandboxes from the stored snapshot ``snapshot_id`` in one call, each yielded as
    soon as it is up (the server claims the snapshot's standbys first)."""
    from e2b import ConnectionConfig

    if count < 1:
        raise ValueError("start at least one sandbox")
    opts = (connection or Connection()).opts()
    config = ConnectionConfig(**opts)
    body: dict[str, Any] = {"count": count, "timeout": lifetime, "metadata": metadata or {}}
    if envs:
        body["envVars"] = envs
    try:
        if not use_extension:
            raise _NoExtension
        async for started in _stream(config, f"/snapshots/{snapshot_id}/sandboxes", body, lifetime):
            yield started
    except _NoExtension:
        async for started in _creates(snapshot_id, count, lifetime, metadata, envs, opts):
            yield started


async def _creates(
    snapshot_id: str,
    count: int,
    lifetime: int,
    metadata: dict[str, str] | None,
    envs: dict[str, str] | None,
    opts: dict[str, Any],
) -> AsyncIterator[Started]:
    """``count`` concurrent SDK creates, yielded in the order they return."""
    from e2b import AsyncSandbox

    async def one() -> Started:
        try:
            sandbox = await AsyncSandbox.create(
                snapshot_id, timeout=lifetime, metadata=metadata, envs=envs, **opts
            )
        except Exception as exc:
            return Started(None, error=exc)
        return Started(sandbox, snapshot_id)

    tasks = [asyncio.ensure_future(one()) for _ in range(count)]
    try:
        for next_done in asyncio.as_completed(tasks):
            yield await next_done
    finally:
        for task in tasks:
            task.cancel()


async def _stream(
    config: ConnectionConfig, path: str, body: dict[str, Any], lifetime: int
) -> AsyncIterator[Started]:
    from e2b import AsyncSandbox

    params = config.get_api_params()
    timeout = httpx.Timeout(config.request_timeout or 60.0, read=STREAM_READ_TIMEOUT_SECONDS)
    async with (
        httpx.AsyncClient(timeout=timeout, trust_env=False) as client,
        client.stream(
            "POST",
            config.api_url.rstrip("/") + path,
            json=body,
            headers={**config.headers, "X-API-Key": config.api_key or ""},
        ) as response,
    ):
        await _check(response)
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            item = json.loads(line)
            if "sandbox" not in item:
                error = item.get("error") or {}
                yield Started(None, error=StreamError(int(error.get("code", 500)), str(error.get("message"))))
                continue
            info = item["sandbox"]
            try:
                sandbox = await AsyncSandbox.connect(info["sandboxID"], timeout=lifetime, **params)
            except Exception as exc:  # gone meanwhile (killed, or its node lost): a failed member
                yield Started(None, error=exc)
                continue
            yield Started(sandbox, info.get("templateID"))


async def _check(response: httpx.Response) -> None:
    """Raise the server's refusal; :class:`_NoExtension` when it does not know the route."""
    if response.status_code < 300:
        return
    await response.aread()
    try:
        message = str(response.json().get("message", response.text))
    except ValueError:
        message = response.text
    if response.status_code in (404, 405) and message.strip().lower() in ("not found", "method not allowed"):
        raise _NoExtension  # the route's own 404 (a sandbox's or snapshot's 404 names it)
    raise StreamError(response.status_code, message)
