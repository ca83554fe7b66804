"""The FastAPI application: control plane + sandbox proxy, wired to one orchestrator."""

from __future__ import annotations

import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from agentenv.api import routes_sandboxes, routes_templates
from agentenv.api.errors import error_response, install_error_handlers
from agentenv.api.proxy import SandboxProxy
from agentenv.config import Settings
from agentenv.orchestrator.runtimes import default_runtime
from agentenv.orchestrator.service import Orchestrator, OrchestratorError
from agentenv.runtime.base import Runtime

log = logging.getLogger(__name__)


class Hub:
    """What the proxy and the routes share; filled in by the lifespan."""

    def __init__(self, settings: Settings, runtime: Runtime | None) -> None:
        self.settings = settings
        self.runtime = runtime
        self.runtime_reasons: dict[str, str] = {}
        self._orchestrator: Orchestrator | None = None
        self.proxy: SandboxProxy | None = None

    @property
    def orchestrator(self) -> Orchestrator:
        if self._orchestrator is None:
            raise RuntimeError("the orchestrator is not started")
        return self._orchestrator

    async def start(self) -> Orchestrator:
        if self.runtime is None:
            self.runtime, self.runtime_reasons = default_runtime(self.settings)
        self._orchestrator = Orchestrator(self.settings, self.runtime)
        _install_lifecycle_extensions(self._orchestrator)
        await self._orchestrator.start()
        return self._orchestrator

    async def stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.aclose()
        if self._orchestrator is not None:
            await self._orchestrator.close()


def _optional_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def _install_lifecycle_extensions(orch: Orchestrator) -> None:
    """Pause/resume/snapshots live in ``agentenv.orchestrator.snapshots``; when it exists, its
    ``install(orchestrator)`` sets ``orchestrator.pause_hook`` / ``resume_hook``."""
    module = _optional_module("agentenv.orchestrator.snapshots")
    install = getattr(module, "install", None) if module else None
    if callable(install):
        install(orch)


def public_domain(settings: Settings) -> str:
    """The ``domain`` returned to SDKs, so ``sandbox.get_host(port)`` gives a reachable
    ``{port}-{id}.{domain}`` (with the API port when serving on localhost)."""
    if settings.domain == "localhost" and settings.port not in (80, 443):
        return f"localhost:{settings.port}"
    return settings.domain


def create_app(settings: Settings, runtime: Runtime | None = None) -> FastAPI:
    hub = Hub(settings, runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.orchestrator = await hub.start()
        try:
            yield
        finally:
            await hub.stop()

    app = FastAPI(title="agentenv", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.hub = hub
    app.state.settings = settings
    app.state.api_keys = settings.effective_api_keys()
    app.state.public_domain = public_domain(settings)
    install_error_handlers(app)

    async def orchestrator_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OrchestratorError)
        return error_response(exc.code, exc.message)

    app.add_exception_handler(OrchestratorError, orchestrator_error)

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        return Response(status_code=204)

    lifecycle = _optional_module("agentenv.api.routes_lifecycle")
    if lifecycle is not None and hasattr(lifecycle, "router"):
        # Registered first: its pause/resume/connect routes take precedence over ours.
        app.include_router(lifecycle.router)
    app.include_router(routes_sandboxes.router)
    app.include_router(routes_templates.router)

    def make_proxy(inner: Any) -> SandboxProxy:
        hub.proxy = SandboxProxy(inner, settings, lambda: hub.orchestrator)
        return hub.proxy

    app.add_middleware(_ProxyFactory, factory=make_proxy)
    return app


class _ProxyFactory:
    """Starlette instantiates middleware itself; this hands the created proxy to the hub."""

    def __init__(self, app: Any, factory: Any) -> None:
        self._proxy = factory(app)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._proxy(scope, receive, send)
