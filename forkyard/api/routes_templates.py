"""``/templates``: the templates of this node and E2B's build API (openapi.yml, ``templates`` and
``tags``): ``POST /v3/templates``, file upload links, ``POST /v2/templates/{id}/builds/{build}``,
build status and logs, tags, delete. Builds run in :mod:`forkyard.orchestrator.builder`."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from forkyard.api.auth import require_api_key
from forkyard.api.schemas import (
    AssignTemplateTagsRequest,
    DeleteTemplateTagsRequest,
    Template,
    TemplateBuildRequestV3,
    TemplateBuildStartV2,
)
from forkyard.config import Settings
from forkyard.errors import Invalid, NotFound
from forkyard.orchestrator import templates
from forkyard.orchestrator.builder import (
    Build,
    BuildSpec,
    BuildStep,
    LogEntry,
    RegistryAuth,
    TemplateBuilder,
)
from forkyard.orchestrator.lifecycle import Orchestrator
from forkyard.orchestrator.templates import TemplateInfo
from forkyard.storage import templates as storage
from forkyard.types import ENVD_VERSION

router = APIRouter()
#: Every route but the upload link's own PUT (the SDK uploads without its API key, as to S3).
AUTH = [Depends(require_api_key)]
LOG_LEVELS = ("debug", "info", "warn", "error")


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def builder(request: Request) -> TemplateBuilder:
    """The node's builder (composed with the rest in ``build_orchestrator``)."""
    return node_builder(request.app.state)


def node_builder(state: Any) -> TemplateBuilder:
    """:func:`builder` from the app's state (start-up, where no request exists)."""
    orch: Orchestrator = state.orchestrator
    return orch.template_owner.builder


