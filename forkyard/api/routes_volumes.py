"""E2B volumes: ``/volumes`` (openapi.yml, API key) and the volume content API
``/volumecontent/{volumeID}/...`` (E2B's openapi-volumecontent.yml, the volume's bearer token).

A volume is a directory of this node (:mod:`forkyard.storage.volumes`); ``volumeMounts`` on create
binds it into the sandbox (``routes_sandboxes``). The SDKs send content requests to
``E2B_VOLUME_API_URL`` (else ``https://api.<domain>``): this same listener.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import posixpath
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from forkyard.api.auth import require_api_key
from forkyard.errors import Conflict, Invalid, NotFound, Unauthenticated
from forkyard.orchestrator.lifecycle import Orchestrator
from forkyard.storage.envd_bundle import MOUNT_POINT
from forkyard.storage.volumes import READ_CHUNK, VolumeCatalog, VolumeFiles, VolumeRow, normalise, os_error
from forkyard.types import VolumeMount

router = APIRouter(dependencies=[Depends(require_api_key)])
content_router = APIRouter()

U32 = Annotated[int | None, Query(ge=0, le=2**32 - 1)]


class NewVolume(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class MetadataUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    uid: int | None = Field(None, ge=0, le=2**32 - 1)
    gid: int | None = Field(None, ge=0, le=2**32 - 1)
    mode: int | None = Field(None, ge=0, le=2**32 - 1)


def volume_catalog(request: Request) -> VolumeCatalog:
    orch: Orchestrator = request.app.state.orchestrator
    return VolumeCatalog(orch.store.db, orch.settings.data_dir)


Volumes = Annotated[VolumeCatalog, Depends(volume_catalog)]


def volume_and_token(row: VolumeRow) -> dict[str, str]:
    return {"volumeID": row.volume_id, "name": row.name, "token": row.token}


# -- the control plane ------------------------------------------------------------------------


@router.get("/volumes")
async def list_volumes(volumes: Volumes) -> list[dict[str, str]]:
    return [{"volumeID": row.volume_id, "name": row.name} for row in await volumes.list()]


@router.post("/volumes", status_code=201)
async def create_volume(body: NewVolume, volumes: Volumes) -> JSONResponse:
    row = await volumes.create(body.name)
    return JSONResponse(volume_and_token(row), status_code=201)


@router.get("/volumes/{volume_id}")
async def get_volume(volume_id: str, volumes: Volumes) -> dict[str, str]:
    return volume_and_token(await volumes.get(volume_id))


@router.delete("/volumes/{volume_id}", status_code=204)
async def delete_volume(volume_id: str, request: Request, volumes: Volumes) -> Response:
    row = await volumes.get(volume_id)
    orch: Orchestrator = request.app.state.orchestrator
    users = await orch.sandboxes_mounting(row.volume_id)
    if users:
        # E2B deletes the data under running sandboxes; here the sandboxes keep their volume until
        # they are killed (a paused one would otherwise never resume).
        raise Conflict(
            f"volume {row.name!r} is mounted by sandbox(es) {', '.join(users)}: kill them before deleting it"
        )
    await volumes.delete(row)
    return Response(status_code=204)


# -- the volume content API --------------------------------------------------------------------


async def volume_files(volume_id: str, request: Request, volumes: Volumes) -> VolumeFiles:
    """The volume the bearer token opens (401 without the volume's own token)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("missing volume token: send 'Authorization: Bearer <token>'")
    try:
        row = await volumes.get(volume_id)
    except Exception:
        raise Unauthenticated("invalid volume token") from None  # no telling which ids exist
    if not hmac.compare_digest(token.encode(), row.token.encode()):
        raise Unauthenticated("invalid volume token")
    return volumes.files(row)


Files = Annotated[VolumeFiles, Depends(volume_files)]
PathQuery = Annotated[str, Query(min_length=1)]


@content_router.get("/volumecontent/{volume_id}/path")
async def stat_path(files: Files, path: PathQuery) -> dict[str, Any]:
    return await asyncio.to_thread(files.stat, normalise(path))


@content_router.patch("/volumecontent/{volume_id}/path")
async def update_path(files: Files, path: PathQuery, body: MetadataUpdate) -> dict[str, Any]:
    return await asyncio.to_thread(files.update_metadata, normalise(path), body.uid, body.gid, body.mode)


@content_router.delete("/volumecontent/{volume_id}/path", status_code=204)
async def remove_path(files: Files, path: PathQuery) -> Response:
    await asyncio.to_thread(files.remove, normalise(path))
    return Response(status_code=204)


@content_router.get("/volumecontent/{volume_id}/dir")
async def list_dir(
    files: Files, path: PathQuery, depth: Annotated[int, Query(ge=1, le=64)] = 1
) -> list[dict[str, Any]]:
    return await asyncio.to_thread(files.list_dir, normalise(path), depth)


@content_router.post("/volumecontent/{volume_id}/dir", status_code=201)
async def make_dir(
    files: Files, path: PathQuery, uid: U32 = None, gid: U32 = None, mode: U32 = None, force: bool = False
) -> JSONResponse:
    entry = await asyncio.to_thread(files.make_dir, normalise(path), uid, gid, mode, force)
    return JSONResponse(entry, status_code=201)


@content_router.put("/volumecontent/{volume_id}/file", status_code=201)
async def write_file(
    request: Request,
    files: Files,
    path: PathQuery,
    uid: U32 = None,
    gid: U32 = None,
    mode: U32 = None,
    force: bool = False,
) -> JSONResponse:
    where = normalise(path)
    fd = await asyncio.to_thread(files.open_for_write, where, uid, gid, mode, force)
    try:
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(_write_all, fd, chunk, where)
    finally:
        os.close(fd)
    return JSONResponse(await asyncio.to_thread(files.stat, where), status_code=201)


def _write_all(fd: int, data: bytes, path: str) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        raise os_error(exc, path) from None


@content_router.get("/volumecontent/{volume_id}/file")
async def read_file(files: Files, path: PathQuery) -> StreamingResponse:
    where = normalise(path)
    fd = await asyncio.to_thread(files.open_for_read, where)
    return StreamingResponse(_chunks(fd), media_type="application/octet-stream")


async def _chunks(fd: int) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(os.read, fd, READ_CHUNK):
            yield chunk
    finally:
        os.close(fd)


# -- volumeMounts on create ----------------------------------------------------------------------

#: Where the sandbox's own file systems and envd's files are: a volume may not cover them.
RESERVED_MOUNT_PATHS = ("/proc", "/dev", "/sys", "/tmp", "/usr/bin/sudo", MOUNT_POINT)


def check_mount_path(path: str) -> str:
    """``path`` of a volume mount: absolute and normal, not the root or a system directory."""
    if (
        not path.startswith("/")
        or "\0" in path
        or posixpath.normpath(path) != path.rstrip("/")
        or path == "/"
    ):
        raise Invalid(f"invalid volume mount path {path!r}: give an absolute, normalised path other than /")
    for reserved in RESERVED_MOUNT_PATHS:
        if path == reserved or path.startswith(reserved + "/") or reserved.startswith(path + "/"):
            raise Invalid(f"invalid volume mount path {path!r}: it would cover {reserved}")
    return path.rstrip("/")


async def resolve_mounts(request: Request, mounts: list[tuple[str, str]]) -> tuple[VolumeMount, ...]:
    """``volumeMounts`` (name, path) as this node's volume directories; 400 for an unknown volume,
    a bad or repeated path."""
    volumes = volume_catalog(request)
    resolved: list[VolumeMount] = []
    for name, raw_path in mounts:
        path = check_mount_path(raw_path)
        if any(m.path == path for m in resolved):
            raise Invalid(f"volume mount path {path!r} is given twice")
        try:
            row = await volumes.by_name(name)
        except NotFound:
            raise Invalid(f"volume {name!r} not found: create it first (Volume.create)") from None
        directory = volumes.files(row).root  # its directory here (a volume of another node: 400)
        resolved.append(VolumeMount(name=row.name, volume_id=row.volume_id, source=str(directory), path=path))
    return tuple(resolved)
