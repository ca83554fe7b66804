"""The operators' web console (``/console``) and the node status endpoints (``/node``), both our
extensions beside the E2B API. :func:`install` wires them into the application."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import RedirectResponse

from forkyard.api.console import node, routes
from forkyard.api.console.auth import LoginRequired
from forkyard.api.errors import error_response


async def _login_required(request: Request, exc: Exception) -> Response:
    """A page asked for without the key goes to the log-in form; anything else gets E2B's 401."""
    assert isinstance(exc, LoginRequired)
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        return RedirectResponse("/console/login", status_code=303)
    return error_response(401, exc.message)


def install(app: FastAPI) -> None:
    app.include_router(node.router)
    app.include_router(routes.public)
    app.include_router(routes.router)
    app.add_exception_handler(LoginRequired, _login_required)
