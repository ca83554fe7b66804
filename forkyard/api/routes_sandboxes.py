"""``/sandboxes``, ``/v2/sandboxes``: the sandbox control plane of E2B's openapi.yml."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from forkyard.api import code_interpreter
from forkyard.api.auth import require_api_key
from forkyard.api.e2b_wire import (
    LIST_LIMIT_MAX,
    decode_cursor,
    encode_cursor,
    listed_body,
    listed_fields,
    parse_metadata_query,
    parse_states,
)
from forkyard.api.image_sandboxes import requested_image, template_for_image
from forkyard.api.routes_network import create_network
from forkyard.api.routes_volumes import resolve_mounts
from forkyard.api.schemas import (
    MAX_TIMEOUT_SECONDS,
    ConnectSandbox,
    NetworkInfo,
    NewSandbox,
    Sandbox,
    SandboxDetail,
    SandboxLifecycle,
    SandboxLog,
    SandboxLogEntry,
    SandboxMetric,
    SandboxRefreshRequest,
    SandboxTimeoutRequest,
)
from forkyard.errors import Invalid
from forkyard.orchestrator import templates
from forkyard.orchestrator.ids import normalise_sandbox_id
from forkyard.orchestrator.lifecycle import CreateRequest, Orchestrator
from forkyard.orchestrator.logs import LEVELS, log_record
from forkyard.orchestrator.metrics_history import MetricSample
from forkyard.orchestrator.store import ListQuery, LogLine, SandboxRecord
from forkyard.types import SandboxState, VolumeMount

router = APIRouter(dependencies=[Depends(require_api_key)])


def orchestrator(request: Request) -> Orchestrator:
    orch: Orchestrator = request.app.state.orchestrator
    return orch


Orch = Annotated[Orchestrator, Depends(orchestrator)]


def public_domain(request: Request) -> str:
    """The ``domain`` for this request's answers: the listener's (HTTP or HTTPS) that took it."""
    domain: str = request.app.state.public_domain
    return domain


# -- serialisation -----------------------------------------------------------------------------


def sandbox_body(rec: SandboxRecord, domain: str) -> dict[str, object]:
    return Sandbox(
        template_id=rec.template_id,
        sandbox_id=rec.sandbox_id,
        alias=rec.alias,
        client_id=rec.client_id,
        envd_version=rec.envd_version,
        envd_access_token=rec.envd_access_token,
        traffic_access_token=rec.traffic_access_token,
        domain=domain,
    ).to_json()


def detail_body(rec: SandboxRecord, domain: str) -> dict[str, object]:
    net = rec.network
    detail = SandboxDetail.model_validate(
        {
            **listed_fields(rec),
            "envd_access_token": rec.envd_access_token,
            "allow_internet_access": net.allow_internet_access,
            "domain": domain,
            "network": NetworkInfo(
                allow_public_traffic=rec.traffic_access_token is None,
                allow_out=[*net.egress.allow_out, *net.egress.allow_domains] if net.egress else [],
                deny_out=list(net.egress.deny_out if net.egress else ()),
                mask_request_host=net.mask_request_host,
                dns_servers=list(net.dns_servers) if net.dns_servers is not None else None,
            ),
            "lifecycle": SandboxLifecycle(
                auto_resume=rec.auto_resume, on_timeout="pause" if rec.auto_pause else "kill"
            ),
        }
    )
    body = detail.to_json()
    if isinstance(body.get("network"), dict):  # unset optional network fields stay out
        body["network"] = {k: v for k, v in body["network"].items() if v is not None}
    return body


def metric_body(sample: MetricSample) -> dict[str, object]:
    m = sample.metrics
    return SandboxMetric(
        timestamp=sample.at,
        timestamp_unix=int(sample.at.timestamp()),
        cpu_count=m.cpu_count,
        cpu_used_pct=m.cpu_used_pct,
        mem_used=m.mem_used,
        mem_total=m.mem_total,
        disk_used=m.disk_used,
        disk_total=m.disk_total,
    ).to_json()


# -- create ------------------------------------------------------------------------------------


def check_timeout(seconds: int) -> int:
    if seconds > MAX_TIMEOUT_SECONDS:
        raise Invalid(f"timeout cannot be greater than {MAX_TIMEOUT_SECONDS} seconds (24 hours)")
    return seconds


def _create_request(
    body: NewSandbox, *, secure: bool, default_timeout: int, volumes: tuple[VolumeMount, ...] = ()
) -> CreateRequest:
    timeout = body.timeout if body.timeout is not None else default_timeout
    check_timeout(timeout)
    if body.auto_resume and body.auto_resume.enabled and not body.auto_pause:
        raise Invalid("autoResume requires autoPause")
    if body.auto_resume and body.auto_resume.enabled and not body.auto_pause_memory:
        # openapi.yml: a filesystem-only snapshot is never auto-resumed by traffic.
        raise Invalid("autoResume cannot be combined with autoPauseMemory=false")
    network = body.network
    policy = create_network(network, secure=secure, allow_internet_access=body.allow_internet_access)
    return CreateRequest(
        template_id=body.template_id,
        timeout_seconds=timeout,
        metadata=body.metadata or {},
        envs=body.env_vars or {},
        secure=secure,
        network=policy,
        auto_pause=body.auto_pause,
        auto_pause_memory=body.auto_pause_memory,
        auto_resume=bool(body.auto_resume and body.auto_resume.enabled),
        allow_public_traffic=network.allow_public_traffic is not False if network else True,
        volumes=volumes,
    )


async def _create(
    request: Request, orch: Orchestrator, body: NewSandbox, *, secure: bool, idempotency_key: str | None
) -> JSONResponse:
    image = requested_image(body.template_id, body.metadata, orch.settings)
    if image is not None:
        body = body.model_copy(update={"template_id": await template_for_image(request, image)})
    mounts = [(m.name, m.path) for m in body.volume_mounts or ()]
    volumes = await resolve_mounts(request, mounts) if mounts else ()
    req = _create_request(
        body, secure=secure, default_timeout=orch.settings.default_timeout_seconds, volumes=volumes
    )
    try:
        rec = await orch.create(req, idempotency_key=idempotency_key)
    except templates.TemplateNotFound:
        building = code_interpreter.not_ready_error(request.app.state, req.template_id)
        if building is not None:
            raise building from None
        raise
    return JSONResponse(sandbox_body(rec, public_domain(request)), status_code=201)


@router.post("/sandboxes", status_code=201)
async def create_sandbox(
    request: Request,
    body: NewSandbox,
    orch: Orch,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    return await _create(request, orch, body, secure=bool(body.secure), idempotency_key=idempotency_key)


@router.post("/v2/sandboxes", status_code=201)
async def create_sandbox_v2(
    request: Request,
    body: NewSandbox,
    orch: Orch,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    # v2: "All system communication with the sandbox is always secured".
    return await _create(request, orch, body, secure=True, idempotency_key=idempotency_key)


# -- list --------------------------------------------------------------------------------------


@router.get("/v2/sandboxes")
async def list_sandboxes_v2(
    orch: Orch,
    metadata: str | None = None,
    state: Annotated[list[str] | None, Query()] = None,
    order: str = "desc",
    started_after: Annotated[dt.datetime | None, Query(alias="startedAfter")] = None,
    template: str | None = None,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
    limit: Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX)] = LIST_LIMIT_MAX,
) -> JSONResponse:
    if order not in ("asc", "desc"):
        raise Invalid(f"invalid order {order!r}: expected 'asc' or 'desc'")
    states = parse_states(state)
    query = ListQuery(
        states=states,
        metadata=parse_metadata_query(metadata),
        template=template,
        started_after=started_after,
        ascending=order == "asc",
        after=decode_cursor(next_token) if next_token else None,
        limit=limit,
    )
    recs = await orch.list_sandboxes(query)
    headers = {}
    if len(recs) > limit:
        recs = recs[:limit]
        headers["X-Next-Token"] = encode_cursor(recs[-1])
    if SandboxState.RUNNING in states:
        running = await orch.list_sandboxes(
            ListQuery(
                states=(SandboxState.RUNNING,),
                metadata=query.metadata,
                template=template,
                started_after=started_after,
            )
        )
        headers["X-Total-Running"] = str(len(running))
    return JSONResponse([listed_body(r) for r in recs], headers=headers)


@router.get("/sandboxes")
async def list_sandboxes_v1(orch: Orch, metadata: str | None = None) -> JSONResponse:
    recs = await orch.list_sandboxes(
        ListQuery(states=(SandboxState.RUNNING,), metadata=parse_metadata_query(metadata))
    )
    return JSONResponse([listed_body(r) for r in recs])


# -- metrics (before /sandboxes/{id} so "metrics" is not taken for an id) -------------------------


@router.get("/metrics", include_in_schema=False)
async def node_metrics(orch: Orch) -> Response:
    """Our extension (not E2B's): the node's lifecycle timings and sandboxes by state and pause
    tier, in Prometheus' text format (behind the API key like everything else)."""
    return Response(await orch.node_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/sandboxes/metrics")
async def sandboxes_metrics(
    orch: Orch, sandbox_ids: Annotated[list[str] | None, Query()] = None
) -> JSONResponse:
    ids = [normalise_sandbox_id(s) for item in sandbox_ids or [] for s in item.split(",") if s.strip()]
    if not ids:
        raise Invalid("sandbox_ids is required (comma-separated sandbox IDs)")
    if len(set(ids)) > 100:
        raise Invalid("at most 100 sandbox_ids per request")
    out: dict[str, object] = {}
    for sid in dict.fromkeys(ids):
        rec = await orch.store.get(sid)
        if rec is None or rec.state != SandboxState.RUNNING:
            continue
        samples = await orch.metrics(sid)
        if samples:
            out[sid] = metric_body(samples[-1])
    return JSONResponse({"sandboxes": out})


# -- one sandbox -------------------------------------------------------------------------------


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(request: Request, sandbox_id: str, orch: Orch) -> JSONResponse:
    rec = await orch.get(normalise_sandbox_id(sandbox_id))
    return JSONResponse(detail_body(rec, public_domain(request)))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, orch: Orch) -> Response:
    await orch.kill(normalise_sandbox_id(sandbox_id))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: SandboxTimeoutRequest, orch: Orch) -> Response:
    await orch.set_timeout(normalise_sandbox_id(sandbox_id), check_timeout(body.timeout))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(sandbox_id: str, orch: Orch, body: SandboxRefreshRequest | None = None) -> Response:
    duration = body.duration if body and body.duration is not None else 60
    await orch.refresh(normalise_sandbox_id(sandbox_id), duration)
    return Response(status_code=204)