def _iso(value: dt.datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


def template_body(info: TemplateInfo) -> dict[str, object]:
    img = info.image
    return Template(
        template_id=img.template_id,
        build_id=info.build_id,
        cpu_count=img.vcpus,
        memory_mb=img.memory_mb,
        disk_size_mb=img.disk_mb,
        aliases=[img.template_id],
        names=[img.template_id],
        created_at=info.created_at,
        updated_at=info.created_at,
        envd_version=ENVD_VERSION,
    ).to_json()


@router.get("/templates", dependencies=AUTH)
async def list_templates(request: Request) -> JSONResponse:
    return JSONResponse([template_body(t) for t in templates.list_all(_settings(request))])


@router.get("/v2/templates", dependencies=AUTH)
async def list_templates_v2(request: Request) -> JSONResponse:
    return JSONResponse([template_body(t) for t in templates.list_all(_settings(request))])


def _load(request: Request, template_id: str) -> TemplateInfo:
    return templates.load(template_id, _settings(request))


@router.get("/templates/aliases/{alias}", dependencies=AUTH)
async def template_by_alias(request: Request, alias: str) -> JSONResponse:
    info = _load(request, alias)
    return JSONResponse({"templateID": info.image.template_id, "public": True})


def _build_json(build: Build, info: TemplateInfo | None) -> dict[str, Any]:
    updated = build.finished_at or (build.logs[-1].timestamp if build.logs else build.created_at)
    body: dict[str, Any] = {
        "buildID": build.build_id,
        "status": build.status,
        "createdAt": _iso(build.created_at),
        "updatedAt": _iso(updated),
        "cpuCount": build.cpu_count,
        "memoryMB": build.memory_mb,
        "envdVersion": ENVD_VERSION,
    }
    if build.finished_at:
        body["finishedAt"] = _iso(build.finished_at)
    if info is not None and info.build_id == build.build_id:
        body["diskSizeMB"] = info.image.disk_mb
    return body


def _stored_build_json(meta: dict[str, Any], info: TemplateInfo) -> dict[str, Any]:
    """A finished build from its ``template.json`` (the current or a kept one)."""
    created = str(meta.get("created_at") or _iso(info.created_at))
    return {
        "buildID": str(meta.get("build_id") or info.build_id),
        "status": "ready",
        "createdAt": created,
        "updatedAt": created,
        "finishedAt": created,
        "cpuCount": int(meta.get("vcpus", info.image.vcpus)),
        "memoryMB": int(meta.get("memory_mb", info.image.memory_mb)),
        "diskSizeMB": int(meta.get("disk_mb", info.image.disk_mb)),
        "envdVersion": ENVD_VERSION,
    }


@router.get("/templates/{template_id}", dependencies=AUTH)
async def get_template(request: Request, template_id: str) -> JSONResponse:
    """``TemplateWithBuilds``: the template, its current build and the builds this server ran."""
    try:
        info: TemplateInfo | None = _load(request, template_id)
    except templates.TemplateNotFound:
        info = None
    ran = builder(request).builds_of(storage.split_name(template_id)[0])
    if info is None and not ran:
        raise NotFound(f"template '{template_id}' not found")
    builds = [_build_json(b, info) for b in ran]
    if info is not None:
        tid, settings = info.image.template_id, _settings(request)
        stored = [*storage.kept_builds(tid, settings), storage.read_metadata(tid, settings)]
        known = {b.build_id for b in ran}
        for meta in reversed(stored):  # the builds a restarted server knows from disk
            if meta.get("build_id", info.build_id) not in known:
                builds.insert(0, _stored_build_json(meta, info))
    name = info.image.template_id if info else ran[0].template_id
    created = _iso(info.created_at) if info else _iso(ran[0].created_at)
    return JSONResponse(
        {
            "templateID": name,
            "public": True,
            "aliases": [name],
            "names": [name],
            "createdAt": created,
            "updatedAt": created,
            "lastSpawnedAt": None,
            "spawnCount": 0,
            "builds": builds,
        }
    )


# -- builds -------------------------------------------------------------------------------------


@router.post("/v3/templates", dependencies=AUTH)
async def request_build(request: Request, body: TemplateBuildRequestV3) -> JSONResponse:
    name = body.name or body.alias
    if not name:
        raise Invalid("name is required")
    build = builder(request).request(name, body.tags, body.cpu_count, body.memory_mb)
    return JSONResponse(
        {
            "templateID": build.template_id,
            "buildID": build.build_id,
            "public": False,
            "names": [build.template_id],
            "aliases": [build.template_id],
            "tags": build.tags,
        },
        status_code=202,
    )


@router.get("/templates/{template_id}/files/{files_hash}", dependencies=AUTH)
async def file_upload_link(request: Request, template_id: str, files_hash: str) -> JSONResponse:
    present, url = builder(request).upload_link(
        storage.split_name(template_id)[0], files_hash, str(request.base_url)
    )
    body: dict[str, object] = {"present": present}
    if url:
        body["url"] = url
    return JSONResponse(body, status_code=201)


@router.put("/templates/{template_id}/files/{files_hash}/upload")
async def upload_files(
    request: Request, template_id: str, files_hash: str, expires: int = Query(), signature: str = Query()
) -> Response:
    """Where an upload link points (ours; E2B's point at object storage): signed, no API key."""
    await builder(request).receive_upload(files_hash, expires, signature, request.stream())
    return Response(status_code=200)


def build_spec(body: TemplateBuildStartV2) -> BuildSpec:
    """The builder's spec of a ``TemplateBuildStartV2`` body (the CLI reads the same JSON)."""
    reg = body.from_image_registry
    return BuildSpec(
        from_template=body.from_template,
        from_image=body.from_image,
        registry=RegistryAuth(
            reg.type,
            reg.username,
            reg.password,
            reg.aws_access_key_id,
            reg.aws_secret_access_key,
            reg.aws_region,
            reg.service_account_json,
        )
        if reg
        else None,
        steps=[BuildStep(s.type, list(s.args), s.files_hash, s.force) for s in body.steps],
        start_cmd=body.start_cmd,
        ready_cmd=body.ready_cmd,
        force=body.force,
    )


@router.post("/v2/templates/{template_id}/builds/{build_id}", dependencies=AUTH)
async def start_build(
    request: Request, template_id: str, build_id: str, body: TemplateBuildStartV2
) -> Response:
    builder(request).start(storage.split_name(template_id)[0], build_id, build_spec(body))
    return Response(status_code=202)


def _entry(e: LogEntry) -> dict[str, object]:
    body: dict[str, object] = {"timestamp": _iso(e.timestamp), "level": e.level, "message": e.message}
    if e.step is not None:
        body["step"] = e.step
    return body


def _level_ok(entry: LogEntry, level: str | None) -> bool:
    return level is None or LOG_LEVELS.index(entry.level) >= LOG_LEVELS.index(level)


def _check_level(level: str | None) -> None:
    if level is not None and level not in LOG_LEVELS:
        raise Invalid(f"level must be one of {', '.join(LOG_LEVELS)}")


@router.get("/templates/{template_id}/builds/{build_id}/status", dependencies=AUTH)
async def build_status(
    request: Request,
    template_id: str,
    build_id: str,
    logs_offset: int = Query(0, alias="logsOffset", ge=0),
    limit: int = Query(100, ge=0, le=100),
    level: str | None = Query(None),
) -> JSONResponse:
    """``TemplateBuildInfo``: status, the log entries from ``logsOffset`` (at most ``limit``)
    and, for a failed build, the reason with the failing step's last entries."""
    _check_level(level)
    build = builder(request).get(storage.split_name(template_id)[0], build_id)
    entries = [e for e in build.logs if _level_ok(e, level)][logs_offset : logs_offset + limit]
    body: dict[str, object] = {
        "templateID": build.template_id,
        "buildID": build.build_id,
        "status": build.status,
        "logs": [],
        "logEntries": [_entry(e) for e in entries],
    }
    if build.reason is not None:
        reason: dict[str, object] = {
            "message": build.reason.message,
            "logEntries": [_entry(e) for e in build.reason.log_entries],
        }
        if build.reason.step is not None:
            reason["step"] = build.reason.step
        body["reason"] = reason
    return JSONResponse(body)


@router.get("/templates/{template_id}/builds/{build_id}/logs", dependencies=AUTH)
async def build_logs(
    request: Request,
    template_id: str,
    build_id: str,
    cursor: int | None = Query(None, ge=0),
    limit: int = Query(100, ge=0, le=100),
    direction: str = Query("forward"),
    level: str | None = Query(None),
    source: str | None = Query(None),
) -> JSONResponse:
    """``TemplateBuildLogsResponse``: entries from ``cursor`` (ms since the epoch) on, oldest
    first (``forward``) or newest first (``backward``, entries up to ``cursor``)."""
    _check_level(level)
    if direction not in ("forward", "backward"):
        raise Invalid("direction must be forward or backward")
    if source not in (None, "temporary", "persistent"):
        raise Invalid("source must be temporary or persistent")
    build = builder(request).get(storage.split_name(template_id)[0], build_id)
    entries = [e for e in build.logs if _level_ok(e, level)]
    if direction == "forward":
        if cursor is not None:
            entries = [e for e in entries if e.timestamp.timestamp() * 1000 >= cursor]
    else:
        if cursor is not None:
            entries = [e for e in entries if e.timestamp.timestamp() * 1000 <= cursor]
        entries = entries[::-1]
    return JSONResponse({"logs": [_entry(e) for e in entries[:limit]]})


# -- tags ---------------------------------------------------------------------------------------


def _tag_build(settings: Settings, name: str) -> tuple[str, str]:
    """(template id, build id) of ``name`` or ``name:tag`` (no tag: the current build)."""
    template_id, tag = storage.split_name(name)
    info = templates.load(name, settings)
    if tag is None:
        return template_id, info.build_id
    tags = storage.read_metadata(template_id, settings).get("tags") or {}
    return template_id, str(tags[tag]["build_id"])


@router.post("/templates/tags", dependencies=AUTH)
async def assign_tags(request: Request, body: AssignTemplateTagsRequest) -> JSONResponse:
    settings = _settings(request)
    template_id, build_id = _tag_build(settings, body.target)
    if not body.tags:
        raise Invalid("tags must name at least one tag")
    for tag in body.tags:
        storage.split_name(f"{template_id}:{tag}")
    storage.set_tags(template_id, settings, dict.fromkeys(body.tags, build_id), [])
    return JSONResponse({"tags": body.tags, "buildID": build_id}, status_code=201)


@router.delete("/templates/tags", dependencies=AUTH)
async def delete_tags(request: Request, body: DeleteTemplateTagsRequest) -> Response:
    settings = _settings(request)
    template_id, _ = storage.split_name(body.name)
    if not storage.is_built(template_id, settings):
        raise NotFound(f"template '{template_id}' not found")
    known = storage.read_metadata(template_id, settings).get("tags") or {}
    missing = [t for t in body.tags if t not in known]
    if missing:
        raise NotFound(f"template '{template_id}' has no tag {', '.join(missing)}")
    storage.set_tags(template_id, settings, {}, body.tags)
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags", dependencies=AUTH)
async def list_tags(request: Request, template_id: str) -> JSONResponse:
    settings = _settings(request)
    name, _ = storage.split_name(template_id)
    templates.load(name, settings)
    tags = storage.read_metadata(name, settings).get("tags") or {}
    return JSONResponse(
        [
            {"tag": tag, "buildID": entry["build_id"], "createdAt": entry["created_at"]}
            for tag, entry in sorted(tags.items())
        ]
    )


# Declared after ``/templates/tags``: a path parameter would take "tags" too. ``:path``: the SDKs
# send E2B's namespaced names (``team/name:tag``) percent-encoded, which arrive decoded here.
@router.delete("/templates/{template_id:path}", dependencies=AUTH)
async def delete_template(request: Request, template_id: str) -> Response:
    """A template built through the build API, or a user snapshot: snapshots are templates in
    E2B, and the SDK's ``delete_snapshot`` sends this too (``TemplateOwner.delete`` decides)."""
    orch: Orchestrator = request.app.state.orchestrator
    await orch.template_owner.delete(template_id)
    return Response(status_code=204)
