"""The envd ASGI app: HTTP routes plus the Connect RPC services in one Starlette app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from forkyard.envd.filesystem import access as fsaccess
from forkyard.envd.filesystem.freeze import fsfreeze, fsthaw
from forkyard.envd.filesystem.metadata_store import default_store
from forkyard.envd.filesystem.service import FilesystemService
from forkyard.envd.http import metrics
from forkyard.envd.http.common import EXCEPTION_HANDLERS, error_response, json_object
from forkyard.envd.http.files import compose, download, upload
from forkyard.envd.http.rpc import FILESYSTEM_SERVICE, PROCESS_SERVICE, filesystem_app, process_app
from forkyard.envd.http.signature import signature_refusal
from forkyard.envd.process.loginenv import LoginEnvironments, LoginKey
from forkyard.envd.process.processes import ProcessTable
from forkyard.envd.process.reaper import reap_orphans_forever
from forkyard.envd.process.service import ProcessService
from forkyard.envd.process.spawn import Spawner
from forkyard.envd.process.sudo import SudoBroker
from forkyard.envd.settings import EnvdSettings
from forkyard.envd.state import EnvdState
from forkyard.errors import Invalid, Unauthenticated
from forkyard.types import ENVD_INIT_REVALIDATE

logger = logging.getLogger("forkyard.envd")

_OPEN_PATHS = frozenset({"/health"})
#: Open to processes inside the sandbox (a loopback peer; the proxy comes over the veth): the
#: code interpreter's server reads the sandbox's variables here, which every process envd starts
#: holds anyway.
_OPEN_TO_LOOPBACK = frozenset({"/envs"})
_LOOPBACK = frozenset({"127.0.0.1", "::1"})


class AccessTokenMiddleware:
    """Once a token is set (flag, env or ``/init``), everything but /health needs ``X-Access-Token``
    (or, on /files, a valid v1 signature)."""

    def __init__(self, app: ASGIApp, state: EnvdState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.state.access_token or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if scope["path"] in _OPEN_TO_LOOPBACK and (scope.get("client") or ("",))[0] in _LOOPBACK:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if self.state.token_matches(request.headers.get("x-access-token")):
            await self.app(scope, receive, send)
            return
        message = "missing or invalid access token (X-Access-Token)"
        if scope["path"] == "/files":
            if request.headers.get("x-access-token"):
                message = "access token present in header but does not match"  # as E2B's envd
            else:
                refusal = signature_refusal(request, self.state.access_token)
                if refusal is None:
                    await self.app(scope, receive, send)
                    return
                message = refusal
        if scope["path"].startswith((f"/{PROCESS_SERVICE}/", f"/{FILESYSTEM_SERVICE}/")):
            # An RPC client reads Connect's error shape (a code name), not E2B's HTTP one.
            response: Response = JSONResponse(
                {"code": "unauthenticated", "message": message}, status_code=401
            )
        else:
            response = error_response(Unauthenticated(message))
        await response(scope, receive, send)


async def health(request: Request) -> Response:
    return Response(status_code=204)


async def init(request: Request) -> Response:
    state: EnvdState = request.app.state.envd
    body = json_object(await request.body() or b"{}", "/init")
    env_vars = body.get("envVars")
    if env_vars is not None and (
        not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values())
    ):
        raise Invalid("envVars must be an object of strings")
    for key in ("accessToken", "defaultUser", "defaultWorkdir", "timestamp"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise Invalid(f"{key} must be a string")
    revalidate = body.get(ENVD_INIT_REVALIDATE, True)
    if not isinstance(revalidate, bool):
        raise Invalid(f"{ENVD_INIT_REVALIDATE} must be a boolean")
    if body.get("timestamp"):
        try:
            host_time = datetime.fromisoformat(body["timestamp"].replace("Z", "+00:00"))
        except ValueError:
            raise Invalid(f"timestamp '{body['timestamp']}' is not RFC 3339") from None
        if request.app.state.sync_clock:
            sync_clock(host_time.timestamp())
    if env_vars:
        state.set_env_vars(env_vars)
    if body.get("accessToken"):
        state.access_token = body["accessToken"]
    if body.get("defaultUser"):
        state.default_user = body["defaultUser"]
    if body.get("defaultWorkdir"):
        state.default_workdir = body["defaultWorkdir"]
    prepare_logins(request.app.state.logins, state, revalidate=revalidate)
    return Response(status_code=204)


#: The longest envd's start-up waits for the default user's login capture.
STARTUP_CAPTURE_WAIT_S = 5.0


def prepare_logins(logins: LoginEnvironments, state: EnvdState, *, revalidate: bool = True) -> None:
    """At start-up and on ``/init`` (every create, restore, resume and fork): captured logins
    stand only if nothing they read changed meanwhile; the one the default user's commands need
    is captured now, in the background (at start-up: before a template snapshot is taken)."""
    if revalidate:
        logins.revalidate()
    try:
        user = state.user(None)
    except Unauthenticated:
        return  # a default user the sandbox lacks: its commands fail anyway
    logins.prewarm(LoginKey.of(user, state.command_cwd(user), state.process_env(user, {})))


#: Skew below which the clock is left alone (the host's timestamp is already a little old).
CLOCK_SKEW_TOLERANCE_S = 1.0


def sync_clock(host_time: float, setter: Callable[[int, float], None] = time.clock_settime) -> bool:
    """Step CLOCK_REALTIME to the host's time after a resume; True when it was set. Not being
    allowed (no CAP_SYS_TIME, gVisor) is expected and ignored, as E2B's envd does."""
    if abs(host_time - time.time()) < CLOCK_SKEW_TOLERANCE_S:
        return False
    try:
        setter(time.CLOCK_REALTIME, host_time)
    except OSError as exc:
        logger.info("not setting the clock from /init: %s", exc)
        return False
    return True