async def _connect(
    request: Request, sandbox_id: str, body: ConnectSandbox, orch: Orchestrator
) -> JSONResponse:
    timeout = check_timeout(
        body.timeout if body.timeout is not None else orch.settings.default_timeout_seconds
    )
    rec, resumed = await orch.connect(normalise_sandbox_id(sandbox_id), timeout)
    return JSONResponse(sandbox_body(rec, public_domain(request)), status_code=201 if resumed else 200)


@router.post("/sandboxes/{sandbox_id}/connect")
async def connect(request: Request, sandbox_id: str, body: ConnectSandbox, orch: Orch) -> JSONResponse:
    return await _connect(request, sandbox_id, body, orch)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_v2(request: Request, sandbox_id: str, body: ConnectSandbox, orch: Orch) -> JSONResponse:
    return await _connect(request, sandbox_id, body, orch)


#: The last millisecond a datetime holds (9999-12-31T23:59:59.999Z): later log cursors are a 400,
#: not an OverflowError.
MAX_UNIX_MS = 253_402_300_799_999


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(
    sandbox_id: str,
    orch: Orch,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
) -> JSONResponse:
    if start is not None and end is not None and start > end:
        raise Invalid("start must not be after end")
    samples = await orch.metrics(normalise_sandbox_id(sandbox_id))
    chosen = [
        s
        for s in samples
        if (start is None or s.at.timestamp() >= start) and (end is None or s.at.timestamp() <= end)
    ]
    return JSONResponse([metric_body(s) for s in chosen])


