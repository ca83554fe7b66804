"""The orchestrator: sandbox lifecycle on top of a :class:`~agentenv.runtime.base.Runtime`.

State machine (per sandbox, every transition under that sandbox's lock)::

    creating --> running --> killing --> killed
                    |  ^
                    v  |          (pause/resume: the snapshot helper's hooks)
                 pausing -> paused -> resuming

Timeouts are enforced by a background task: a running sandbox whose ``end_at`` passed is killed,
or handed to :attr:`Orchestrator.pause_hook` when it was created with ``autoPause``.

Extension points for the snapshot/lifecycle code (``agentenv/orchestrator/snapshots.py``):
- :attr:`Orchestrator.pause_hook` ``(orchestrator, record) -> None``: called under the sandbox's
  lock when an ``autoPause`` sandbox times out; it must leave ``record`` paused (and saved).
- :attr:`Orchestrator.resume_hook` ``(orchestrator, record, timeout) -> SandboxRecord``: called
  under the lock by ``connect`` for a paused sandbox; it must return the running record.
- :attr:`Orchestrator.fast_create_hook` ``(request, template, runtime) -> SandboxRecord | None``:
  asked first by every create from a template; it claims a warm-pool sandbox or restores the
  template's snapshot, or returns None and the template is booted.
- :attr:`Orchestrator.destroyed_hook` ``(record)``: after a sandbox was torn down (frees shared
  disk layers it was the last user of).
- :attr:`Orchestrator.revive_hook` ``(record) -> bool``: at start-up, for a sandbox recorded running
  but found stopped (a crash mid-fork leaves the parent checkpointed): restore it if it can.
- :meth:`Orchestrator.locked`, :meth:`attach`, :meth:`detach`, ``store`` and ``runtime_for``
  give it what it needs to run transitions of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import httpx

from agentenv.config import Settings
from agentenv.types import ENVD_VERSION
from agentenv.orchestrator import templates
from agentenv.orchestrator.ids import new_access_token, new_sandbox_id
from agentenv.orchestrator.runtimes import runtime_by_name
from agentenv.orchestrator.store import LIVE_STATES, ListQuery, LogLine, SandboxRecord, SandboxStore
from agentenv.runtime.base import Runtime, RuntimeError_
from agentenv.types import SandboxInstance, SandboxMetrics, SandboxSpec, TemplateImage

log = logging.getLogger(__name__)

CLIENT_ID = "agentenv"
DEFAULT_USER = "user"
DEFAULT_WORKDIR = "/home/user"
REAPER_INTERVAL_SECONDS = 0.5
METRICS_INTERVAL_SECONDS = 5.0
METRICS_HISTORY = 720  # one hour at 5 s
INIT_ATTEMPTS = 20
IDEMPOTENCY_KEYS_KEPT = 10_000
#: Runtime log files in ``{data_dir}/sandboxes/<id>/`` collected into the sandbox's logs.
RUNTIME_LOG_FILES = ("envd.log",)
LOG_READ_LIMIT = 1 << 20


class OrchestratorError(Exception):
    """A lifecycle operation failed; ``code`` is the HTTP status to answer with."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SandboxNotFound(OrchestratorError):
    def __init__(self, sandbox_id: str) -> None:
        super().__init__(404, f"sandbox {sandbox_id!r} not found")


@dataclass(frozen=True)
class CreateRequest:
    template_id: str
    timeout_seconds: int
    metadata: dict[str, str]
    envs: dict[str, str]
    secure: bool
    allow_internet_access: bool | None
    auto_pause: bool = False
    auto_resume: bool = False
    allow_public_traffic: bool = True
    network: dict[str, object] | None = None


@dataclass(frozen=True)
class Route:
    """Where the proxy sends a sandbox's traffic."""

    sandbox_id: str
    address: str
    envd_url: str
    traffic_access_token: str | None


@dataclass(frozen=True)
class MetricSample:
    at: dt.datetime
    metrics: SandboxMetrics


