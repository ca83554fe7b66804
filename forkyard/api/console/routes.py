"""The web console at ``/console``: server-rendered pages (Jinja2) over the orchestrator, POST
forms for the actions, one small hand-written script for the browser terminal (static/).

Every action goes through the same orchestrator calls as the E2B API (kill, pause, resume,
snapshot, snapshot delete), so the state machine and its errors are the API's. An action that fails
shows the error's message on the page it came from.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import urllib.parse
from importlib import resources
from typing import Any

import httpx
import jinja2
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from forkyard.api.auth import check_key
from forkyard.api.console import charts
from forkyard.api.console.auth import COOKIE, COOKIE_PATH, console_key, require_console_key
from forkyard.api.console.node import NodeHistory, node_status
from forkyard.errors import ForkyardError, Invalid, NotFound
from forkyard.orchestrator import templates
from forkyard.orchestrator.ids import normalise_sandbox_id
from forkyard.orchestrator.lifecycle import Orchestrator
from forkyard.orchestrator.store import ListQuery, SandboxRecord
from forkyard.storage.snapshots import SnapshotRow
from forkyard.types import ENVD_PORT, LISTED_STATES, SandboxState

PACKAGE = "forkyard.api.console"
STATIC_TYPES = {"console.css": "text/css", "terminal.js": "text/javascript"}
#: The timeout (seconds) a resume from the console gives the sandbox, as the SDK's default.
RESUME_TIMEOUT = 300
LOG_LINES = 200

_env = jinja2.Environment(
    loader=jinja2.PackageLoader(PACKAGE, "templates"),
    autoescape=jinja2.select_autoescape(["html"]),
    undefined=jinja2.StrictUndefined,
)

public = APIRouter(prefix="/console", include_in_schema=False)
router = APIRouter(prefix="/console", include_in_schema=False, dependencies=[Depends(require_console_key)])


def _orch(request: Request) -> Orchestrator:
    orch: Orchestrator = request.app.state.orchestrator
    return orch


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    page = _env.get_template(name).render(
        request=request,
        notice=request.query_params.get("notice"),
        error=request.query_params.get("error"),
        **context,
    )
    return HTMLResponse(page, status_code=status_code)


def back(to: str, *, notice: str | None = None, error: str | None = None) -> RedirectResponse:
    """Post/redirect/get: the result of an action shows on the page it came from."""
    query = urllib.parse.urlencode({k: v for k, v in (("notice", notice), ("error", error)) if v})
    return RedirectResponse(f"{to}?{query}" if query else to, status_code=303)


async def form(request: Request) -> dict[str, str]:
    """An urlencoded form body (python-multipart is not a dependency: the forms are tiny)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    return dict(urllib.parse.parse_qsl(body, keep_blank_values=True))


