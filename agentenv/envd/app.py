"""The envd ASGI app: HTTP routes plus the Connect RPC services in one Starlette app."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentenv.envd.settings import EnvdSettings


async def health(request: Request) -> Response:
    return Response(status_code=204)


def create_app(settings: EnvdSettings) -> Starlette:
    app = Starlette(routes=[Route("/health", health, methods=["GET"])])
    app.state.settings = settings
    return app