PauseHook = Callable[["Orchestrator", SandboxRecord], Awaitable[None]]
ResumeHook = Callable[["Orchestrator", SandboxRecord, int], Awaitable[SandboxRecord]]
#: Creates the sandbox without booting (warm pool, template snapshot), or returns None.
FastCreateHook = Callable[
    [CreateRequest, "templates.TemplateInfo", Runtime], Awaitable["SandboxRecord | None"]
]
DestroyedHook = Callable[[SandboxRecord], Awaitable[None]]
#: Restarts a "running" sandbox found stopped at start-up from a checkpoint it left; True if it did.
ReviveHook = Callable[[SandboxRecord], Awaitable[bool]]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def raise_creation_failure(exc: BaseException, what: str) -> NoReturn:
    """Re-raise why a create or restore failed (its sandbox already cleaned up) as the error the
    API reports: runtime failures keep their status, anything unexpected is a 500."""
    if isinstance(exc, RuntimeError_):
        raise OrchestratorError(exc.code, f"{what} failed: {exc.message}") from None
    if isinstance(exc, OrchestratorError):
        raise exc
    if isinstance(exc, Exception):
        raise OrchestratorError(500, f"{what} failed: {exc}") from exc
    raise exc


class Orchestrator:
    def __init__(self, settings: Settings, runtime: Runtime) -> None:
        self.settings = settings
        self.runtime = runtime
        self.store = SandboxStore(settings.db_path)
        self._runtimes: dict[str, Runtime] = {runtime.name: runtime}
        self._locks: dict[str, asyncio.Lock] = {}
        self._routes: dict[str, Route] = {}
        self._metrics: dict[str, list[MetricSample]] = {}
        self._background: set[asyncio.Task[object]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._idempotency: dict[str, str] = {}
        self._log_locks: dict[str, asyncio.Lock] = {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0), trust_env=False)
        self.pause_hook: PauseHook | None = None
        self.resume_hook: ResumeHook | None = None
        self.fast_create_hook: FastCreateHook | None = None
        self.destroyed_hook: DestroyedHook | None = None
        self.revive_hook: ReviveHook | None = None

    # -- start-up and shut-down ----------------------------------------------------------------

    async def start(self) -> None:
        await self.store.open()
        await self.recover()
        self._reaper = asyncio.create_task(self._reap_forever(), name="agentenv-reaper")

    async def close(self) -> None:
        """Stop background work. Running sandboxes keep running: a restarted server re-attaches."""
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=30)
        await self._http.aclose()
        await self.store.close()

    async def recover(self) -> None:
        """Re-attach sandboxes that survived a server restart; kill and clean the rest; then have
        the runtime remove resources no record accounts for."""
        for rec in await self.store.in_states(LIVE_STATES):
            runtime = self.runtime_for(rec)
            alive = rec.state == "running" and rec.instance is not None
            if alive:
                assert rec.instance is not None
                try:
                    alive = await runtime.is_alive(rec.instance)
                except Exception as exc:
                    log.warning("recovery: cannot tell whether %s is alive: %s", rec.sandbox_id, exc)
                    alive = False
            if alive:
                self.attach(rec)
                log.info("recovery: re-attached running sandbox %s", rec.sandbox_id)
                continue
            if rec.state == "running" and self.revive_hook is not None and await self.revive_hook(rec):
                log.info("recovery: revived sandbox %s from its last checkpoint", rec.sandbox_id)
                continue
            log.info("recovery: sandbox %s (%s) is gone; cleaning up", rec.sandbox_id, rec.state)
            await self._destroy(rec, reason=f"server restart found it {rec.state} but not alive")
        keep = {r.sandbox_id for r in await self.store.in_states(("running", "paused", "pausing"))}
        for runtime in self._runtimes.values():
            try:
                removed = await runtime.cleanup_orphans(keep)
            except Exception:
                log.exception("recovery: %s cleanup_orphans failed", runtime.name)
                continue
            if removed:
                log.info("recovery: %s removed leaked sandboxes %s", runtime.name, ", ".join(removed))

    # -- helpers for transitions ---------------------------------------------------------------

    def runtime_for(self, rec: SandboxRecord) -> Runtime:
        return self.runtime_for_name(rec.runtime)

    def runtime_for_name(self, name: str) -> Runtime:
        if name not in self._runtimes:
            self._runtimes[name] = runtime_by_name(name, self.settings)
        return self._runtimes[name]

    def runtime_for_template(self, image: TemplateImage) -> Runtime:
        """The template's own runtime, else the node's."""
        return self.runtime_for_name(image.runtime or self.runtime.name)

    @contextlib.asynccontextmanager
    async def locked(self, sandbox_id: str) -> AsyncIterator[SandboxRecord]:
        """Hold ``sandbox_id``'s lock and yield its current record (404 when unknown/killed)."""
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            rec = await self.store.get(sandbox_id)
            if rec is None or rec.state == "killed":
                raise SandboxNotFound(sandbox_id)
            yield rec

    def attach(self, rec: SandboxRecord) -> None:
        """Make a running sandbox reachable through the proxy."""
        assert rec.instance is not None
        self._routes[rec.sandbox_id] = Route(
            sandbox_id=rec.sandbox_id,
            address=rec.instance.address,
            envd_url=rec.instance.envd_url,
            traffic_access_token=rec.traffic_access_token,
        )

    def detach(self, sandbox_id: str) -> None:
        self._routes.pop(sandbox_id, None)
        self._metrics.pop(sandbox_id, None)

    def route(self, sandbox_id: str) -> Route | None:
        return self._routes.get(sandbox_id)

    async def log_event(self, sandbox_id: str, level: str, message: str, **fields: str) -> None:
        try:
            await self.store.add_log(sandbox_id, level, message, **fields)
        except Exception:  # logging must never break a lifecycle transition
            log.exception("could not store a log line for %s", sandbox_id)

    def _spawn(self, coro: Awaitable[object]) -> asyncio.Task[object]:
        task: asyncio.Task[object] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- create --------------------------------------------------------------------------------

    async def create(self, req: CreateRequest, idempotency_key: str | None = None) -> SandboxRecord:
        """Create and initialise a sandbox. Runs shielded: a client that disconnects mid-way does
        not leave a half-made sandbox (the create finishes, or cleans up after itself)."""
        if idempotency_key and idempotency_key in self._idempotency:
            existing = await self.store.get(self._idempotency[idempotency_key])
            if existing and existing.state != "killed":
                return existing
        task = self._spawn(self._create(req))
        rec = await asyncio.shield(task)
        assert isinstance(rec, SandboxRecord)
        if idempotency_key:
            self._idempotency[idempotency_key] = rec.sandbox_id
            while len(self._idempotency) > IDEMPOTENCY_KEYS_KEPT:  # oldest first (dict order)
                self._idempotency.pop(next(iter(self._idempotency)))
        return rec

    async def _create(self, req: CreateRequest) -> SandboxRecord:
        try:
            info = templates.load(req.template_id, self.settings)
        except templates.TemplateNotFound as exc:
            raise OrchestratorError(404, f"template '{req.template_id}' not found: {exc}") from None
        image = info.image
        runtime = self.runtime_for_template(image)
        if self.fast_create_hook is not None:
            fast = await self.fast_create_hook(req, info, runtime)
            if fast is not None:
                return fast
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=new_sandbox_id(),
            template_id=image.template_id,
            alias=image.template_id,
            client_id=CLIENT_ID,
            state="creating",
            started_at=now,
            end_at=now + dt.timedelta(seconds=req.timeout_seconds),
            cpu_count=image.vcpus,
            memory_mb=image.memory_mb,
            disk_mb=image.disk_mb,
            runtime=runtime.name,
            envd_version=ENVD_VERSION,
            metadata=req.metadata,
            envs=req.envs,
            envd_access_token=new_access_token() if req.secure else None,
            traffic_access_token=None if req.allow_public_traffic else new_access_token(),
            allow_internet_access=req.allow_internet_access,
            auto_pause=req.auto_pause,
            auto_resume=req.auto_resume,
            network=dict(req.network or {}),
        )
        async with self._locks.setdefault(rec.sandbox_id, asyncio.Lock()):
            await self.store.insert(rec)
            started = time.monotonic()
            spec = SandboxSpec(
                sandbox_id=rec.sandbox_id,
                template=image,
                envs=rec.envs,
                allow_internet_access=req.allow_internet_access is not False,
                envd_access_token=rec.envd_access_token,
            )
            try:
                rec.instance = await runtime.create(spec)
                booted = time.monotonic()
                await self._init_envd(rec)
            except BaseException as exc:
                await self._abort_create(rec, runtime, exc)
                raise_creation_failure(exc, "sandbox creation")
            # The timeout counts from when the sandbox is usable, as with E2B.
            now = utcnow()
            rec.started_at = now
            rec.end_at = now + dt.timedelta(seconds=req.timeout_seconds)
            rec.state = "running"
            await self.store.save(rec)
            self.attach(rec)
        await self.log_event(
            rec.sandbox_id, "info", "sandbox created",
            runtime=runtime.name, template=rec.template_id,
            boot_ms=str(round((booted - started) * 1000)),
            init_ms=str(round((time.monotonic() - booted) * 1000)),
        )
        return rec

    async def _abort_create(self, rec: SandboxRecord, runtime: Runtime, exc: BaseException) -> None:
        log.warning("create of %s failed (%s: %s); removing what was made",
                    rec.sandbox_id, type(exc).__name__, exc)
        instance = rec.instance or SandboxInstance(
            sandbox_id=rec.sandbox_id, runtime=runtime.name, envd_url="", address="", state={}
        )
        try:
            await runtime.kill(instance)
        except Exception:
            log.exception("cleanup after failed create of %s failed", rec.sandbox_id)
        rec.state = "killed"
        rec.end_at = utcnow()
        await self.store.save(rec)
        await self.log_event(rec.sandbox_id, "error", f"sandbox creation failed: {exc}")

    async def _init_envd(self, rec: SandboxRecord) -> None:
        """``POST /init``: env vars, access token, clock and default user (envd.yaml)."""
        assert rec.instance is not None
        body: dict[str, object] = {
            "envVars": rec.envs,
            "timestamp": utcnow().isoformat().replace("+00:00", "Z"),
            "defaultUser": DEFAULT_USER,
            "defaultWorkdir": DEFAULT_WORKDIR,
        }
        headers = {}
        if rec.envd_access_token:
            body["accessToken"] = rec.envd_access_token
            headers["X-Access-Token"] = rec.envd_access_token
        url = rec.instance.envd_url.rstrip("/") + "/init"
        last: Exception | None = None
        for attempt in range(INIT_ATTEMPTS):
            try:
                resp = await self._http.post(url, json=body, headers=headers)
            except httpx.TransportError as exc:  # envd answered /health, so this is transient
                last = exc
                await asyncio.sleep(min(0.05 * 2**attempt, 0.5))
                continue
            if resp.status_code >= 300:
                raise OrchestratorError(
                    500, f"envd /init answered {resp.status_code}: {resp.text[:300]}"
                )
            return
        raise OrchestratorError(500, f"envd /init unreachable at {url}: {last}")

    # -- queries -------------------------------------------------------------------------------

    async def get(self, sandbox_id: str) -> SandboxRecord:
        rec = await self.store.get(sandbox_id)
        if rec is None or rec.state == "killed":
            raise SandboxNotFound(sandbox_id)
        return rec

    async def list_sandboxes(self, query: ListQuery) -> list[SandboxRecord]:
        return await self.store.query(query)

    async def logs(self, sandbox_id: str, *, start: dt.datetime | None, limit: int,
                   ascending: bool = True) -> list[LogLine]:
        rec = await self.store.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(sandbox_id)
        if rec.state != "killed":
            await self.collect_runtime_logs(rec)
        return await self.store.logs(sandbox_id, start=start, limit=limit, ascending=ascending)

    async def collect_runtime_logs(self, rec: SandboxRecord) -> None:
        """Move new lines of the sandbox's runtime log files (envd's output) into its logs.

        The read offset is kept in the record's ``extra`` so a restarted server does not
        collect the same lines twice; the files themselves go away with the sandbox."""
        lock = self._log_locks.setdefault(rec.sandbox_id, asyncio.Lock())
        async with lock:
            fresh = await self.store.get(rec.sandbox_id)
            offsets: dict[str, int] = dict((fresh.extra if fresh else rec.extra).get("log_offsets", {}))
            directory = self.settings.data_dir / "sandboxes" / rec.sandbox_id
            changed = False
            for name in RUNTIME_LOG_FILES:
                start = offsets.get(name, 0)
                data = await asyncio.to_thread(_read_from, directory / name, start, LOG_READ_LIMIT)
                end = data.rfind(b"\n") + 1
                if end == 0:
                    continue
                lines = data[:end].decode(errors="replace").splitlines()
                source = name.removesuffix(".log")
                await self.store.add_logs(
                    rec.sandbox_id, [("info", ln, {"source": source}) for ln in lines if ln.strip()]
                )
                offsets[name] = start + end
                changed = True
            if changed:
                await self.store.set_extra(rec.sandbox_id, "log_offsets", offsets)

    async def metrics(self, sandbox_id: str) -> list[MetricSample]:
        """The sampled history plus a fresh sample (running sandboxes only have metrics)."""
        rec = await self.get(sandbox_id)
        if rec.state == "running":
            await self._sample(rec)
        return list(self._metrics.get(sandbox_id, []))

    async def _sample(self, rec: SandboxRecord) -> None:
        if rec.instance is None:
            return
        try:
            m = await self.runtime_for(rec).metrics(rec.instance)
        except Exception as exc:
            log.debug("metrics of %s failed: %s", rec.sandbox_id, exc)
            return
        history = self._metrics.setdefault(rec.sandbox_id, [])
        history.append(MetricSample(utcnow(), m))
        del history[:-METRICS_HISTORY]

    # -- transitions ---------------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        async with self.locked(sandbox_id) as rec:
            await self._destroy(rec, reason="killed by request")

    async def _destroy(self, rec: SandboxRecord, *, reason: str) -> None:
        """Tear the sandbox down and mark it killed (caller holds the lock, or it is recovery)."""
        self.detach(rec.sandbox_id)
        try:
            await self.collect_runtime_logs(rec)  # the files go away with the sandbox
            rec.extra = (await self.store.get(rec.sandbox_id) or rec).extra
        except Exception:
            log.exception("collecting the logs of %s failed", rec.sandbox_id)
        rec.state = "killing"
        await self.store.save(rec)
        instance = rec.instance or SandboxInstance(
            sandbox_id=rec.sandbox_id, runtime=rec.runtime, envd_url="", address="", state={}
        )
        try:
            await self.runtime_for(rec).kill(instance)
        except Exception as exc:
            # Leave the record in "killing": the next start-up's recovery retries the cleanup.
            await self.log_event(rec.sandbox_id, "error", f"kill failed: {exc}")
            raise OrchestratorError(500, f"killing sandbox {rec.sandbox_id} failed: {exc}") from exc
        rec.state = "killed"
        rec.end_at = min(rec.end_at, utcnow())
        await self.store.save(rec)
        await self.log_event(rec.sandbox_id, "info", f"sandbox killed: {reason}")
        if self.destroyed_hook is not None:
            self._spawn(self.destroyed_hook(rec))

    async def set_timeout(self, sandbox_id: str, timeout_seconds: int) -> SandboxRecord:
        """The sandbox now expires ``timeout_seconds`` from now (shorter or longer)."""
        async with self.locked(sandbox_id) as rec:
            rec.end_at = utcnow() + dt.timedelta(seconds=timeout_seconds)
            await self.store.save(rec)
            return rec

    async def refresh(self, sandbox_id: str, duration_seconds: int) -> SandboxRecord:
        """Keep alive for at least ``duration_seconds`` more (never shortens)."""
        async with self.locked(sandbox_id) as rec:
            if rec.state != "running":
                raise OrchestratorError(409, f"sandbox {sandbox_id} is {rec.state}, not running")
            rec.end_at = max(rec.end_at, utcnow() + dt.timedelta(seconds=duration_seconds))
            await self.store.save(rec)
            return rec

    async def connect(self, sandbox_id: str, timeout_seconds: int) -> tuple[SandboxRecord, bool]:
        """A running sandbox's TTL is only extended; a paused one is resumed (via the resume
        hook). Returns the record and whether it was resumed."""
        async with self.locked(sandbox_id) as rec:
            if rec.state == "running":
                rec.end_at = max(rec.end_at, utcnow() + dt.timedelta(seconds=timeout_seconds))
                await self.store.save(rec)
                return rec, False
            if rec.state == "paused":
                if self.resume_hook is None:
                    raise OrchestratorError(501, "resuming paused sandboxes is not available on this node")
                return await self.resume_hook(self, rec, timeout_seconds), True
            raise OrchestratorError(409, f"sandbox {sandbox_id} is {rec.state}; try again")

    # -- timeouts ------------------------------------------------------------------------------

    async def _reap_forever(self) -> None:
        last_metrics = 0.0
        while True:
            try:
                await self.reap_expired()
                if time.monotonic() - last_metrics >= METRICS_INTERVAL_SECONDS:
                    last_metrics = time.monotonic()
                    for rec in await self.store.in_states(("running",)):
                        await self._sample(rec)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("timeout reaper iteration failed")
            await asyncio.sleep(REAPER_INTERVAL_SECONDS)

    async def reap_expired(self) -> None:
        ids = await self.store.expired(utcnow())
        if ids:
            await asyncio.gather(*(self._expire(i) for i in ids), return_exceptions=True)

    async def _expire(self, sandbox_id: str) -> None:
        try:
            async with self.locked(sandbox_id) as rec:
                # Re-check under the lock: a set_timeout may have won the race.
                if rec.state != "running" or rec.end_at > utcnow():
                    return
                if rec.auto_pause and self.pause_hook is not None:
                    await self.log_event(sandbox_id, "info", "timeout reached: pausing (autoPause)")
                    await self.pause_hook(self, rec)
                    return
                if rec.auto_pause:
                    await self.log_event(
                        sandbox_id, "warn", "autoPause requested but pausing is unavailable; killing"
                    )
                await self._destroy(rec, reason="timeout reached")
        except SandboxNotFound:
            return
        except Exception:
            log.exception("expiring sandbox %s failed", sandbox_id)


def _read_from(path: Path, offset: int, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(limit)
    except FileNotFoundError:
        return b""
