"""Every control-plane error leaves in E2B's shape: ``{"code": <int>, "message": <str>}``.

FastAPI's own ``{"detail": ...}`` bodies (validation errors, 404 for unknown routes, 405) are
rewritten here, so the SDK's ``handle_api_exception`` always finds a ``message``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered to the API client as ``{"code", "message"}`` with HTTP status ``code``."""

    def __init__(self, code: int, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers = headers or {}


def error_body(code: int, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}


def error_response(code: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    # A client error is final: tell the SDK's retrying transport not to try again (it would
    # otherwise retry 502/503/504 that carry no Should-Retry header).
    all_headers = {"Should-Retry": "false", **(headers or {})}
    return JSONResponse(error_body(code, message), status_code=code, headers=all_headers)


def error_bytes(code: int, message: str) -> bytes:
    return json.dumps(error_body(code, message)).encode()


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


async def _api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.code, exc.message, exc.headers)


async def _validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(400, _describe_validation_error(exc))


async def _http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return error_response(exc.status_code, message, dict(exc.headers or {}))


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal server error: {type(exc).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