# -- logs --------------------------------------------------------------------------------------

_LEVELS = LEVELS


@router.get("/sandboxes/{sandbox_id}/logs")
async def sandbox_logs_v1(
    sandbox_id: str,
    orch: Orch,
    start: Annotated[int | None, Query(ge=0, le=MAX_UNIX_MS)] = None,
    limit: Annotated[int, Query(ge=0)] = 1000,
) -> JSONResponse:
    since = dt.datetime.fromtimestamp(start / 1000, dt.UTC) if start is not None else None
    sandbox_id = normalise_sandbox_id(sandbox_id)
    lines = await orch.sandbox_logs(sandbox_id, start=since, limit=limit)
    return JSONResponse(
        {
            "logs": [
                SandboxLog(timestamp=ln.timestamp, line=log_record(ln, sandbox_id)).to_json() for ln in lines
            ],
            "logEntries": [_entry(ln) for ln in lines],
        }
    )


def _entry(ln: LogLine) -> dict[str, object]:
    level = ln.level if ln.level in _LEVELS else "info"
    return SandboxLogEntry(
        timestamp=ln.timestamp,
        message=ln.message,
        level=level,  # type: ignore[arg-type]
        fields=ln.fields,
    ).to_json()


@router.get("/v2/sandboxes/{sandbox_id}/logs")
async def sandbox_logs_v2(
    sandbox_id: str,
    orch: Orch,
    cursor: Annotated[int | None, Query(ge=0, le=MAX_UNIX_MS)] = None,
    limit: Annotated[int, Query(ge=0, le=1000)] = 1000,
    direction: str = "forward",
    level: str | None = None,
    search: Annotated[str | None, Query(max_length=256)] = None,
) -> JSONResponse:
    if direction not in ("forward", "backward"):
        raise Invalid(f"invalid direction {direction!r}: expected 'forward' or 'backward'")
    if level is not None and level not in _LEVELS:
        raise Invalid(f"invalid level {level!r}: expected one of {', '.join(_LEVELS)}")
    since = dt.datetime.fromtimestamp(cursor / 1000, dt.UTC) if cursor is not None else None
    lines = await orch.sandbox_logs(
        normalise_sandbox_id(sandbox_id), start=since, limit=10_000, ascending=direction == "forward"
    )
    min_level = _LEVELS.index(level) if level else 0
    chosen = [
        ln
        for ln in lines
        if _LEVELS.index(ln.level if ln.level in _LEVELS else "info") >= min_level
        and (search is None or search in ln.message)
    ][:limit]
    return JSONResponse({"logs": [_entry(ln) for ln in chosen]})
