"""Shared fixtures: the cached base template, a throw-away data directory, runtimes, sandboxes.

Kept generic so every runtime's tests can use them:

* ``agentenv_settings`` - :class:`Settings` with a temporary ``data_dir`` (sandboxes, network
  slots, runsc state, envd bundle) and the shared template cache (``AGENTENV_TEMPLATES_PATH``,
  default ``/var/lib/agentenv/templates``: building ``base`` once takes about a minute).
* ``base_template`` - the built ``base`` template (built on first use, then instant).
* ``envd_bundle`` - the envd runtime bundle directory for ``agentenv_settings``.
* ``runtime_factory(name)`` - a runtime instance, skipped with its ``probe()`` reason.
* ``sandbox_factory(runtime, **spec)`` - creates sandboxes with unique ids and kills whatever a
  test leaves at teardown (so a failing test leaks nothing).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentenv.config import Settings
from agentenv.runtime.base import Runtime
from agentenv.types import SandboxInstance, SandboxSpec, TemplateImage

SHARED_TEMPLATES = Path(os.environ.get("AGENTENV_TEMPLATES_PATH", "/var/lib/agentenv/templates"))


def unique_id(prefix: str = "t") -> str:
    """A sandbox id that cannot collide with other tests or helpers on the same host."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def agentenv_data_dir() -> Iterator[Path]:
    # Short path: runsc keeps unix sockets under its --root inside the data directory.
    path = Path(tempfile.mkdtemp(prefix="aet-", dir="/tmp"))
    yield path
    leaked = _cleanup_runtimes(Settings(data_dir=path, templates_path=SHARED_TEMPLATES))
    mounted = [m for m in Path("/proc/mounts").read_text().split() if m.startswith(str(path))]
    if not mounted:  # never rm -rf through a live mount
        shutil.rmtree(path, ignore_errors=True)
    assert not leaked, f"sandboxes left running by tests (now removed): {leaked}"
    assert not mounted, f"mounts left under {path}: {mounted}"


def _cleanup_runtimes(settings: Settings) -> list[str]:
    """Let every usable runtime remove what tests leaked in ``settings.data_dir``."""
    import asyncio

    from agentenv.runtime.registry import get_runtime, runtime_names

    leaked: list[str] = []
    for name in runtime_names():
        try:
            runtime = get_runtime(name, settings)
        except ImportError:  # runtime not written (yet)
            continue
        if type(runtime).probe() is None:
            leaked += asyncio.run(runtime.cleanup_orphans(set()))
    return leaked


@pytest.fixture(scope="session")
def agentenv_settings(agentenv_data_dir: Path) -> Settings:
    return Settings(data_dir=agentenv_data_dir, templates_path=SHARED_TEMPLATES)


@pytest.fixture(scope="session")
def base_template(agentenv_settings: Settings) -> TemplateImage:
    if os.geteuid() != 0:
        pytest.skip("building and using templates needs root (debootstrap, chroot)")
    from agentenv.storage.templates import build_template

    return build_template("base", agentenv_settings)


@pytest.fixture(scope="session")
def envd_bundle(agentenv_settings: Settings) -> Path:
    from agentenv.storage.envd_bundle import build_envd_bundle

    return build_envd_bundle(agentenv_settings)


RuntimeFactory = Callable[[str], Runtime]


@pytest.fixture(scope="session")
def runtime_factory(agentenv_settings: Settings) -> RuntimeFactory:
    from agentenv.runtime.registry import get_runtime

    def make(name: str) -> Runtime:
        runtime = get_runtime(name, agentenv_settings)
        reason = type(runtime).probe()
        if reason is not None:
            pytest.skip(f"runtime {name} cannot run here: {reason}")
        return runtime

    return make


SandboxFactory = Callable[..., Awaitable[SandboxInstance]]


@pytest_asyncio.fixture(loop_scope="session")
async def sandbox_factory(base_template: TemplateImage) -> AsyncIterator[SandboxFactory]:
    created: list[tuple[Runtime, SandboxInstance]] = []

    async def make(runtime: Runtime, template: TemplateImage | None = None, **spec: Any) -> SandboxInstance:
        spec.setdefault("sandbox_id", unique_id())
        instance = await runtime.create(SandboxSpec(template=template or base_template, **spec))
        created.append((runtime, instance))
        return instance

    yield make
    for runtime, instance in reversed(created):
        await runtime.kill(instance)
