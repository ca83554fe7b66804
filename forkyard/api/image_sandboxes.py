"""Sandboxes of an OCI image named in their metadata (slime's convention, issue 24).

slime's E2B sandbox (``slime/agent/sandbox.py``) calls ``AsyncSandbox.create(metadata={<key>:
<image ref>})`` with no template: the SDK then asks for its default template, and "the E2B gateway"
is expected to route on the image. Here the node does: with ``FORKYARD_SANDBOX_IMAGE_METADATA_KEY``
set (the same key as slime's ``SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY``), a create of the default
template whose metadata carries that key gets a sandbox of the image instead. The image becomes a
template built ``from_image`` by the node's builder on first use (``img-<digest of the ref>``), and
later creates start from that template (its snapshot): pulled once, cached after. Concurrent first
creates of one image wait for one build. Delete the ``img-...`` template to pull the ref again.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from fastapi import Request

from forkyard.api.routes_templates import builder
from forkyard.config import Settings
from forkyard.errors import Conflict, Invalid
from forkyard.orchestrator import templates
from forkyard.orchestrator.builder import Build, BuildSpec
from forkyard.storage import templates as storage

#: The template E2B's SDKs create from when none is given (``Sandbox.default_template``).
SDK_DEFAULT_TEMPLATE = "base"
IMAGE_TEMPLATE_PREFIX = "img-"
#: A first use waits this long for the image's build (a pull and a snapshot: tens of seconds here).
BUILD_WAIT_SECONDS = 1800.0
_BUILD_POLL_SECONDS = 0.2
#: One build per image at a time: per template name, for the life of the process.
_locks: dict[str, asyncio.Lock] = {}


def image_template_name(image: str) -> str:
    """The template an image ref is built into: stable for a ref, a valid template id."""
    return IMAGE_TEMPLATE_PREFIX + hashlib.sha256(image.encode()).hexdigest()[:24]


def requested_image(template_id: str, metadata: dict[str, str] | None, settings: Settings) -> str | None:
    """The image a create asks for by metadata, or None when it names none.

    Only a create of the SDK's default template counts (slime passes no template); an explicit
    template and an image key together are refused, as ambiguous."""
    key = settings.sandbox_image_metadata_key
    if not key or not metadata or key not in metadata:
        return None
    image = metadata[key].strip()
    if not image or any(c.isspace() for c in image):
        raise Invalid(f"metadata '{key}' must be an OCI image reference, got {metadata[key]!r}")
    if template_id != SDK_DEFAULT_TEMPLATE:
        raise Invalid(
            f"metadata '{key}' picks the sandbox's image: leave the template unset (it was '{template_id}')"
        )
    return image


async def template_for_image(request: Request, image: str) -> str:
    """The template of ``image``: built now (once, whoever asks meanwhile) unless it already is."""
    settings: Settings = request.app.state.settings
    name = image_template_name(image)
    if storage.is_built(name, settings):
        return name
    lock = _locks.setdefault(name, asyncio.Lock())
    async with lock:
        if storage.is_built(name, settings):
            return name
        tbuilder = builder(request)
        running = [b for b in tbuilder.builds_of(name) if b.started and b.status in ("waiting", "building")]
        if running:  # started by a create that gave up waiting
            build = running[0]
        else:
            build = tbuilder.request(name, [], None, None)
            tbuilder.start(name, build.build_id, BuildSpec(from_image=image))
        # The build runs in the server's background: a client that gives up meanwhile (the SDK's
        # 60 s request timeout) finds it done, or still running under this lock, next time.
        await asyncio.shield(_wait(build))
    if build.status != "ready":
        reason = build.reason.message if build.reason else "no reason given"
        raise Invalid(f"image '{image}' could not be made into a sandbox template: {reason}")
    templates.load(name, settings)  # the template is there (TemplateNotFound, a 404, if not)
    return name


async def _wait(build: Build) -> None:
    """Until the builder has finished ``build`` (it updates the object in place)."""
    deadline = time.monotonic() + BUILD_WAIT_SECONDS
    while build.status not in ("ready", "error"):
        if time.monotonic() > deadline:
            raise Conflict(f"the image's template '{build.template_id}' is still building: try again later")
        await asyncio.sleep(_BUILD_POLL_SECONDS)
