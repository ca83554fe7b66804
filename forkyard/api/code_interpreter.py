"""``code-interpreter-v1`` on a serving node: built in the background at start-up when missing (`make run`)
(``FORKYARD_BUILD_CODE_INTERPRETER``), its progress in the server's log and in the template's
builds (``GET /templates/code-interpreter-v1``, ``forkyard template list``); a create that comes
before it is ready is told so."""

from __future__ import annotations

import logging
import time
from typing import Any

from forkyard.api.routes_templates import node_builder
from forkyard.errors import Unavailable
from forkyard.orchestrator import code_interpreter
from forkyard.orchestrator.builder import Build, LogEntry
from forkyard.storage import templates as storage

logger = logging.getLogger("forkyard.code_interpreter")


async def build_in_background(state: Any) -> None:
    """Start the template's build unless it is built or being built (errors are logged: the
    server serves ``base`` either way)."""
    settings = state.settings
    if not settings.build_code_interpreter or not storage.is_built("base", settings):
        return  # off, or nothing to build from (the node serves no base either)
    the_builder = node_builder(state)
    if the_builder.building(code_interpreter.TEMPLATE_ID) or code_interpreter.is_current(
        the_builder, settings
    ):
        return
    try:
        build, spec = await code_interpreter.prepare(the_builder)
        build.listener = lambda entry: _log(settings, build, entry)
        the_builder.start(code_interpreter.TEMPLATE_ID, build.build_id, spec)
    except Exception:
        logger.exception("could not start the build of %s", code_interpreter.TEMPLATE_ID)
        return
    logger.info(
        "building %s in the background (build %s): `forkyard template list` shows its progress",
        code_interpreter.TEMPLATE_ID,
        build.build_id,
    )


def _log(settings: Any, build: Build, entry: LogEntry) -> None:
    logger.info("%s [%s] %s", code_interpreter.TEMPLATE_ID, entry.step or "-", entry.message)
    code_interpreter.write_progress(settings, build.build_id, entry.step or "-", entry.message)


def not_ready_error(state: Any, template_id: str) -> Unavailable | None:
    """The error a create of a template the node is building gets, None if it builds none."""
    name = template_id.partition(":")[0]
    builds = [b for b in node_builder(state).builds_of(name) if b.status in ("waiting", "building")]
    if not builds:
        return None
    return Unavailable(
        f"template '{name}' is still being built ({_progress(builds[-1])}); try again once it is ready"
    )


def _progress(build: Build) -> str:
    steps = [e.step for e in build.logs if e.step]
    where = f"at step {steps[-1]}" if steps else "starting"
    return f"build {build.build_id} {where}, for {time.time() - build.created_at.timestamp():.0f} s"
