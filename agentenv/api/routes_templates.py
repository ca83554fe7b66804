"""``/templates``: the templates built on this node (read-only; builds use ``agentenv template``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from agentenv.api.auth import require_api_key
from agentenv.api.schemas import Template
from agentenv.config import Settings
from agentenv.orchestrator import templates
from agentenv.orchestrator.templates import TemplateInfo
from agentenv.types import ENVD_VERSION

router = APIRouter(dependencies=[Depends(require_api_key)])


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


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


@router.get("/templates")
async def list_templates(request: Request) -> JSONResponse:
    return JSONResponse([template_body(t) for t in templates.list_all(_settings(request))])


def _load(request: Request, template_id: str) -> TemplateInfo:
    return templates.load(template_id, _settings(request))


@router.get("/templates/aliases/{alias}")
async def template_by_alias(request: Request, alias: str) -> JSONResponse:
    info = _load(request, alias)
    return JSONResponse({"templateID": info.image.template_id, "public": True})


@router.get("/templates/{template_id}")
async def get_template(request: Request, template_id: str) -> JSONResponse:
    """``TemplateWithBuilds``: the template and its one (current) build."""
    info = _load(request, template_id)
    img = info.image
    created = info.created_at.isoformat().replace("+00:00", "Z")
    return JSONResponse(
        {
            "templateID": img.template_id,
            "public": True,
            "aliases": [img.template_id],
            "names": [img.template_id],
            "createdAt": created,
            "updatedAt": created,
            "lastSpawnedAt": None,
            "spawnCount": 0,
            "builds": [
                {
                    "buildID": info.build_id,
                    "status": "ready",
                    "createdAt": created,
                    "updatedAt": created,
                    "finishedAt": created,
                    "cpuCount": img.vcpus,
                    "memoryMB": img.memory_mb,
                    "diskSizeMB": img.disk_mb,
                    "envdVersion": ENVD_VERSION,
                }
            ],
        }
    )
