"""Template look-up for the orchestrator and the ``/templates`` endpoints.

Templates are the directories ``storage.templates`` builds under ``settings.templates_dir``
(``{data_dir}/templates`` unless ``FORKYARD_TEMPLATES_PATH`` points elsewhere, as tests do to
share the cached base template).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

from forkyard.config import Settings
from forkyard.errors import NotFound
from forkyard.storage import templates as storage
from forkyard.types import TemplateImage


class TemplateNotFound(NotFound):
    pass


@dataclass(frozen=True)
class StartCommand:
    """A built template's start command, running in its snapshot once ``ready_cmd`` passes
    (E2B's ``set_start_cmd``); as the build's last user, in its last work dir, with its envs."""

    start_cmd: str | None
    ready_cmd: str | None
    user: str
    workdir: str
    envs: dict[str, str]

    @classmethod
    def of(cls, meta: dict[str, object]) -> StartCommand | None:
        start, ready = meta.get("start_cmd"), meta.get("ready_cmd")
        if not start and not ready:
            return None
        envs = meta.get("envs")
        return cls(
            start_cmd=str(start) if start else None,
            ready_cmd=str(ready) if ready else None,
            user=str(meta.get("user") or "user"),
            workdir=str(meta.get("workdir") or "/home/user"),
            envs={str(k): str(v) for k, v in envs.items()} if isinstance(envs, dict) else {},
        )


@dataclass(frozen=True)
class TemplateInfo:
    image: TemplateImage
    created_at: dt.datetime
    build_id: str
    start: StartCommand | None = None
    #: Built through the build API: gets a warm pool like the templates the settings name.
    pooled: bool = False


def load(template_id: str, settings: Settings) -> TemplateInfo:
    """The built template ``template_id`` or :class:`TemplateNotFound`."""
    try:
        image = storage.load_template(template_id, settings)
    except storage.TemplateError as exc:
        raise TemplateNotFound(f"template '{template_id}' not found: {exc}") from None
    return _info(image)


def _info(image: TemplateImage) -> TemplateInfo:
    tdir = image.rootfs.parent
    meta_path = tdir / storage.METADATA_FILE
    created = dt.datetime.fromtimestamp(meta_path.stat().st_mtime, dt.UTC)
    meta: dict[str, object] = {}
    try:
        meta = json.loads(meta_path.read_text())
        raw = meta.get("created_at")
        if isinstance(raw, str) and raw:
            created = dt.datetime.fromisoformat(raw)
    except (OSError, ValueError):
        pass
    build_id = meta.get("build_id")
    if not isinstance(build_id, str) or not build_id:
        # Recipe builds have no build id: the completion marker's timestamp identifies the build.
        build_id = storage.recipe_build_id(tdir)
    return TemplateInfo(
        image=image,
        created_at=created,
        build_id=build_id,
        start=StartCommand.of(meta),
        pooled=bool(meta.get("warm_pool")),
    )


def list_all(settings: Settings) -> list[TemplateInfo]:
    out = []
    for meta in storage.list_templates(settings):
        tid = str(meta.get("template_id", ""))
        try:
            out.append(load(tid, settings))
        except TemplateNotFound:
            continue
    return out
