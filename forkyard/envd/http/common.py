"""Bits every envd HTTP route needs: errors in E2B's shape (the one HTTP error edge), JSON bodies.

Routes raise the kinds of :mod:`forkyard.errors`; the handlers here turn them into
``{"code": <status>, "message": ...}`` with :func:`forkyard.errors.http_status`. Statuses that
belong to HTTP itself (routing's 404/405, content negotiation's 406) are Starlette's
``HTTPException`` and answered in the same shape.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from forkyard.errors import Failed, ForkyardError, Invalid, error_body, http_status


def error_response(exc: ForkyardError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=http_status(exc))


async def _forkyard_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ForkyardError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"code": exc.status_code, "message": exc.detail}, status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises the exception after this answer, so its traceback still reaches the log.
    return error_response(Failed(f"internal error: {exc}"))


#: Starlette's ``exception_handlers`` for envd's app.
EXCEPTION_HANDLERS = {ForkyardError: _forkyard_error, HTTPException: _http_error, Exception: _internal_error}


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    """A request body that must be a JSON object; raises Invalid otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Invalid(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise Invalid(f"the {what} body must be a JSON object")
    return body
