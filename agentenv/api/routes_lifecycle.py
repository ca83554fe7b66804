"""Pause, resume, snapshots and fork (openapi.yml): the E2B lifecycle endpoints.

Registered before ``routes_sandboxes``: ``POST /sandboxes`` and ``/v2/sandboxes`` are answered
here when ``templateID`` names a snapshot (a restore), and handed on otherwise.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from agentenv.api import routes_sandboxes
from agentenv.api.auth import require_api_key
from agentenv.api.errors import ApiError
from agentenv.api.schemas import MAX_TIMEOUT_SECONDS, NewSandbox, _Request
from agentenv.orchestrator.ids import normalise_sandbox_id
from agentenv.orchestrator.service import Orchestrator
from agentenv.orchestrator.snapshots import SnapshotService, service_of
from agentenv.storage.snapshots import SnapshotRow

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


def _orch(request: Request) -> Orchestrator:
    orch: Orchestrator = request.app.state.orchestrator
    return orch


def _service(request: Request) -> SnapshotService:
    return service_of(_orch(request))


Service = Annotated[SnapshotService, Depends(_service)]


def snapshot_info(row: SnapshotRow) -> dict[str, object]:
    return {"snapshotID": row.snapshot_id, "names": [row.name or row.snapshot_id]}


def _timeout(value: int) -> int:
    if value > MAX_TIMEOUT_SECONDS:
        raise ApiError(400, f"timeout cannot be greater than {MAX_TIMEOUT_SECONDS} seconds (24 hours)")
    return value


# -- create from a snapshot --------------------------------------------------------------------


async def _create(request: Request, body: NewSandbox, service: SnapshotService, *, secure: bool,
                  idempotency_key: str | None) -> JSONResponse:
    row = await service.find_snapshot(body.template_id)
    if row is None:
        return await routes_sandboxes._create(
            request, _orch(request), body, secure=secure, idempotency_key=idempotency_key
        )
    req = routes_sandboxes._create_request(
        body, secure=secure, default_timeout=_orch(request).settings.default_timeout_seconds
    )
    rec = await service.create_from_snapshot(row, req)
    return JSONResponse(routes_sandboxes.sandbox_body(rec, routes_sandboxes.public_domain(request)),
                        status_code=201)


@router.post("/sandboxes", status_code=201)
async def create_sandbox(
    request: Request, body: NewSandbox, service: Service,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    return await _create(request, body, service, secure=bool(body.secure), idempotency_key=idempotency_key)


@router.post("/v2/sandboxes", status_code=201)
async def create_sandbox_v2(
    request: Request, body: NewSandbox, service: Service,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    return await _create(request, body, service, secure=True, idempotency_key=idempotency_key)


# -- pause / resume ----------------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(sandbox_id: str, service: Service, body: SandboxPauseRequest | None = None) -> Response:
    await service.pause(normalise_sandbox_id(sandbox_id))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume(request: Request, sandbox_id: str, service: Service,
                 body: ResumedSandbox | None = None) -> JSONResponse:
    timeout = _timeout(body.timeout if body else 15)
    rec = await service.resume(normalise_sandbox_id(sandbox_id), timeout)
    return JSONResponse(routes_sandboxes.sandbox_body(rec, routes_sandboxes.public_domain(request)),
                        status_code=201)


# -- snapshots ---------------------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(sandbox_id: str, service: Service,
                          body: SandboxSnapshotRequest | None = None) -> JSONResponse:
    row = await service.create_snapshot(normalise_sandbox_id(sandbox_id), body.name if body else None)
    return JSONResponse(snapshot_info(row), status_code=201)


@router.get("/snapshots")
async def list_snapshots(
    service: Service,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
    name: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 100,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> JSONResponse:
    rows = await service.list_snapshots(normalise_sandbox_id(sandbox_id) if sandbox_id else None, name)
    start = int(next_token) if next_token and next_token.isdigit() else 0
    page = rows[start:start + limit]
    headers = {"x-next-token": str(start + limit)} if start + limit < len(rows) else {}
    return JSONResponse([snapshot_info(r) for r in page], headers=headers)


@router.delete("/templates/{template_id}", status_code=204)
async def delete_snapshot(template_id: str, service: Service) -> Response:
    """Snapshots are templates in E2B: the SDK's ``delete_snapshot`` deletes the template."""
    if not await service.delete_snapshot(template_id):
        raise ApiError(404, f"template '{template_id}' not found")
    return Response(status_code=204)


# -- fork --------------------------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(request: Request, sandbox_id: str, service: Service,
               body: SandboxForkRequest | None = None) -> JSONResponse:
    req = body or SandboxForkRequest.model_validate({})
    outcomes = await service.fork(normalise_sandbox_id(sandbox_id), req.count, _timeout(req.timeout))
    domain = routes_sandboxes.public_domain(request)
    results: list[dict[str, object]] = []
    for outcome in outcomes:
        if outcome.record is not None:
            results.append({"sandbox": routes_sandboxes.sandbox_body(outcome.record, domain)})
        else:
            assert outcome.error is not None
            results.append({"error": {"code": outcome.error.code, "message": outcome.error.message}})
    return JSONResponse(results, status_code=201)