def age(since: dt.datetime) -> str:
    seconds = int((dt.datetime.now(dt.UTC) - since).total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def until(when: dt.datetime) -> str:
    if when <= dt.datetime.now(dt.UTC):
        return "now"
    return age(dt.datetime.now(dt.UTC) - (when - dt.datetime.now(dt.UTC)))


_env.filters["age"] = age
_env.filters["until"] = until


# -- log-in ------------------------------------------------------------------------------------


@public.get("/login")
async def login_page(request: Request) -> HTMLResponse:
    return render(request, "login.html")


@public.post("/login")
async def login(request: Request) -> Response:
    key = (await form(request)).get("api_key", "").strip()
    if not check_key(key, request.app.state.api_keys):
        return render(request, "login.html", status_code=401, login_error="invalid API key")
    resp = RedirectResponse("/console/sandboxes", status_code=303)
    resp.set_cookie(
        COOKIE,
        key,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return resp


@public.post("/logout")
async def logout() -> Response:
    resp = RedirectResponse("/console/login", status_code=303)
    resp.delete_cookie(COOKIE, path=COOKIE_PATH)
    return resp


@public.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC_TYPES:
        raise NotFound(f"no console file {name!r}")
    body = resources.files(PACKAGE).joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC_TYPES[name], headers={"Cache-Control": "no-cache"})


# -- sandboxes ---------------------------------------------------------------------------------


@router.get("")
async def home() -> Response:
    return RedirectResponse("/console/sandboxes", status_code=303)


def _state_name(rec: SandboxRecord) -> str:
    if rec.state == SandboxState.PAUSED:
        return f"paused ({rec.pause_tier or 'disk'})"
    return str(rec.state)


@router.get("/sandboxes")
async def sandboxes(request: Request) -> HTMLResponse:
    orch = _orch(request)
    recs = await orch.list_sandboxes(ListQuery(states=LISTED_STATES))
    usage: dict[str, Any] = {}
    for rec in recs:
        samples = []
        if rec.state == SandboxState.RUNNING:
            # A sandbox killed or paused since the listing has no metrics: show none.
            with contextlib.suppress(ForkyardError):
                samples = await orch.metrics(rec.sandbox_id)
        usage[rec.sandbox_id] = samples[-1].metrics if samples else None
    return render(request, "sandboxes.html", sandboxes=recs, usage=usage, state_name=_state_name)


@router.get("/sandboxes/{sandbox_id}")
async def sandbox_page(request: Request, sandbox_id: str) -> HTMLResponse:
    orch = _orch(request)
    sid = normalise_sandbox_id(sandbox_id)
    rec = await orch.get(sid)
    samples = await orch.metrics(sid) if rec.state == SandboxState.RUNNING else []
    lines = await orch.sandbox_logs(sid, start=None, limit=10_000)
    snaps = await orch.list_snapshots(sid)
    return render(
        request,
        "sandbox.html",
        sb=rec,
        state_name=_state_name(rec),
        metric=samples[-1].metrics if samples else None,
        cpu_chart=charts.line_chart(
            [(s.at.timestamp(), s.metrics.cpu_used_pct) for s in samples], unit="%", title="CPU used"
        ),
        mem_chart=charts.line_chart(
            [(s.at.timestamp(), s.metrics.mem_used / (1 << 20)) for s in samples], unit=" MiB", title="memory"
        ),
        logs=lines[-LOG_LINES:],
        snapshots=snaps,
    )


@router.get("/sandboxes/{sandbox_id}/terminal")
async def terminal_page(request: Request, sandbox_id: str) -> HTMLResponse:
    rec = await _orch(request).get(normalise_sandbox_id(sandbox_id))
    if rec.state != SandboxState.RUNNING:
        return back(f"/console/sandboxes/{rec.sandbox_id}", error="resume the sandbox to open a terminal")  # type: ignore[return-value]
    return render(
        request,
        "terminal.html",
        sb=rec,
        envd_port=ENVD_PORT,
        access_token=rec.envd_access_token or "",
    )


async def _act(orch: Orchestrator, sid: str, action: str, fields: dict[str, str]) -> str:
    if action == "kill":
        await orch.kill(sid)
        return f"killed {sid}"
    if action == "pause":
        await orch.pause(sid)
        return f"paused {sid}"
    if action == "resume":
        await orch.resume(sid, RESUME_TIMEOUT)
        return f"resumed {sid}"
    if action == "snapshot":
        row = await orch.create_snapshot(sid, fields.get("name") or None)
        return f"snapshot {row.snapshot_id} of {sid}"
    raise Invalid(f"unknown action {action!r}: expected kill, pause, resume or snapshot")


@router.post("/sandboxes/{sandbox_id}/{action}")
async def sandbox_action(request: Request, sandbox_id: str, action: str) -> Response:
    fields = await form(request)
    sid = normalise_sandbox_id(sandbox_id)
    # Only back to a console page: the form field must not turn this into an open redirect.
    to = fields.get("back", "")
    if not to.startswith("/console/"):
        to = "/console/sandboxes"
    if action == "kill" and to.startswith(f"/console/sandboxes/{sid}"):
        to = "/console/sandboxes"  # its own page is gone
    try:
        notice = await _act(_orch(request), sid, action, fields)
    except ForkyardError as exc:
        return back(to, error=exc.message)
    return back(to, notice=notice)


# -- snapshots ---------------------------------------------------------------------------------


def chain(row: SnapshotRow, by_id: dict[str, SnapshotRow], origin: dict[str, str | None]) -> list[str]:
    """The snapshot's lineage, itself first: its parent snapshot (the one its memory and disk
    layers were taken on top of), else the snapshot its source sandbox was restored from (a
    template's or a user's); an ancestor that is no longer listed ends the chain by its id."""
    out, seen = [row.snapshot_id], {row.snapshot_id}
    current: SnapshotRow | None = row
    while current is not None:
        nxt = current.parent_id or origin.get(current.source_sandbox_id)
        if not nxt or nxt in seen:
            break
        out.append(nxt)
        seen.add(nxt)
        current = by_id.get(nxt)
    return out


@router.get("/snapshots")
async def snapshots_page(request: Request) -> HTMLResponse:
    orch = _orch(request)
    rows = await orch.catalog.rows()
    by_id = {r.snapshot_id: r for r in rows}
    origin: dict[str, str | None] = {}
    for sid in {r.source_sandbox_id for r in rows}:
        rec = await orch.store.get(sid)  # killed sandboxes keep their record (and their origin)
        origin[sid] = rec.restored_from if rec is not None else None
    listed = sorted(rows, key=lambda r: r.created_at, reverse=True)
    return render(
        request,
        "snapshots.html",
        rows=listed,
        chains={r.snapshot_id: chain(r, by_id, origin) for r in listed},
    )


@router.post("/snapshots/{snapshot_id}/delete")
async def delete_snapshot(request: Request, snapshot_id: str) -> Response:
    try:
        await _orch(request).delete_snapshot(snapshot_id)
    except ForkyardError as exc:
        return back("/console/snapshots", error=exc.message)
    return back("/console/snapshots", notice=f"deleted snapshot {snapshot_id}")


# -- templates and node ------------------------------------------------------------------------


def _build_routes(request: Request) -> list[str]:
    """The template build API's paths, where another part of the server provides them."""
    paths = {getattr(r, "path", "") for r in request.app.routes}
    wanted = ("/v3/templates", "/templates/{template_id}/builds/{build_id}/status")
    return [p for p in paths if p.startswith(wanted[0]) or "/builds/" in p or p == wanted[1]]


@router.get("/templates")
async def templates_page(request: Request) -> HTMLResponse:
    infos = templates.list_all(request.app.state.settings)
    builds_api = any(p.endswith("/builds/{build_id}/logs") for p in _build_routes(request))
    return render(request, "templates.html", templates=infos, builds_api=builds_api)


@router.get("/templates/{template_id}/builds/{build_id}/logs")
async def build_logs_page(request: Request, template_id: str, build_id: str) -> HTMLResponse:
    """A build's logs, read from the build API in process (so the console shows whatever that API
    serves, with its errors) with the console user's key."""
    path = f"/templates/{urllib.parse.quote(template_id)}/builds/{urllib.parse.quote(build_id)}/logs"
    headers = {"X-API-Key": console_key(request) or ""}
    entries: list[dict[str, Any]] = []
    problem = None
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=request.app), base_url="http://console"
    ) as c:
        cursor: int | None = None
        while True:  # the API pages 100 entries at a time
            resp = await c.get(
                path, headers=headers, params={"limit": 100, **({"cursor": cursor} if cursor else {})}
            )
            if resp.is_error:
                problem = resp.json().get("message", resp.reason_phrase)
                break
            page = [e for e in resp.json()["logs"] if e not in entries]
            entries += page
            if len(page) == 0 or len(resp.json()["logs"]) < 100:
                break
            last = dt.datetime.fromisoformat(str(page[-1]["timestamp"]).replace("Z", "+00:00"))
            cursor = int(last.timestamp() * 1000)
    return render(
        request,
        "build_logs.html",
        template_id=template_id,
        build_id=build_id,
        entries=entries,
        problem=problem,
    )


@router.get("/node")
async def node_page(request: Request) -> HTMLResponse:
    status = await node_status(request.app)
    history: NodeHistory = request.app.state.node_history
    samples = list(history.samples)
    ops = sorted({op for s in samples for op in s["latencyMs"]})
    latency_chart = charts.multi_line_chart(
        {op: [(s["t"], s["latencyMs"][op]) for s in samples if op in s["latencyMs"]] for op in ops},
        unit=" ms",
        title="lifecycle latency (mean per interval)",
    )
    capacity_chart = charts.multi_line_chart(
        {
            "available MiB": [(s["t"], s["memoryAvailableMiB"]) for s in samples],
            "allocated MiB": [(s["t"], s["allocatedMemoryMiB"]) for s in samples],
        },
        unit=" MiB",
        title="node memory",
    )
    count_chart = charts.multi_line_chart(
        {state: [(s["t"], s["byState"].get(state, 0)) for s in samples] for state in ("running", "paused")},
        unit="",
        title="sandboxes",
    )
    return render(
        request,
        "node.html",
        status=status,
        latency_chart=latency_chart,
        capacity_chart=capacity_chart,
        count_chart=count_chart,
        samples=len(samples),
    )
