"""Children as they come up (our extension, README "API extensions"): a streaming fork and N
sandboxes from a stored snapshot in one call.

E2B's ``POST /sandboxes/{id}/fork`` answers once every child is up, so an RL group's rollouts all
wait for its slowest child. These routes answer ``application/x-ndjson``, one line per sandbox
as soon as it is up (``{"sandbox": {...}}``, the body a create returns) or has failed
(``{"error": {"code", "message"}}``), ``count`` lines in all, in the order they came up:

* ``POST /sandboxes/{sandboxID}/fork/stream`` - body ``{"count", "timeout"}`` as E2B's fork; a
  paused parent (frozen or on disk) is forked from its pause state and stays paused.
* ``POST /snapshots/{snapshotID}/sandboxes`` - ``count`` sandboxes from a user snapshot: the body
  of a create (``timeout``, ``metadata``, ``envVars``, ``allow_internet_access``, ``network``)
  plus ``count``; each is an ordinary create (standbys first), secured as ``/v2/sandboxes``.

Whatever fails the whole call (unknown sandbox or snapshot, a bad count, a parent that cannot be
forked) is an ordinary E2B error before the first line. Each child's timeout starts when its line
is written. A client that goes away mid-stream does not leak: the children it was not sent are
killed once they are up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from forkyard.api.auth import require_api_key
from forkyard.api.routes_lifecycle import SandboxForkRequest
from forkyard.api.routes_sandboxes import Orch, _create_request, check_timeout, public_domain, sandbox_body
from forkyard.api.schemas import NewSandbox
from forkyard.errors import ForkyardError, NotFound, error_body
from forkyard.orchestrator.ids import normalise_sandbox_id
from forkyard.orchestrator.lifecycle import FORK_PARALLELISM, MAX_FORK_COUNT, ForkOutcome, Orchestrator

router = APIRouter(dependencies=[Depends(require_api_key)])

NDJSON = "application/x-ndjson"

#: Starts the sandboxes, handing each outcome to the callback as it comes; returns them all.
Start = Callable[[Callable[[ForkOutcome], None]], Awaitable[list[ForkOutcome]]]


class SnapshotSandboxesRequest(NewSandbox):
    """A create's body without ``templateID`` (the path names the snapshot), plus ``count``."""

    template_id: str = Field("", alias="templateID", max_length=128)
    count: int = Field(1, ge=1, le=MAX_FORK_COUNT)


@router.post("/sandboxes/{sandbox_id}/fork/stream")
async def fork_stream(
    request: Request, sandbox_id: str, orch: Orch, body: SandboxForkRequest | None = None
) -> StreamingResponse:
    req = body or SandboxForkRequest.model_validate({})
    timeout = check_timeout(req.timeout)
    sid = normalise_sandbox_id(sandbox_id)

    def start(each: Callable[[ForkOutcome], None]) -> Awaitable[list[ForkOutcome]]:
        return orch.fork(sid, req.count, timeout, each)

    return await stream_outcomes(orch, start, req.count, public_domain(request))


@router.post("/snapshots/{snapshot_id}/sandboxes")
async def sandboxes_from_snapshot(
    request: Request, snapshot_id: str, orch: Orch, body: SnapshotSandboxesRequest
) -> StreamingResponse:
    row = await orch.catalog.find_user_snapshot(snapshot_id)
    if row is None:
        raise NotFound(f"snapshot '{snapshot_id}' not found")
    create = body.model_copy(update={"template_id": row.snapshot_id})
    req = _create_request(create, secure=True, default_timeout=orch.settings.default_timeout_seconds)
    gate = asyncio.Semaphore(FORK_PARALLELISM)  # as a fork's restores: a burst of N on a small node

    async def one(each: Callable[[ForkOutcome], None]) -> ForkOutcome:
        async with gate:
            try:
                outcome = ForkOutcome(await orch.create(req), None)
            except ForkyardError as exc:
                outcome = ForkOutcome(None, exc)
        each(outcome)
        return outcome

    async def start(each: Callable[[ForkOutcome], None]) -> list[ForkOutcome]:
        return list(await asyncio.gather(*(one(each) for _ in range(body.count))))

    return await stream_outcomes(orch, start, body.count, public_domain(request))


async def stream_outcomes(orch: Orchestrator, start: Start, count: int, domain: str) -> StreamingResponse:
    """Run ``start`` and answer its outcomes as NDJSON lines, as they come. An error before the
    first outcome is the call's own (raised: an ordinary error answer)."""
    queue: asyncio.Queue[ForkOutcome] = asyncio.Queue()
    job = asyncio.ensure_future(start(queue.put_nowait))
    first = await _next(queue, job)
    if first is None:
        raise AssertionError("a stream of sandboxes ended without one")
    return StreamingResponse(_lines(orch, job, queue, first, count, domain), media_type=NDJSON)


async def _next(
    queue: asyncio.Queue[ForkOutcome], job: asyncio.Future[list[ForkOutcome]]
) -> ForkOutcome | None:
    """The next outcome; None when the job is over without more; the job's error if it failed."""
    if queue.empty() and not job.done():
        getter = asyncio.ensure_future(queue.get())
        waited: set[asyncio.Future[object]] = {
            cast("asyncio.Future[object]", getter),
            cast("asyncio.Future[object]", job),
        }
        try:
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
    if not queue.empty():
        return queue.get_nowait()
    job.result()  # every outcome is queued before the job returns: raises its error, if any
    return None


async def _lines(
    orch: Orchestrator,
    job: asyncio.Future[list[ForkOutcome]],
    queue: asyncio.Queue[ForkOutcome],
    first: ForkOutcome,
    count: int,
    domain: str,
) -> AsyncIterator[bytes]:
    sent: set[str] = set()
    lines = 0
    outcome: ForkOutcome | None = first
    try:
        while outcome is not None:
            yield _line(outcome, domain)
            lines += 1
            if outcome.record is not None:
                sent.add(outcome.record.sandbox_id)
            outcome = await _next(queue, job) if lines < count else None
    finally:
        if lines < count:  # the client went away: kill what it was never sent
            orch.background.spawn(_kill_unsent(orch, job, sent), name="kill-unsent-children")


def _line(outcome: ForkOutcome, domain: str) -> bytes:
    if outcome.record is not None:
        item: dict[str, object] = {"sandbox": sandbox_body(outcome.record, domain)}
    else:
        assert outcome.error is not None
        item = {"error": error_body(outcome.error)}
    return json.dumps(item).encode() + b"\n"


async def _kill_unsent(orch: Orchestrator, job: asyncio.Future[list[ForkOutcome]], sent: set[str]) -> None:
    with contextlib.suppress(Exception):
        outcomes = await job
        for outcome in outcomes:
            if outcome.record is not None and outcome.record.sandbox_id not in sent:
                with contextlib.suppress(ForkyardError):
                    await orch.kill(outcome.record.sandbox_id)
