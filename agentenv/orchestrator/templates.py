"""Template look-up for the orchestrator and the ``/templates`` endpoints.

Templates are the directories ``storage.templates`` builds under ``settings.templates_dir``
(``{data_dir}/templates`` unless ``AGENTENV_TEMPLATES_PATH`` points elsewhere, as tests do to
share the cached base template).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import Settings
from agentenv.errors import NotFound
from agentenv.storage import templates as storage
from agentenv.types import TemplateImage


class TemplateNotFound(NotFound):
    pass


@dataclass(frozen=True)
class TemplateInfo:
    image: TemplateImage
    created_at: dt.datetime
    build_id: str


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
    try:
        raw = json.loads(meta_path.read_text()).get("created_at")
        if raw:
            created = dt.datetime.fromisoformat(raw)
    except (OSError, ValueError):
        pass
    # A stable build id per build: the completion marker's timestamp identifies the build.
    marker: Path = tdir / storage.COMPLETE_MARKER
    build_id = _uuid_from(marker.read_text().strip() if marker.exists() else image.template_id)
    return TemplateInfo(image=image, created_at=created, build_id=build_id)


def _uuid_from(text: str) -> str:
    import uuid

    return str(uuid.uuid5(uuid.NAMESPACE_URL, "agentenv-template-build:" + text))


def list_all(settings: Settings) -> list[TemplateInfo]:
    out = []
    for meta in storage.list_templates(settings):
        tid = str(meta.get("template_id", ""))
        try:
            out.append(load(tid, settings))
        except TemplateNotFound:
            continue
    return out
