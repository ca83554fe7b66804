"""The API edge of the error vocabulary: every control-plane error leaves in E2B's shape,
``{"code": <int>, "message": <str>}``.

Layers below raise the kinds of :mod:`forkyard.errors`; they are turned into a status and body
here, once. FastAPI's own ``{"detail": ...}`` bodies (validation errors, 404 for unknown routes,
405) are rewritten too, so the SDK's ``handle_api_exception`` always finds a ``message``.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forkyard.errors import ForkyardError, http_status
from forkyard.storage.db.outage import UNAVAILABLE_MESSAGE, connection_lost

log = logging.getLogger(__name__)


def error_response(code: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    # A client error is final: tell the SDK's retrying transport not to try again (it would
    # otherwise retry 502/503/504 that carry no Should-Retry header).
    all_headers = {"Should-Retry": "false", **(headers or {})}
    return JSONResponse({"code": code, "message": message}, status_code=code, headers=all_headers)


def _describe_validation_error(exc: RequestValidationError) -> str:
    """One readable line per problem, e.g. ``body.timeout: Input should be greater than or equal to 0``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body" or len(err.get("loc", ())) == 1)
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            msg = "request body is not valid JSON"
            loc = "body"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


async def _forkyard_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ForkyardError)
    return error_response(http_status(exc), exc.message)


async def _validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(400, _describe_validation_error(exc))


async def _http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return error_response(exc.status_code, message, dict(exc.headers or {}))


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    if connection_lost(exc):  # the registry out of reach where no layer below said so: E2B's 503
        log.warning("%s %s: registry unreachable: %s", request.method, request.url.path, exc)
        return error_response(503, UNAVAILABLE_MESSAGE)
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal server error: {type(exc).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ForkyardError, _forkyard_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
