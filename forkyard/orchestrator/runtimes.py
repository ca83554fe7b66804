"""The isolation runtimes of this node: the default one and any a template asks for by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from forkyard.config import Settings
from forkyard.errors import Failed
from forkyard.runtime.base import Runtime
from forkyard.runtime.kinds import get_runtime
from forkyard.types import RUNTIME_NAMES, RuntimeName, TemplateImage


class RuntimeSet:
    def __init__(self, settings: Settings, default: Runtime) -> None:
        self._settings = settings
        self.default = default
        self._by_name: dict[str, Runtime] = {default.name: default}

    def named(self, name: str) -> Runtime:
        """The runtime a record or template names (records keep the name as text)."""
        if name not in self._by_name:
            if name not in RUNTIME_NAMES:
                raise Failed(f"unknown runtime {name!r} recorded; expected one of {', '.join(RUNTIME_NAMES)}")
            self._by_name[name] = get_runtime(cast(RuntimeName, name), self._settings)
        return self._by_name[name]

    def for_template(self, image: TemplateImage) -> Runtime:
        """The template's own runtime, else the node's."""
        return self.named(image.runtime or self.default.name)

    def __iter__(self) -> Iterator[Runtime]:
        return iter(list(self._by_name.values()))
