"""Pause, resume, snapshots and fork (openapi.yml): the E2B lifecycle endpoints; rollback in
place is our extension (README, "API extensions").

A create from a snapshot is an ordinary ``POST /sandboxes`` whose ``templateID`` names the
snapshot (routes_sandboxes); the orchestrator tells templates and snapshots apart.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from forkyard.api.auth import require_api_key
from forkyard.api.routes_sandboxes import Orch, check_timeout, public_domain, sandbox_body
from forkyard.api.schemas import _Request
from forkyard.errors import error_body
from forkyard.orchestrator.ids import normalise_sandbox_id
from forkyard.storage.snapshots import SnapshotRow

router = APIRouter(dependencies=[Depends(require_api_key)])


class SandboxPauseRequest(_Request):
    memory: bool = True
    require_healthy_guest: bool | None = Field(None, alias="requireHealthyGuest")


class ResumedSandbox(_Request):
    timeout: int = Field(15, ge=0, le=2**31 - 1)
    auto_pause: bool | None = Field(None, alias="autoPause")


class SandboxSnapshotRequest(_Request):
    name: str | None = Field(None, max_length=128)
    memory: bool = True


class SandboxForkRequest(_Request):
    timeout: int = Field(15, ge=0, le=2**31 - 1)
    count: int = Field(1, ge=1)


class SandboxRollbackRequest(_Request):
    """Our extension (E2B has no rollback): the user snapshot to put the sandbox back to."""

    snapshot_id: str = Field(alias="snapshotID", min_length=1, max_length=128)


def snapshot_info(row: SnapshotRow) -> dict[str, object]:
    return {"snapshotID": row.snapshot_id, "names": [row.name or row.snapshot_id]}


async def snapshot_body(orch: Orch, row: SnapshotRow) -> dict[str, object]:
    """E2B's snapshot info plus our ``storage`` (README, "API extensions"): whether the snapshot
    store holds it (``durable``), whether this node has its copy (``cached``), its upload time."""
    body = snapshot_info(row)
    storage = await orch.catalog.storage_info(row.snapshot_id)
    if storage is not None:
        body["storage"] = storage
    return body


# -- pause / resume ----------------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(sandbox_id: str, orch: Orch, body: SandboxPauseRequest | None = None) -> Response:
    # memory=false: E2B's filesystem-only pause (processes end, files stay; a resume reboots).
    await orch.pause(normalise_sandbox_id(sandbox_id), memory=body.memory if body else True)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume(
    request: Request, sandbox_id: str, orch: Orch, body: ResumedSandbox | None = None
) -> JSONResponse:
    timeout = check_timeout(body.timeout if body else 15)
    rec = await orch.resume(normalise_sandbox_id(sandbox_id), timeout)
    return JSONResponse(sandbox_body(rec, public_domain(request)), status_code=201)


# -- snapshots ---------------------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(
    sandbox_id: str, orch: Orch, body: SandboxSnapshotRequest | None = None
) -> JSONResponse:
    row = await orch.create_snapshot(normalise_sandbox_id(sandbox_id), body.name if body else None)
    return JSONResponse(await snapshot_body(orch, row), status_code=201)


@router.get("/snapshots")
async def list_snapshots(
    orch: Orch,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
    name: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 100,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> JSONResponse:
    rows = await orch.list_snapshots(normalise_sandbox_id(sandbox_id) if sandbox_id else None, name)
    start = int(next_token) if next_token and next_token.isascii() and next_token.isdigit() else 0
    page = rows[start : start + limit]
    headers = {"x-next-token": str(start + limit)} if start + limit < len(rows) else {}
    return JSONResponse([await snapshot_body(orch, r) for r in page], headers=headers)


# -- fork --------------------------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(
    request: Request, sandbox_id: str, orch: Orch, body: SandboxForkRequest | None = None
) -> JSONResponse:
    req = body or SandboxForkRequest.model_validate({})
    outcomes = await orch.fork(normalise_sandbox_id(sandbox_id), req.count, check_timeout(req.timeout))
    domain = public_domain(request)
    results: list[dict[str, object]] = []
    for outcome in outcomes:
        if outcome.record is not None:
            results.append({"sandbox": sandbox_body(outcome.record, domain)})
        else:
            assert outcome.error is not None
            results.append({"error": error_body(outcome.error)})
    return JSONResponse(results, status_code=201)


# -- rollback (our extension) ------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/rollback")
async def rollback(
    request: Request, sandbox_id: str, orch: Orch, body: SandboxRollbackRequest
) -> JSONResponse:
    """Put a running sandbox back to a snapshot in place: same id, timeout and metadata; the
    answer is the sandbox, as a resume's."""
    rec = await orch.rollback(normalise_sandbox_id(sandbox_id), body.snapshot_id)
    return JSONResponse(sandbox_body(rec, public_domain(request)), status_code=200)
