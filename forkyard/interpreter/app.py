"""The HTTP API the code-interpreter SDKs call (port 49999, through the sandbox proxy).

Errors are ``{"code": <status>, "message": ...}`` (the SDKs show the body's text): 400 for bad
input, 404 for an unknown context.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import ENVS_FILE
from .contexts import ContextNotFound, Contexts, SandboxEnvs
from .kernels import KernelDied
from .languages import DEFAULT_LANGUAGE, LANGUAGES, resolve

logger = logging.getLogger("forkyard.interpreter")


class BadRequest(ValueError):
    pass


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{key} must be a string")
    return value or None


def _env_vars(body: dict[str, Any]) -> dict[str, str]:
    envs = body.get("env_vars") or {}
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise BadRequest("env_vars must be an object of strings")
    for key in envs:
        if (
            not key
            or not (key[0].isalpha() or key[0] == "_")
            or not all(c.isalnum() or c == "_" for c in key)
        ):
            raise BadRequest(f"invalid environment variable name {key!r}")
    return envs


def _language(name: str | None):  # type: ignore[no-untyped-def]
    language = resolve(name)
    if language is None:
        supported = ", ".join(LANGUAGES)
        raise BadRequest(f"unsupported language {name!r}: one of {supported}")
    return language


async def execute(request: Request) -> Response:
    body = await json_body(request)
    code = body.get("code")
    if not isinstance(code, str):
        raise BadRequest("code must be a string")
    context_id = _optional_str(body, "context_id")
    language_name = _optional_str(body, "language")
    if context_id and language_name:
        raise BadRequest("give context_id or language, not both")
    envs = _env_vars(body)
    contexts: Contexts = request.app.state.contexts
    if context_id:
        context = contexts.get(context_id)
    else:
        context = await contexts.default(_language(language_name))
    sandbox_envs = await request.app.state.sandbox_envs.current()
    lines = _stream(context.kernel.run(code, sandbox_envs, envs))
    return StreamingResponse(lines, media_type="application/x-ndjson")


async def _stream(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for line in lines:
            yield _encode(line)
    except KernelDied as exc:
        yield _encode({"type": "error", "name": "KernelDied", "value": str(exc), "traceback": str(exc)})
    yield _encode({"type": "end_of_execution"})


def _encode(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":"), default=str).encode() + b"\n"


async def create_context(request: Request) -> Response:
    body = await json_body(request)
    language = _language(_optional_str(body, "language"))
    cwd = _optional_str(body, "cwd")
    if cwd is not None and not os.path.isabs(cwd):
        raise BadRequest(f"cwd must be an absolute path, not {cwd!r}")
    if cwd is not None and not await asyncio.to_thread(os.path.isdir, cwd):
        raise BadRequest(f"cwd {cwd!r} is not a directory")
    context = await request.app.state.contexts.create(language, cwd)
    return JSONResponse(context.as_json())


async def list_contexts(request: Request) -> Response:
    contexts: Contexts = request.app.state.contexts
    return JSONResponse([c.as_json() for c in contexts.by_id.values()])


async def delete_context(request: Request) -> Response:
    await request.app.state.contexts.delete(request.path_params["context_id"])
    return Response(status_code=204)


async def restart_context(request: Request) -> Response:
    await request.app.state.contexts.restart(request.path_params["context_id"])
    return Response(status_code=204)


async def health(request: Request) -> Response:
    return JSONResponse("OK")


async def _bad_request(request: Request, exc: Exception) -> Response:
    return error(400, str(exc))


async def _not_found(request: Request, exc: Exception) -> Response:
    return error(404, str(exc))


async def _kernel_died(request: Request, exc: Exception) -> Response:
    return error(500, str(exc))


def create_app(
    home: str, warm_languages: tuple[str, ...] = (DEFAULT_LANGUAGE,), envs_file: str = ENVS_FILE
) -> Starlette:
    contexts = Contexts(home)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Warm before the port opens: the template's ready check then snapshots a started kernel.
        for name in warm_languages:
            language = resolve(name)
            if language is not None:
                await contexts.default(language)
        try:
            yield
        finally:
            await contexts.close()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/execute", execute, methods=["POST"]),
            Route("/contexts", create_context, methods=["POST"]),
            Route("/contexts", list_contexts, methods=["GET"]),
            Route("/contexts/{context_id}", delete_context, methods=["DELETE"]),
            Route("/contexts/{context_id}/restart", restart_context, methods=["POST"]),
        ],
        exception_handlers={
            BadRequest: _bad_request,
            ContextNotFound: _not_found,
            KernelDied: _kernel_died,
        },
        lifespan=lifespan,
    )
    app.state.contexts = contexts
    app.state.sandbox_envs = SandboxEnvs(envs_file)
    return app
