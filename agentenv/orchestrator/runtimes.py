"""The one place the orchestrator learns which isolation runtime(s) to use."""

from __future__ import annotations

from agentenv.config import Settings
from agentenv.runtime.base import Runtime


def default_runtime(settings: Settings) -> tuple[Runtime, dict[str, str]]:
    """The node's runtime plus, per runtime not chosen, why (for the start-up log)."""
    from agentenv.runtime.registry import select_runtime

    return select_runtime(settings)


def runtime_by_name(name: str, settings: Settings) -> Runtime:
    """A runtime a template asks for by name (``template.json`` ``runtime``)."""
    from agentenv.runtime.registry import get_runtime

    return get_runtime(name, settings)


def unusable_reason(runtime: Runtime) -> str | None:
    return type(runtime).probe()