async def envs(request: Request) -> Response:
    state: EnvdState = request.app.state.envd
    return JSONResponse(state.env_vars)


async def get_metrics(request: Request) -> Response:
    sampler: metrics.CpuSampler = request.app.state.cpu
    return JSONResponse(await asyncio.to_thread(metrics.collect, sampler))


def create_app(settings: EnvdSettings) -> Starlette:
    state = EnvdState(
        access_token=settings.access_token,
        default_workdir=settings.default_workdir,
        envs_file=settings.envs_file,
    )
    state.publish_env_vars()  # none yet: readers find the file from the start
    fsaccess.configure(as_the_user=settings.files_as_user)
    spawner = Spawner()
    table = ProcessTable(spawner, stream_buffer_bytes=settings.stream_buffer_mib * 1024 * 1024)
    logins = LoginEnvironments(spawner)
    filesystem = FilesystemService(state)
    sudo_broker = SudoBroker(spawner)
    default_store().start()  # as envd itself, before any request acts as a user (metadata store)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        reaper = asyncio.create_task(reap_orphans_forever(spawner.live_pids))
        if os.getpid() == 1:  # in a sandbox; never on a host (sudo.py)
            sudo_broker.start()
        prepare_logins(logins, state)
        # Answer only once the default user's login is captured: a template snapshot is taken as
        # soon as envd answers, and one taken mid-capture left every sandbox restored from it
        # running its first commands with the profile (2-4 commands at 110-170 ms, not 35-50).
        await logins.settled(STARTUP_CAPTURE_WAIT_S)
        try:
            yield
        finally:
            reaper.cancel()
            await sudo_broker.close()
            filesystem.close()
            logins.close()
            await table.shutdown()
            spawner.close()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/init", init, methods=["POST"]),
            Route("/envs", envs, methods=["GET"]),
            Route("/metrics", get_metrics, methods=["GET"]),
            Route("/files", download, methods=["GET"]),
            Route("/files", upload, methods=["POST"]),
            Route("/files/compose", compose, methods=["POST"]),
            Route("/fsfreeze", fsfreeze, methods=["POST"]),
            Route("/fsthaw", fsthaw, methods=["POST"]),
            Mount(f"/{PROCESS_SERVICE}", app=process_app(ProcessService(state, table, logins))),
            Mount(f"/{FILESYSTEM_SERVICE}", app=filesystem_app(filesystem)),
        ],
        middleware=[
            # Browsers (the JS SDK in a page) preflight without the token: CORS goes first.
            Middleware(
                CORSMiddleware,
                allow_origins=["*"],
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["*"],
                max_age=7200,
            ),
            Middleware(AccessTokenMiddleware, state=state),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.envd = state
    app.state.logins = logins
    app.state.cpu = metrics.CpuSampler()
    app.state.sync_clock = settings.sync_clock
    return app
