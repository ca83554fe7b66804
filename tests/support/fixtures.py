"""The shared fixtures, loaded for every test by ``pytest_plugins`` in tests/conftest.py (so a
test module just names them as arguments; never import them).

Runtime level (a runtime object in the test process, no server):

* ``forkyard_data_dir`` - a throw-away data directory for the session (``/tmp/aet-*``: runsc
  keeps unix sockets below it). At the end every usable runtime removes what tests leaked in
  it, and the session fails on leaked sandboxes or mounts.
* ``forkyard_settings`` - :class:`forkyard.config.Settings` on that directory and the shared
  template cache (:data:`tests.support.SHARED_TEMPLATES`).
* ``base_template`` - the built ``base`` template (built on first use, about a minute; root).
* ``envd_bundle`` - the envd runtime bundle directory for ``forkyard_settings``.
* ``runtime_factory(name)`` - a runtime instance, skipped with its ``probe()`` reason.
* ``sandbox_factory(runtime, **spec)`` - creates sandboxes with unique ids and kills whatever
  a test leaves at teardown (so a failing test leaks nothing).

Server level (:mod:`tests.support.server`):

* ``forkyard_server`` - one real ``forkyard serve`` for the session, with ``E2B_API_URL``,
  ``E2B_SANDBOX_URL`` and ``E2B_API_KEY`` set for the SDKs; skipped when the base template is
  not built. Tests that restart or kill a server start their own with ``serve()``.

forkyard is imported inside the fixtures only: a module broken in the middle of a change fails
the tests that use it, not the whole collection.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import pytest_asyncio

from tests.support import SHARED_TEMPLATES, base_template_missing, unique_id
from tests.support.leaks import mounts_under
from tests.support.server import ServerProcess, serve

if TYPE_CHECKING:
    from forkyard.config import Settings
    from forkyard.runtime.base import Runtime
    from forkyard.types import RuntimeName, SandboxInstance, TemplateImage

RuntimeFactory = Callable[[str], "Runtime"]
SandboxFactory = Callable[..., Awaitable["SandboxInstance"]]


# -- runtime level -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def forkyard_data_dir() -> Iterator[Path]:
    from forkyard.config import Settings

    path = Path(tempfile.mkdtemp(prefix="aet-", dir="/tmp"))
    yield path
    try:
        leaked = _cleanup_runtimes(Settings(data_dir=path, templates_path=SHARED_TEMPLATES))
    finally:
        mounted = mounts_under(path)
        if not mounted:  # never rm -rf through a live mount
            shutil.rmtree(path, ignore_errors=True)
    assert not leaked, f"sandboxes left running by tests (now removed): {leaked}"
    assert not mounted, f"mounts left under {path}: {mounted}"


def _cleanup_runtimes(settings: Settings) -> list[str]:
    """Let every usable runtime remove what tests leaked in ``settings.data_dir``."""
    from forkyard.runtime.kinds import get_runtime, runtime_names

    leaked: list[str] = []
    for name in runtime_names():
        runtime = get_runtime(name, settings)
        if runtime.probe() is None:
            leaked += asyncio.run(runtime.cleanup_orphans(set()))
    return leaked


@pytest.fixture(scope="session")
def forkyard_settings(forkyard_data_dir: Path) -> Settings:
    from forkyard.config import Settings

    return Settings(data_dir=forkyard_data_dir, templates_path=SHARED_TEMPLATES)


@pytest.fixture(scope="session")
def base_template(forkyard_settings: Settings) -> TemplateImage:
    if os.geteuid() != 0:
        pytest.skip("needs root: building and using templates (debootstrap, chroot)")
    from forkyard.storage.templates import build_template

    return build_template("base", forkyard_settings)


@pytest.fixture(scope="session")
def envd_bundle(forkyard_settings: Settings) -> Path:
    from forkyard.storage.envd_bundle import build_envd_bundle

    return build_envd_bundle(forkyard_settings)


@pytest.fixture(scope="session")
def runtime_factory(forkyard_settings: Settings) -> RuntimeFactory:
    from forkyard.runtime.kinds import get_runtime

    def make(name: str) -> Runtime:
        runtime = get_runtime(cast("RuntimeName", name), forkyard_settings)
        reason = runtime.probe()
        if reason is not None:
            pytest.skip(f"runtime {name} cannot run here: {reason}")
        return runtime

    return make


@pytest_asyncio.fixture(loop_scope="session")
async def sandbox_factory(base_template: TemplateImage) -> AsyncIterator[SandboxFactory]:
    from forkyard.types import SandboxSpec

    created: list[tuple[Runtime, SandboxInstance]] = []

    async def make(runtime: Runtime, template: TemplateImage | None = None, **spec: Any) -> SandboxInstance:
        spec.setdefault("sandbox_id", unique_id())
        instance = await runtime.create(SandboxSpec(template=template or base_template, **spec))
        created.append((runtime, instance))
        return instance

    yield make
    for runtime, instance in reversed(created):
        await runtime.kill(instance)


# -- server level ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def forkyard_server() -> Iterator[ServerProcess]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with serve(prefix="forkyard-e2e-") as server, pytest.MonkeyPatch.context() as env:
        for key, value in server.sdk_env.items():
            env.setenv(key, value)
        yield server
