"""The FastAPI application: control plane + sandbox proxy, wired to one orchestrator."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response

from forkyard.api import (
    code_interpreter,
    routes_fork_stream,
    routes_lifecycle,
    routes_network,
    routes_sandboxes,
    routes_templates,
    routes_volumes,
)
from forkyard.api.console import install as install_console
from forkyard.api.e2b_wire import http_domain
from forkyard.api.errors import install_error_handlers
from forkyard.api.limits import BodyLimit
from forkyard.api.proxy import SandboxProxy
from forkyard.config import Settings
from forkyard.orchestrator.lifecycle import Orchestrator, build_orchestrator
from forkyard.runtime.base import Runtime
from forkyard.runtime.kinds import select_runtime

log = logging.getLogger(__name__)


class Hub:
    """What the proxy and the routes share; filled in by the lifespan."""

    def __init__(self, settings: Settings, runtime: Runtime | None) -> None:
        self.settings = settings
        self.runtime = runtime
        self._orchestrator: Orchestrator | None = None
        self.proxy: SandboxProxy | None = None

    @property
    def orchestrator(self) -> Orchestrator:
        if self._orchestrator is None:
            raise RuntimeError("the orchestrator is not started")
        return self._orchestrator

    async def start(self) -> Orchestrator:
        if self.runtime is None:
            self.runtime, _ = select_runtime(self.settings)
        self._orchestrator = build_orchestrator(self.settings, self.runtime)
        # Dependencies point down: the API asks to hear when a sandbox leaves running, and its
        # proxy then ends the streams it has open to it.
        self._orchestrator.route_table.subscribe(self._sandbox_left)
        await self._orchestrator.start()
        return self._orchestrator

    def _sandbox_left(self, sandbox_id: str) -> None:
        if self.proxy is not None:
            self.proxy.sandbox_left(sandbox_id)

    async def stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.aclose()
        if self._orchestrator is not None:
            await self._orchestrator.close()


def create_app(
    settings: Settings, runtime: Runtime | None = None, *, public_domain: str | None = None
) -> FastAPI:
    """The node's app. ``public_domain``: the ``domain`` answered to SDKs when it is not the plain
    HTTP listener's (the HTTPS listener's, ``forkyard serve`` with TLS)."""
    hub = Hub(settings, runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.orchestrator = await hub.start()
        await code_interpreter.build_in_background(app.state)
        try:
            yield
        finally:
            await hub.stop()

    app = FastAPI(title="forkyard", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.hub = hub
    app.state.settings = settings
    app.state.api_keys = settings.effective_api_keys()
    app.state.public_domain = public_domain or http_domain(settings)
    install_error_handlers(app)

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        return Response(status_code=204)

    app.include_router(routes_sandboxes.router)
    app.include_router(routes_network.router)
    # DELETE /templates/{id} (a template or a user snapshot: one namespace in E2B) is the
    # templates router's only.
    app.include_router(routes_templates.router)
    app.include_router(routes_lifecycle.router)
    app.include_router(routes_fork_stream.router)  # ours: children as they come up
    app.include_router(routes_volumes.router)
    app.include_router(routes_volumes.content_router)  # the volume's token, not the API key
    install_console(app)  # /console and /node: our extensions (forkyard/api/console)

    def make_proxy(inner: Any) -> SandboxProxy:
        hub.proxy = SandboxProxy(inner, settings, lambda: hub.orchestrator)
        return hub.proxy

    # Inside the proxy: only control-plane requests (E2B's 16 MiB cap, limits.py).
    app.add_middleware(BodyLimit)
    app.add_middleware(_ProxyFactory, factory=make_proxy)
    if settings.role == "node":  # cluster mode: only gateways, signed; heartbeats (api/node_role.py)
        from forkyard.api import node_role

        node_role.install(app, settings)
    return app


class _ProxyFactory:
    """Starlette instantiates middleware itself; this hands the created proxy to the hub."""

    def __init__(self, app: Any, factory: Any) -> None:
        self._proxy = factory(app)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._proxy(scope, receive, send)
