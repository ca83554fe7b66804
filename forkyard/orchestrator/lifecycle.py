"""The one owner of the sandbox lifecycle state machine.

Every transition has the same shape (the way gVisor's ``runsc/container`` does it): check the
operation is allowed in the sandbox's state, under that sandbox's lock; run the runtime
operation; record the new state; persist. States and edges are :data:`EDGES`; which operation
may start from which state is :data:`STARTS_FROM` (docs/ARCHITECTURE.md draws both)::

    creating --> running <--> pausing --> paused --> resuming --> running
        |           |            |          |           |
        +-----------+------------+----------+-----------+--> killing --> killed

Every way a sandbox comes up (cold boot, template snapshot restore, warm-pool claim, user
snapshot restore, fork child) is one path, :meth:`Orchestrator._bring_up`, which registers an
undo for each step it took. Every state and pause-tier change goes through one gate,
:meth:`Orchestrator._enter` (:data:`EDGES`, :data:`TIER_EDGES`).

The other jobs are collaborators with their own state. Handed in at construction
(:func:`build_orchestrator` is the composition root): the snapshot catalog, the template
snapshots with their warm pool, the standbys, the runtimes, the sandbox store, envd's client, the
logs, the telemetry and the template owner. Made by the orchestrator, because they call back into
its transitions: the route table (its subscribers hear of removals), the death watch, the metrics
history, the idempotency cache, the reaper with the frozen-tier policy, and start-up recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import enum
import errno
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn

from forkyard.config import Settings
from forkyard.errors import (
    Conflict,
    Failed,
    ForkyardError,
    Gone,
    InsufficientStorage,
    Invalid,
    LimitReached,
    NotFound,
    NotSupported,
    Unavailable,
)
from forkyard.orchestrator import templates
from forkyard.orchestrator.background import Background
from forkyard.orchestrator.catalog import SnapshotCatalog, SnapshotMeta
from forkyard.orchestrator.death_watch import DeathWatch
from forkyard.orchestrator.durable import DurableSnapshots
from forkyard.orchestrator.envd_client import EnvdClient
from forkyard.orchestrator.garbage import GarbageCollector
from forkyard.orchestrator.idempotency import IdempotencyCache
from forkyard.orchestrator.ids import new_access_token, new_sandbox_id
from forkyard.orchestrator.logs import SandboxLogs
from forkyard.orchestrator.metrics_history import MetricSample, MetricsHistory
from forkyard.orchestrator.reaper import FrozenTierPolicy, Reaper
from forkyard.orchestrator.recovery import Recovery, RecoveryActions
from forkyard.orchestrator.route_table import Route, RouteTable
from forkyard.orchestrator.rowless import RowlessSandboxes
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.orchestrator.standbys import Standbys
from forkyard.orchestrator.store import (
    ListQuery,
    LogLine,
    NetworkPolicy,
    Origin,
    PauseTier,
    SandboxRecord,
    SandboxStore,
)
from forkyard.orchestrator.telemetry import Telemetry
from forkyard.orchestrator.template_owner import TemplateOwner
from forkyard.orchestrator.template_snapshots import TemplateSnapshot, TemplateSnapshots
from forkyard.orchestrator.timing import elapsed_ms, utcnow
from forkyard.orchestrator.undo import Undo
from forkyard.runtime import egress_proxy, network
from forkyard.runtime.base import Capability, Runtime
from forkyard.storage.objectstore import SnapshotObjects
from forkyard.storage.snapshots import SnapshotKind, SnapshotRow
from forkyard.types import (
    ADMITTED_STATES,
    ENVD_VERSION,
    HELD_STATES,
    EgressPolicy,
    SandboxInstance,
    SandboxSpec,
    SandboxState,
    TemplateImage,
    VolumeMount,
)

log = logging.getLogger(__name__)

S = SandboxState

#: The state machine: the states a sandbox may move to from each state.
EDGES: dict[SandboxState, frozenset[SandboxState]] = {
    S.CREATING: frozenset({S.RUNNING, S.KILLING, S.KILLED}),
    # A rollback (our extension) passes through "resuming": the instance is replaced by a restore.
    S.RUNNING: frozenset({S.PAUSING, S.RESUMING, S.KILLING}),
    # A pause whose checkpoint failed but left the sandbox alive goes back to running.
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING, S.KILLING}),
    S.PAUSED: frozenset({S.RESUMING, S.KILLING}),
    S.RESUMING: frozenset({S.RUNNING, S.KILLING}),
    # A kill whose runtime clean-up failed stays "killing"; the next start-up retries it.
    S.KILLING: frozenset({S.KILLING, S.KILLED}),
    S.KILLED: frozenset(),
}

#: Which operation may start from which state (under the sandbox's lock; the transient states
#: are never seen there, only by crash recovery).
STARTS_FROM: dict[str, frozenset[SandboxState]] = {
    "kill": frozenset({S.RUNNING, S.PAUSED}),
    "pause": frozenset({S.RUNNING}),
    "resume": frozenset({S.PAUSED}),
    "connect": frozenset({S.RUNNING, S.PAUSED}),
    "snapshot": frozenset({S.RUNNING}),
    # A paused sandbox forks from its pause state without being resumed (:meth:`Orchestrator._fork_paused`).
    "fork": frozenset({S.RUNNING, S.PAUSED}),
    "rollback": frozenset({S.RUNNING}),
    "set_timeout": frozenset({S.RUNNING, S.PAUSED}),
    "refresh": frozenset({S.RUNNING}),
    # The outbound policy of a running sandbox changes in place (paused ones: 409, as in E2B).
    "update_network": frozenset({S.RUNNING}),
    # Within "paused": the frozen tier moves to disk (the API shows both tiers as paused).
    "move_to_disk": frozenset({S.PAUSED}),
}

#: The pause tiers (``SandboxRecord.pause_tier``) a sandbox may move between; None: not paused
#: (a legacy paused record without a tier is on disk). A pause enters a tier with ``paused``; the
#: reaper's policy moves ``frozen`` through ``moving`` to ``disk`` (back to ``frozen`` when the
#: checkpoint fails, or recovery finds the sandbox still running); a resume leaves any tier.
TIER_EDGES: dict[PauseTier | None, frozenset[PauseTier | None]] = {
    None: frozenset({"frozen", "disk", "filesystem"}),
    # frozen -> disk: recovery adopts a committed pause snapshot of a frozen sandbox found gone.
    "frozen": frozenset({"moving", "disk", None}),
    "moving": frozenset({"disk", "frozen"}),
    "disk": frozenset({None}),
    "filesystem": frozenset({None}),
}


class _Keep(enum.Enum):
    TIER = 0


#: ``_enter``'s default: the pause tier stays as it is.
KEEP_TIER: Final = _Keep.TIER

CLIENT_ID = "forkyard"
#: Parallel restores of a fork: each is a runsc (or VMM) start plus a CPU-bound state load, so
#: two per core keep the cores busy while one waits on I/O; more only queue.
FORK_PARALLELISM = max(2, 2 * (os.cpu_count() or 1))
#: The API's limit (openapi.yml: SandboxForkRequest.count maximum); the SDKs send at most 20.
MAX_FORK_COUNT = 100
#: Seconds the server waits for background work (template snapshots, collections) on close.
CLOSE_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class CreateRequest:
    template_id: str
    timeout_seconds: int
    metadata: dict[str, str]
    envs: dict[str, str]
    secure: bool
    #: ``allowInternetAccess`` and ``network`` (allowOut/denyOut as enforced, maskRequestHost, dnsServers).
    network: NetworkPolicy = dataclasses.field(default_factory=NetworkPolicy)
    auto_pause: bool = False
    #: ``autoPauseMemory``: False makes the timeout's auto-pause a filesystem-only one.
    auto_pause_memory: bool = True
    auto_resume: bool = False
    allow_public_traffic: bool = True
    #: ``volumeMounts`` resolved to this node's volume directories.
    volumes: tuple[VolumeMount, ...] = ()


@dataclass(frozen=True)
class ForkOutcome:
    record: SandboxRecord | None
    error: ForkyardError | None


# What a sandbox comes up from (see :meth:`Orchestrator._bring_up`).


@dataclass(frozen=True)
class Boot:
    image: TemplateImage


@dataclass(frozen=True)
class Restore:
    row: SnapshotRow
    image: TemplateImage


@dataclass(frozen=True)
class Claim:
    instance: SandboxInstance
    image: TemplateImage


Source = Boot | Restore | Claim


def conflict(rec: SandboxRecord, op: str) -> Conflict:
    if op == "pause" and rec.state == S.PAUSED:
        return Conflict(f"sandbox {rec.sandbox_id} is already paused")
    if op == "resume" and rec.state == S.RUNNING:
        return Conflict(f"sandbox {rec.sandbox_id} is already running")
    if STARTS_FROM[op] == {S.RUNNING}:
        return Conflict(f"sandbox {rec.sandbox_id} is {rec.state}, not running")
    return Conflict(f"cannot {op.replace('_', ' ')} sandbox {rec.sandbox_id}: it is {rec.state}")


def failure(exc: BaseException, what: str) -> BaseException:
    """Why ``what`` failed, as an error kind the API can answer with: the kind of an
    :class:`ForkyardError` is kept; anything unexpected is :class:`Failed` (the caller chains
    the cause)."""
    if out_of_space(exc):
        message = exc.message if isinstance(exc, ForkyardError) else f"{type(exc).__name__}: {exc}"
        return InsufficientStorage(f"{what} failed: the node's disk is full ({message})")
    if isinstance(exc, ForkyardError):
        return type(exc)(f"{what} failed: {exc.message}")
    if isinstance(exc, Exception):
        return Failed(f"{what} failed: {type(exc).__name__}: {exc}")
    return exc  # cancellation and interpreter exits pass as they are


#: How the tools the runtimes run (runsc, cp, mkfs) and the kernel say "disk full".
_OUT_OF_SPACE_TEXTS = ("no space left on device", "disk quota exceeded", "database or disk is full")


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is the node's disk being full: an ``OSError`` ENOSPC or
    EDQUOT, or a runtime tool's failure whose output says so (runsc's "statefile error: no space
    left on device"). E2B answers these 507 (the SDK's ``NotEnoughSpaceException`` for envd)."""
    current: BaseException | None = exc
    while current is not None:
        if isinstance(current, InsufficientStorage):
            return True
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(current, ForkyardError | OSError) and any(
            text in str(current).lower() for text in _OUT_OF_SPACE_TEXTS
        ):
            return True
        current = current.__cause__
    return False


def _created_message(rec: SandboxRecord) -> str:
    if rec.origin == "boot":
        return "sandbox created"
    if rec.origin == "warm_pool":
        return "sandbox created from the warm pool"
    if rec.origin == "standby":
        return f"sandbox created from a standby of {rec.restored_from}"
    if rec.origin == "template":
        return f"sandbox created from its template's snapshot {rec.restored_from}"
    return f"sandbox restored from {rec.restored_from}"


def raise_failure(exc: BaseException, what: str) -> NoReturn:
    err = failure(exc, what)
    if err is exc:
        raise exc
    raise err from exc


class Orchestrator:
    def __init__(
        self,
        settings: Settings,
        *,
        runtimes: RuntimeSet,
        store: SandboxStore,
        catalog: SnapshotCatalog,
        template_snapshots: TemplateSnapshots,
        standbys: Standbys,
        background: Background,
        envd: EnvdClient,
        logs: SandboxLogs,
        telemetry: Telemetry,
        template_owner: TemplateOwner,
        garbage: GarbageCollector,
    ) -> None:
        self.settings = settings
        self.runtimes = runtimes
        self.store = store
        self.catalog = catalog
        self.template_snapshots = template_snapshots
        self.standbys = standbys
        self.background = background
        self.envd = envd
        self.logs = logs
        self.telemetry = telemetry
        #: Template builds and deletes (of templates and of user snapshots: one namespace in E2B).
        self.template_owner = template_owner
        #: Frees the disk layers and template roots nothing stands on; the catalog tells it of
        #: every snapshot delete, :meth:`_release` of every released sandbox.
        self.garbage = garbage
        self._locks: dict[str, asyncio.Lock] = {}
        #: Counting the node's sandboxes and inserting a new one are one step (``max_sandboxes``).
        self._admission = asyncio.Lock()
        # The jobs beside the transitions, each with its own state; they report back through
        # the callbacks handed to them, and every transition they ask for runs here.
        #: Where each reachable sandbox's traffic goes; the API subscribes to its removals
        #: (kill, pause, death, snapshot) to end the streams its proxy has open.
        self.route_table = RouteTable()
        self.deaths = DeathWatch(on_death=self._died)
        self.metrics_history = MetricsHistory()
        self.idempotency = IdempotencyCache()
        self.reaper = Reaper(
            store,
            FrozenTierPolicy(settings, background, move_to_disk=self._move_to_disk),
            expire=self._expire,
            sample=self._sample,
        )
        self.recovery = Recovery(
            store,
            catalog,
            runtimes,
            garbage,
            RecoveryActions(
                is_alive=self._is_alive,
                reattach=self._attach,
                revive=self._revive,
                destroy=self._destroy_found_dead,
                refreeze=self._freeze,
                set_tier=self._set_tier,
                watch=self._watch,
            ),
        )

    # -- start-up and shut-down ----------------------------------------------------------------

    async def start(self) -> None:
        await self.store.open()
        await self.catalog.open(self.store.db)
        # Before recovery: sandboxes that outlived the last run may have domain rules to serve.
        await network.resume_egress_proxy(self.settings)
        await self.recovery.run()
        await self.template_snapshots.warm_up()
        self.reaper.start()

    async def close(self) -> None:
        """Stop background work and kill pooled sandboxes. Sandboxes with a record keep running:
        a restarted server re-attaches them."""
        await self.template_snapshots.close()
        await self.standbys.close()
        await self.reaper.close()
        self.deaths.close()  # the sandboxes run on; a restart watches them again
        await self.background.drain(CLOSE_GRACE_SECONDS)
        await self.template_owner.close()  # its builder's envd client
        for runtime in self.runtimes:  # what runtimes keep ahead of demand (QEMU spares)
            await runtime.stop_prestarted()
        await self.envd.close()
        await egress_proxy.stop()
        await self.store.close()

    async def _destroy_found_dead(self, rec: SandboxRecord, reason: str) -> None:
        with contextlib.suppress(Failed):  # logged; stays "killing", retried next start
            await self._destroy(rec, reason=reason, release_now=True)

    async def _set_tier(self, rec: SandboxRecord, tier: PauseTier) -> None:
        await self._enter(rec, S.PAUSED, tier=tier)

    async def _is_alive(self, rec: SandboxRecord) -> bool:
        if rec.instance is None:
            return False
        try:
            return await self._runtime(rec).is_alive(rec.instance)
        except Exception as exc:
            log.warning("recovery: cannot tell whether %s is alive: %s", rec.sandbox_id, exc)
            return False

    async def _revive(self, rec: SandboxRecord) -> bool:
        """Restore a sandbox recorded running but found stopped from the fork checkpoint a crash
        cut short (a fork's parent is stopped between its checkpoint and its own restore)."""
        rows = await self.catalog.rows("fork", source=rec.sandbox_id)
        if not rows:
            return False
        try:
            await self._restore_in_place(rec, rows[0])
        except Exception as exc:
            log.warning("reviving %s from %s failed: %s", rec.sandbox_id, rows[0].snapshot_id, exc)
            return False
        await self.store.save(rec)
        self._attach(rec)
        return True

    # -- the shape of every transition ---------------------------------------------------------

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    @contextlib.asynccontextmanager
    async def _operate(self, sandbox_id: str, op: str) -> AsyncIterator[SandboxRecord]:
        """Hold the sandbox's lock and yield its record once ``op`` may start from its state."""
        async with self._lock(sandbox_id):
            rec = await self.get(sandbox_id)
            if rec.state not in STARTS_FROM[op]:
                raise conflict(rec, op)
            yield rec

    async def _enter(
        self,
        rec: SandboxRecord,
        state: SandboxState,
        *,
        tier: PauseTier | _Keep | None = KEEP_TIER,
        defer: bool = False,
    ) -> None:
        """Record ``rec``'s move to ``state`` (and pause ``tier``, unless kept) and persist it:
        the one gate of every state and tier change (the caller holds the lock). ``defer``: for
        what has happened whatever the registry says (a kill, a create undone): a registry out of
        reach gets the record later (``save_or_defer``) instead of failing the step half-way."""
        if state != rec.state and state not in EDGES[rec.state]:
            raise Failed(f"sandbox {rec.sandbox_id}: no transition from {rec.state} to {state}")
        before = (rec.state, rec.pause_tier)
        if not isinstance(tier, _Keep) and tier != rec.pause_tier:
            if tier not in TIER_EDGES[rec.pause_tier]:
                raise Failed(
                    f"sandbox {rec.sandbox_id}: no pause tier change from {rec.pause_tier} to {tier}"
                )
            if tier is not None and state != S.PAUSED:
                raise Failed(f"sandbox {rec.sandbox_id}: a pause tier ({tier}) outside paused ({state})")
            rec.pause_tier = tier
        rec.state = state
        if defer:
            await self.store.save_or_defer(rec)
            return
        try:
            await self.store.save(rec)
        except BaseException:
            # Not recorded: the record stays in the state it was (an undo starts from there).
            rec.state, rec.pause_tier = before
            raise

    def _runtime(self, rec: SandboxRecord) -> Runtime:
        return self.runtimes.named(rec.runtime)

    def _attach(self, rec: SandboxRecord) -> None:
        """Make a running sandbox reachable through the proxy."""
        assert rec.instance is not None
        self.route_table.add(
            Route(
                sandbox_id=rec.sandbox_id,
                address=rec.instance.address,
                envd_url=rec.instance.envd_url,
                traffic_access_token=rec.traffic_access_token,
                envd_access_token=rec.envd_access_token,
                mask_request_host=rec.network.mask_request_host,
            )
        )
        self._watch(rec)

    def _detach(self, sandbox_id: str) -> None:
        """The sandbox stops being reachable: no route, no metrics, no death watch (what stops
        it now is an operation of ours), and the route table's subscribers hear of it."""
        self.metrics_history.forget(sandbox_id)
        self.deaths.unwatch(sandbox_id)
        self.route_table.remove(sandbox_id)

    # -- dead-sandbox detection ----------------------------------------------------------------

    def _watch(self, rec: SandboxRecord) -> None:
        """Wait (a pidfd or the like, not polling) for the processes of a running or frozen
        sandbox to die. Every operation that stops it on purpose unwatches it first."""
        assert rec.instance is not None
        self.deaths.watch(rec.sandbox_id, self._runtime(rec), rec.instance)

    async def _died(self, sandbox_id: str, instance: SandboxInstance, reason: str) -> None:
        """Record a death nobody asked for: killed with the reason in its logs, its network and
        disk freed (``_destroy``); the API then reports it gone, as E2B does (404)."""
        async with self._lock(sandbox_id):
            self.deaths.reported(sandbox_id)
            rec = await self.store.get(sandbox_id)
            frozen = rec is not None and rec.state == S.PAUSED and rec.pause_tier == "frozen"
            if rec is None or not (rec.state == S.RUNNING or frozen) or rec.instance != instance:
                return  # an operation of ours replaced or stopped it meanwhile
            log.warning("sandbox %s died: %s", sandbox_id, reason)
            await self.logs.event(sandbox_id, "error", f"sandbox died: {reason}")
            with contextlib.suppress(Failed):  # logged; stays "killing", retried next start
                await self._destroy(rec, reason=f"its processes died ({reason})")

    def route(self, sandbox_id: str) -> Route | None:
        return self.route_table.get(sandbox_id)

    def routes(self) -> list[Route]:
        """The routes of every reachable sandbox."""
        return self.route_table.all()

    @staticmethod
    def _spec(rec: SandboxRecord, image: TemplateImage, volumes: tuple[VolumeMount, ...] = ()) -> SandboxSpec:
        """``volumes``: a new sandbox's; a kept disk booted again keeps its instance's (a restore
        takes its checkpoint's, whatever the spec says)."""
        return SandboxSpec(
            volumes=volumes or (rec.instance.volume_mounts if rec.instance else ()),
            sandbox_id=rec.sandbox_id,
            template=image,
            envs=rec.envs,
            allow_internet_access=rec.network.internet,
            envd_access_token=rec.envd_access_token,
            egress=rec.network.egress,
        )

    # -- bringing a sandbox up: create, restore, claim, fork child -----------------------------

    async def create(self, req: CreateRequest, idempotency_key: str | None = None) -> SandboxRecord:
        """Create a sandbox from a template or a user snapshot (``templateID`` names either).
        Runs shielded: a client that disconnects mid-way does not leave a half-made sandbox."""
        earlier = self.idempotency.sandbox_for(idempotency_key)
        if earlier is not None:
            existing = await self.store.get(earlier)
            if existing and existing.state != S.KILLED:
                return existing
        rec = await asyncio.shield(self.background.spawn(self._create(req)))
        self.idempotency.remember(idempotency_key, rec.sandbox_id)
        return rec

    async def _create(self, req: CreateRequest) -> SandboxRecord:
        row = await self.catalog.find_user_snapshot(req.template_id)
        if row is not None:
            if req.volumes:
                raise Invalid(
                    "volumeMounts cannot be given when creating from a snapshot: a restored sandbox "
                    "keeps the volumes the snapshot was taken with"
                )
            return await self._from_user_snapshot(row, req)
        info = templates.load(req.template_id, self.settings)
        runtime = self.runtimes.for_template(info.image)
        if req.volumes and Capability.VOLUMES not in runtime.capabilities:
            raise Invalid(
                f"volumeMounts are not supported by the {runtime.name} runtime (no virtiofs or 9p share "
                "into its microVMs here): use a gVisor template"
            )
        # A template snapshot's checkpoint has no volumes bound: a sandbox with volumes boots.
        snap = None if req.volumes else await self.template_snapshots.lookup(info, runtime)
        if snap is not None:
            rec = await self._from_template_snapshot(snap, req)
            if rec is not None:
                return rec
        new = self._new_record(
            new_sandbox_id(),
            req,
            template_id=info.image.template_id,
            runtime=runtime.name,
            image=info.image,
            origin="boot",
        )
        rec = await self._bring_up(new, runtime, Boot(info.image), req.timeout_seconds, req.volumes)
        if info.start is not None and rec.instance is not None:
            # A boot, not the template's snapshot: start the start command it would have running.
            await self.template_snapshots.start_command(info, rec.instance, rec.envd_access_token)
        return rec

    async def _from_template_snapshot(
        self, snap: TemplateSnapshot, req: CreateRequest
    ) -> SandboxRecord | None:
        """Claim a warm-pool sandbox, else restore the template's snapshot; None (boot instead)
        when the snapshot does not restore. Pooled sandboxes have internet access."""
        template_id = snap.image.template_id
        instance = self.template_snapshots.claim(snap) if req.network.internet else None
        if instance is not None:
            rec = self._from_snapshot_record(snap.row, instance.sandbox_id, req, template_id, "warm_pool")
            try:
                return await self._bring_up(
                    rec, snap.runtime, Claim(instance, snap.image), req.timeout_seconds
                )
            except ForkyardError as exc:
                log.warning("claiming pooled sandbox %s failed (%s); restoring instead", rec.sandbox_id, exc)
        try:
            return await self._restore_new(snap.row, req, template_id=template_id, origin="template")
        except (Failed, Unavailable, Gone) as exc:
            log.warning("restoring template snapshot %s failed (%s); booting instead", snap.key, exc)
            await self.template_snapshots.drop(snap)
            return None

    async def _from_user_snapshot(self, row: SnapshotRow, req: CreateRequest) -> SandboxRecord:
        """Claim a standby of the snapshot, else restore it. Standbys have internet access."""
        instance = await self.standbys.claim(row) if req.network.internet else None
        if instance is not None:
            rec = self._from_snapshot_record(row, instance.sandbox_id, req, None, "standby")
            image = SnapshotMeta.of(row).image(row.template_id)
            try:
                return await self._bring_up(
                    rec, self._runtime(rec), Claim(instance, image), req.timeout_seconds
                )
            except ForkyardError as exc:
                log.warning("claiming standby %s failed (%s); restoring instead", rec.sandbox_id, exc)
        return await self._restore_new(row, req, origin="snapshot")

    async def _restore_new(
        self, row: SnapshotRow, req: CreateRequest, *, origin: Origin, template_id: str | None = None
    ) -> SandboxRecord:
        rec = self._from_snapshot_record(row, new_sandbox_id(), req, template_id, origin)
        image = SnapshotMeta.of(row).image(row.template_id)
        return await self._bring_up(rec, self._runtime(rec), Restore(row, image), req.timeout_seconds)

    async def _bring_up(
        self,
        rec: SandboxRecord,
        runtime: Runtime,
        source: Source,
        timeout_seconds: int,
        volumes: tuple[VolumeMount, ...] = (),
    ) -> SandboxRecord:
        """The one way a sandbox comes up: database row, runtime instance (boot, restore or a
        pooled one), envd ``/init``, running. Each step registers its undo; a failure undoes them
        newest first and leaves a killed record with the reason in its logs."""
        undo = Undo(f"bringing up sandbox {rec.sandbox_id}")
        started = time.monotonic()
        async with self._lock(rec.sandbox_id):
            await self._admit(rec, runtime, source)
            try:
                undo.push("database row", lambda: self._mark_failed(rec, runtime))
                undo.push(
                    "runtime instance",
                    lambda: runtime.kill(
                        rec.instance or SandboxInstance.placeholder(rec.sandbox_id, runtime.name)
                    ),
                )
                spec = self._spec(rec, source.image, volumes)
                rec.instance = await self._materialise(runtime, source, spec)
                up = time.monotonic()
                # A pooled sandbox had its restore's /init when it was made: this one only hands over.
                await self.envd.init(
                    rec.instance, rec.envs, rec.envd_access_token, revalidate=not isinstance(source, Claim)
                )
                await self._go_live(rec, timeout_seconds)
                undo.commit()
            except BaseException as exc:
                await undo.rollback()
                await self.logs.event(rec.sandbox_id, "error", f"sandbox creation failed: {exc}")
                raise_failure(exc, "sandbox creation" if isinstance(source, Boot) else "sandbox restore")
        self.telemetry.observe("create", rec.origin, time.monotonic() - started)
        await self.logs.event(
            rec.sandbox_id,
            "info",
            _created_message(rec),
            runtime=runtime.name,
            template=rec.template_id,
            up_ms=str(round((up - started) * 1000)),
            init_ms=str(elapsed_ms(up)),
        )
        return rec

    async def _admit(self, rec: SandboxRecord, runtime: Runtime, source: Source) -> None:
        """Insert the new sandbox's row unless the node holds ``max_sandboxes`` already (429, as
        E2B's concurrency limit: the gateway places the sandbox elsewhere). Resumes are not
        counted here: a paused sandbox keeps its place."""
        await self._check_disk_reserve(runtime, source)
        cap = self.settings.max_sandboxes
        if cap <= 0:
            await self._insert(rec)
            return
        async with self._admission:
            held = len(await self.store.in_states(ADMITTED_STATES))
            if held >= cap:
                await self._drop_claim(runtime, source)
                raise LimitReached(
                    f"this node runs its maximum of {cap} concurrent sandboxes (FORKYARD_MAX_SANDBOXES)"
                )
            await self._insert(rec)

    async def _check_disk_reserve(self, runtime: Runtime, source: Source) -> None:
        """507 when the data dir has less than ``disk_reserve_mb`` free (a full disk is E2B's 507)."""
        reserve = self.settings.disk_reserve_mb << 20
        if reserve <= 0:
            return
        free = shutil.disk_usage(self.settings.data_dir).free
        if free >= reserve:
            return
        await self._drop_claim(runtime, source)
        raise InsufficientStorage(
            f"the node's disk is full: {free >> 20} MiB free in its data dir, under the reserve of "
            f"{reserve >> 20} MiB a new sandbox needs (FORKYARD_DISK_RESERVE_MB)"
        )

    async def _drop_claim(self, runtime: Runtime, source: Source) -> None:
        """A sandbox taken from a pool and then refused admission is killed: nothing else would
        stop it (it is in no pool and has no row)."""
        if isinstance(source, Claim):
            with contextlib.suppress(Exception):
                await runtime.kill(source.instance)

    async def _insert(self, rec: SandboxRecord) -> None:
        try:
            await self.store.insert(rec)
        except Unavailable:
            # Lost in its commit the row may exist after all: it is recorded killed once the
            # registry answers (an UPDATE: nothing happens where no row was made).
            rec.state, rec.end_at = S.KILLED, utcnow()
            await self.store.save_or_defer(rec)
            raise

    async def _materialise(self, runtime: Runtime, source: Source, spec: SandboxSpec) -> SandboxInstance:
        if isinstance(source, Boot):
            return await runtime.create(spec)
        if isinstance(source, Restore):
            # use(): what this node lacks of the snapshot is fetched from the snapshot store first.
            async with self.catalog.use(source.row) as ref:
                return await runtime.restore(spec, ref)
        await runtime.claimed(source.instance)
        if spec.egress is not None:  # pooled with the defaults: its policy before anyone uses it
            await runtime.update_network(
                source.instance, allow_internet_access=spec.allow_internet_access, egress=spec.egress
            )
        return source.instance

    async def _go_live(self, rec: SandboxRecord, timeout_seconds: int) -> None:
        """Running, reachable, and the timeout counts from now (when it is usable, as E2B's)."""
        now = utcnow()
        rec.started_at = now
        rec.end_at = now + dt.timedelta(seconds=timeout_seconds)
        rec.timeout_seconds = timeout_seconds
        await self._enter(rec, S.RUNNING)
        self._attach(rec)

    async def _mark_failed(self, rec: SandboxRecord, runtime: Runtime) -> None:
        rec.end_at = utcnow()
        await self._enter(rec, S.KILLED, defer=True)
        log.warning("create of %s on %s failed; its record is marked killed", rec.sandbox_id, runtime.name)

    def _new_record(
        self,
        sandbox_id: str,
        req: CreateRequest,
        *,
        template_id: str,
        runtime: str,
        image: TemplateImage | SnapshotMeta,
        origin: Origin,
        alias: str | None = None,
        envs: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        envd_access_token: str | None = None,
        restored_from: str | None = None,
    ) -> SandboxRecord:
        now = utcnow()
        vcpus = image.vcpus if isinstance(image, TemplateImage) else image.cpu_count
        return SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=template_id,
            alias=alias or template_id,
            client_id=CLIENT_ID,
            state=S.CREATING,
            started_at=now,
            end_at=now + dt.timedelta(seconds=req.timeout_seconds),
            cpu_count=vcpus,
            memory_mb=image.memory_mb,
            disk_mb=image.disk_mb,
            runtime=runtime,
            envd_version=ENVD_VERSION,
            metadata=dict(metadata if metadata is not None else req.metadata),
            envs=dict(envs if envs is not None else req.envs),
            envd_access_token=envd_access_token or (new_access_token() if req.secure else None),
            traffic_access_token=None if req.allow_public_traffic else new_access_token(),
            auto_pause=req.auto_pause,
            auto_pause_memory=req.auto_pause_memory,
            auto_resume=req.auto_resume,
            network=req.network,
            origin=origin,
            restored_from=restored_from,
            memory_base=restored_from,
        )

    def _from_snapshot_record(
        self, row: SnapshotRow, sandbox_id: str, req: CreateRequest, template_id: str | None, origin: Origin
    ) -> SandboxRecord:
        """A user snapshot's sandboxes carry its id as their template; a template snapshot's carry
        the template's id. Metadata and env vars default to the snapshot's; envd in the image
        keeps the source's access token, if any."""
        meta = SnapshotMeta.of(row)
        return self._new_record(
            sandbox_id,
            req,
            template_id=template_id or row.snapshot_id,
            runtime=row.runtime,
            image=meta,
            origin=origin,
            alias=template_id or row.name or row.snapshot_id,
            envs={**meta.envs, **req.envs},
            metadata=req.metadata or meta.metadata,
            envd_access_token=meta.envd_access_token,
            restored_from=row.snapshot_id,
        )

    # -- queries -------------------------------------------------------------------------------

    async def get(self, sandbox_id: str) -> SandboxRecord:
        rec = await self.store.get(sandbox_id)
        if rec is None or rec.state == S.KILLED:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        return rec

    async def sandboxes_mounting(self, volume_id: str) -> list[str]:
        """The sandboxes of this node (running or paused) that have volume ``volume_id`` bound."""
        held = await self.store.in_states(s for s in S if s != S.KILLED)
        return [
            rec.sandbox_id
            for rec in held
            if rec.instance and any(m.volume_id == volume_id for m in rec.instance.volume_mounts)
        ]

    async def list_sandboxes(self, query: ListQuery) -> list[SandboxRecord]:
        return await self.store.query(query)

    async def sandbox_logs(
        self, sandbox_id: str, *, start: dt.datetime | None, limit: int, ascending: bool = True
    ) -> list[LogLine]:
        rec = await self.store.get(sandbox_id)
        if rec is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        if rec.state != S.KILLED:
            await self.logs.collect(rec)
        return await self.store.logs(sandbox_id, start=start, limit=limit, ascending=ascending)

    async def metrics(self, sandbox_id: str) -> list[MetricSample]:
        """The sampled history plus a fresh sample (running sandboxes only have metrics)."""
        rec = await self.get(sandbox_id)
        if rec.state == S.RUNNING:
            await self._sample(rec)
        return self.metrics_history.of(sandbox_id)

    async def _sample(self, rec: SandboxRecord) -> None:
        if rec.instance is not None:
            await self.metrics_history.sample(rec.sandbox_id, self._runtime(rec), rec.instance)

    # -- kill and timeouts ---------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        started = time.monotonic()
        async with self._operate(sandbox_id, "kill") as rec:
            await self._destroy(rec, reason="killed by request")
        self.telemetry.observe("kill", "", time.monotonic() - started)

    async def reap_killed_elsewhere(self) -> list[str]:
        """Stop the sandboxes running here whose database rows say killed: a gateway found this
        node lost (cluster mode) while they ran on; the cluster already reports them gone.
        (At start-up recovery needs nothing extra: a killed row is not re-attached, and
        ``cleanup_orphans`` removes what no live row names.)"""
        reaped = []
        for sandbox_id in self.route_table.ids():
            async with self._lock(sandbox_id):  # an operation under way finishes first
                rec = await self.store.get(sandbox_id)
                if rec is None or rec.state != S.KILLED or sandbox_id not in self.route_table:
                    continue
                self._detach(sandbox_id)
                instance = rec.instance or SandboxInstance.placeholder(rec.sandbox_id, rec.runtime)
                try:
                    await self._runtime(rec).kill(instance)
                except Exception as exc:  # start-up's cleanup_orphans removes what is left
                    log.warning("reaping %s (killed while this node was lost) failed: %s", sandbox_id, exc)
                reaped.append(sandbox_id)
        return reaped

    async def node_metrics(self) -> bytes:
        """The node's metrics in Prometheus' text format (the API's ``/metrics``)."""
        return self.telemetry.exposition(await self.store.in_states(HELD_STATES))

    async def _destroy(self, rec: SandboxRecord, *, reason: str, release_now: bool = False) -> None:
        """Stop the sandbox, mark it killed, then free what it held (caller holds the lock, or it
        is recovery).

        Only the stop is waited for: once ``Runtime.halt`` returns, nothing of the sandbox runs
        or answers. Its network, disk, cgroup and pause snapshot are released in the background
        (``release_now`` waits, for recovery, which sweeps orphans right after): those steps
        were 80 % of a kill's time and nobody waits on them. A crash before they finish leaves
        no record naming them, so start-up's ``cleanup_orphans`` and snapshot sweep remove them."""
        self._detach(rec.sandbox_id)
        try:
            await self.logs.collect(rec)  # the files go away with the sandbox
        except (OSError, ForkyardError) as exc:  # ForkyardError: the registry out of reach
            log.warning("collecting the logs of %s failed: %s", rec.sandbox_id, exc)
        # Deferred writes: once detached, the kill goes through whatever the registry does (a
        # kill that stopped here would leave a running sandbox no route and no record names).
        await self._enter(rec, S.KILLING, defer=True)
        instance = rec.instance or SandboxInstance.placeholder(rec.sandbox_id, rec.runtime)
        runtime = self._runtime(rec)
        try:
            await (runtime.kill(instance) if release_now else runtime.halt(instance))
        except Exception as exc:
            await self.logs.event(rec.sandbox_id, "error", f"kill failed: {exc}")
            raise Failed(f"killing sandbox {rec.sandbox_id} failed: {exc}") from exc
        pause_snapshot, rec.pause_snapshot = rec.pause_snapshot, None
        rec.end_at = min(rec.end_at, utcnow())
        await self._enter(rec, S.KILLED, defer=True)
        self.logs.forget(rec.sandbox_id)
        await self.logs.event(rec.sandbox_id, "info", f"sandbox killed: {reason}")
        release = self._release(runtime, instance, pause_snapshot, runtime_done=release_now)
        if release_now:
            await release
        else:
            self.background.spawn(release, name=f"release-{rec.sandbox_id}")

    async def _release(
        self, runtime: Runtime, instance: SandboxInstance, pause_snapshot: str | None, *, runtime_done: bool
    ) -> None:
        """Free what a killed sandbox held: its runtime resources (unless ``runtime_done``) and
        its pause snapshot; the disk layers nothing uses any more go in the collector's next run."""
        if not runtime_done:
            try:
                await runtime.kill(instance)
            except Exception as exc:  # no record names it now: start-up's orphan sweep retries
                log.warning("releasing killed sandbox %s failed: %s", instance.sandbox_id, exc)
        if pause_snapshot:
            await self.catalog.delete(pause_snapshot)
        self.garbage.notify()

    async def set_timeout(self, sandbox_id: str, timeout_seconds: int) -> SandboxRecord:
        """The sandbox now expires ``timeout_seconds`` from now (shorter or longer)."""
        async with self._operate(sandbox_id, "set_timeout") as rec:
            rec.end_at = utcnow() + dt.timedelta(seconds=timeout_seconds)
            await self.store.save(rec)
            return rec

    async def refresh(self, sandbox_id: str, duration_seconds: int) -> SandboxRecord:
        """Keep alive for at least ``duration_seconds`` more (never shortens)."""
        async with self._operate(sandbox_id, "refresh") as rec:
            rec.end_at = max(rec.end_at, utcnow() + dt.timedelta(seconds=duration_seconds))
            await self.store.save(rec)
            return rec

    async def update_network(
        self,
        sandbox_id: str,
        *,
        egress: EgressPolicy,
        allow_internet_access: bool | None,
        dns_servers: list[str] | None = None,
    ) -> SandboxRecord:
        """Replace a running sandbox's outbound policy (E2B's ``PUT /sandboxes/{id}/network``:
        what the update leaves out is cleared). The rules change first, then the record, so a
        record never claims a policy the sandbox does not have; both survive pause, snapshot,
        fork and restart (every restore builds its network from the record)."""
        async with self._operate(sandbox_id, "update_network") as rec:
            assert rec.instance is not None
            await self._runtime(rec).update_network(
                rec.instance, allow_internet_access=allow_internet_access is not False, egress=egress
            )
            rec.network = dataclasses.replace(
                rec.network,
                allow_internet_access=allow_internet_access,
                egress=egress if egress.allow_out or egress.deny_out else None,
                dns_servers=tuple(dns_servers) if dns_servers is not None else None,
            )
            await self.store.save(rec)
            await self.logs.event(
                sandbox_id,
                "info",
                "network policy updated",
                allow_out=",".join([*egress.allow_out, *egress.allow_domains]),
                deny_out=",".join(egress.deny_out),
                internet="off" if allow_internet_access is False else "on",
            )
            return rec

    async def _expire(self, sandbox_id: str) -> None:
        try:
            async with self._lock(sandbox_id):
                rec = await self.get(sandbox_id)
                # Re-check under the lock: a set_timeout may have won the race.
                if rec.state != S.RUNNING or rec.end_at > utcnow():
                    return
                if rec.auto_pause:
                    await self.logs.event(sandbox_id, "info", "timeout reached: pausing (autoPause)")
                    await self._pause_locked(rec, memory=rec.auto_pause_memory)
                else:
                    await self._destroy(rec, reason="timeout reached")
        except NotFound:
            return
        except ForkyardError as exc:
            log.error("expiring sandbox %s failed: %s", sandbox_id, exc)

    # -- pause and resume ----------------------------------------------------------------------

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> None:
        async with self._operate(sandbox_id, "pause") as rec:
            await self._pause_locked(rec, memory=memory)

    async def _pause_locked(self, rec: SandboxRecord, *, memory: bool = True) -> None:
        """Freeze in place (the first tier) where the runtime can, else checkpoint to disk. A
        frozen sandbox is moved to disk later by :meth:`_move_to_disk`. ``memory=False`` (E2B's
        filesystem-only pause): :meth:`_pause_filesystem`."""
        assert rec.instance is not None
        if not memory:
            await self._pause_filesystem(rec)
            return
        self._detach(rec.sandbox_id)
        await self._enter(rec, S.PAUSING)
        started = time.monotonic()
        if self.settings.pause_freeze and await self._freeze(rec):
            await self._paused(rec, "frozen", started)
            return
        try:
            row = await self._take_snapshot(rec, "pause", stop=True)
        except Exception as exc:
            await self._after_failed_snapshot(rec, exc)
            raise_failure(exc, f"pausing sandbox {rec.sandbox_id}")
        rec.pause_snapshot = row.snapshot_id
        await self._paused(rec, "disk", started)

    async def _pause_filesystem(self, rec: SandboxRecord) -> None:
        """Processes end, files stay: envd flushes the root, the runtime stops the sandbox and
        keeps its disk; a resume boots it afresh over that disk (:meth:`_boot_kept_disk`). A
        sandbox whose envd does not answer is not paused (E2B requires a responding guest)."""
        assert rec.instance is not None
        runtime = self._runtime(rec)
        if Capability.FILESYSTEM_PAUSE not in runtime.capabilities:  # the microVM runtimes: 501
            raise NotSupported(
                f"pausing sandbox {rec.sandbox_id} (filesystem only) failed: "
                f"the {runtime.name} runtime has no filesystem-only pause"
            )
        await self.envd.fsfreeze(rec.instance, rec.envd_access_token)  # Unavailable: still running
        self._detach(rec.sandbox_id)
        await self._enter(rec, S.PAUSING)
        started = time.monotonic()
        try:
            rec.instance = await runtime.stop_keep_disk(rec.instance)
        except Exception as exc:
            await self._after_failed_snapshot(rec, exc)  # running again if it survived
            if rec.state == S.RUNNING:
                try:
                    await self.envd.fsthaw(rec.instance, rec.envd_access_token)
                except ForkyardError as thaw_exc:
                    log.warning("thawing the root of %s failed: %s", rec.sandbox_id, thaw_exc)
            raise_failure(exc, f"pausing sandbox {rec.sandbox_id} (filesystem only)")
        await self._paused(rec, "filesystem", started)

    async def _boot_kept_disk(self, rec: SandboxRecord) -> None:
        """The resume of a filesystem-only pause: a fresh boot (new kernel, new boot id, no
        processes) from the template the sandbox's disk stands on, then ``/init``."""
        assert rec.instance is not None
        rootfs = rec.instance.template_rootfs  # what the kept disk stands on
        image = (
            TemplateImage(
                template_id=rec.template_id,
                rootfs=Path(str(rootfs)),
                vcpus=rec.cpu_count,
                memory_mb=rec.memory_mb,
                disk_mb=rec.disk_mb,
            )
            if rootfs
            else templates.load(rec.template_id, self.settings).image
        )
        rec.instance = await self._runtime(rec).boot_kept_disk(self._spec(rec, image), rec.instance)
        rec.memory_base = None  # a new memory: no incremental snapshot may build on the old one
        await self.envd.init(rec.instance, rec.envs, rec.envd_access_token)

    async def _freeze(self, rec: SandboxRecord) -> bool:
        """Whether the sandbox is now frozen; False (checkpoint it instead) when the runtime cannot."""
        assert rec.instance is not None
        runtime = self._runtime(rec)
        if Capability.FREEZE not in runtime.capabilities:
            return False
        try:
            await runtime.freeze(rec.instance)
        except ForkyardError as exc:
            log.warning("freezing %s failed (%s); checkpointing it instead", rec.sandbox_id, exc)
            try:
                await runtime.thaw(rec.instance)
            except ForkyardError as thaw_exc:  # the checkpoint that follows will say if it is stuck
                log.warning("thawing %s after the failed freeze failed: %s", rec.sandbox_id, thaw_exc)
            return False
        return True

    async def _paused(self, rec: SandboxRecord, tier: PauseTier, started: float) -> None:
        rec.paused_at = utcnow()
        await self._enter(rec, S.PAUSED, tier=tier)
        if tier == "frozen":  # its processes live on, frozen: their death loses its memory
            self._watch(rec)
        self.telemetry.observe("pause", tier, time.monotonic() - started)
        await self.logs.event(
            rec.sandbox_id,
            "info",
            f"sandbox paused ({tier})",
            tier=tier,
            duration_ms=str(elapsed_ms(started)),
        )

    async def resume(self, sandbox_id: str, timeout_seconds: int) -> SandboxRecord:
        async with self._operate(sandbox_id, "resume") as rec:
            return await self._resume_locked(rec, timeout_seconds)

    async def connect(self, sandbox_id: str, timeout_seconds: int) -> tuple[SandboxRecord, bool]:
        """A running sandbox's timeout is only extended; a paused one is resumed. Returns the
        record and whether it was resumed."""
        async with self._operate(sandbox_id, "connect") as rec:
            if rec.state == S.PAUSED:
                return await self._resume_locked(rec, timeout_seconds), True
            rec.end_at = max(rec.end_at, utcnow() + dt.timedelta(seconds=timeout_seconds))
            await self.store.save(rec)
            return rec, False

    async def wake(self, sandbox_id: str) -> Route | None:
        """Traffic (an SDK call or a request to one of its ports) reached a sandbox that is not
        running: one paused with ``autoResume`` resumes, with the timeout it was created with
        counted from now (E2B's auto-resume); its route then. None when it stays unreachable."""
        rec = await self.store.get(sandbox_id)
        if rec is None or not rec.auto_resume or rec.state != S.PAUSED:
            return self.route(sandbox_id)
        try:
            await self.connect(sandbox_id, rec.timeout_seconds or self.settings.default_timeout_seconds)
        except ForkyardError as exc:  # killed or failed meanwhile: unreachable, as it was
            log.info("auto-resume of %s failed: %s", sandbox_id, exc)
        return self.route(sandbox_id)

    async def _resume_locked(self, rec: SandboxRecord, timeout_seconds: int) -> SandboxRecord:
        """Thaw a frozen sandbox, restore one from its pause snapshot on disk, or boot one paused
        filesystem-only afresh over its kept disk."""
        tier = rec.pause_tier
        row = None
        if tier not in ("frozen", "filesystem"):
            row = await self.catalog.get(rec.pause_snapshot or "")
            if row is None:
                raise Gone(f"the pause snapshot of sandbox {rec.sandbox_id} is missing")
        await self._enter(rec, S.RESUMING)
        started = time.monotonic()
        try:
            if tier == "filesystem":
                await self._boot_kept_disk(rec)
            elif row is None:
                await self._thaw(rec)
            else:
                await self._restore_in_place(rec, row)
        except Exception as exc:
            await self._destroy(rec, reason=f"resume failed: {exc}")
            raise_failure(exc, f"resuming sandbox {rec.sandbox_id}")
        rec.pause_snapshot = None
        rec.paused_at = None
        rec.end_at = utcnow() + dt.timedelta(seconds=timeout_seconds)
        await self._enter(rec, S.RUNNING, tier=None)
        self._attach(rec)
        self.telemetry.observe("resume", str(tier), time.monotonic() - started)
        await self.logs.event(
            rec.sandbox_id,
            "info",
            f"sandbox resumed ({tier})",
            tier=str(tier),
            duration_ms=str(elapsed_ms(started)),
        )
        if row is not None:
            await self.catalog.delete(row.snapshot_id)  # its layers: collected in the background
        return rec

    async def _thaw(self, rec: SandboxRecord) -> None:
        """Let a frozen sandbox run again; ``/init`` sets its clock (a microVM's stood still).
        Processes killed while frozen die as they thaw (cgroup v1 holds the signal until then):
        ``/init`` races the runtime's death watch, so such a resume answers "not found" at once
        instead of waiting out envd's start-up deadline."""
        assert rec.instance is not None
        # Watched since the pause (or recovery): the wait holds the process already, which a
        # wait started now could not, the process being gone by the time it looked.
        death = self.deaths.exit_wait(rec.sandbox_id)
        await self._runtime(rec).thaw(rec.instance)
        # No restore since its last /init and envd's watches ran until the freeze: nothing to revalidate.
        init = asyncio.ensure_future(
            self.envd.init(rec.instance, rec.envs, rec.envd_access_token, revalidate=False)
        )
        if death is not None:
            await asyncio.wait({init, death}, return_when=asyncio.FIRST_COMPLETED)
            watched = death.done() and not death.cancelled() and death.exception() is None
            reason = death.result() if watched else None
            if reason is not None and not init.done():
                init.cancel()
                await self.logs.event(rec.sandbox_id, "error", f"sandbox died while paused: {reason}")
                raise NotFound(f"sandbox {rec.sandbox_id} died while paused ({reason})")
        await init

    # -- moving frozen sandboxes to disk -------------------------------------------------------

    async def _move_to_disk(self, sandbox_id: str, reason: str) -> None:
        """Checkpoint a frozen sandbox and free its memory; it stays paused (on disk). The record
        says ``moving`` meanwhile, so a crash half-way is recovered (``Recovery``)."""
        try:
            async with self._operate(sandbox_id, "move_to_disk") as rec:
                if rec.pause_tier != "frozen":
                    return
                assert rec.instance is not None
                started = time.monotonic()
                await self._enter(rec, S.PAUSED, tier="moving")
                self.deaths.unwatch(sandbox_id)  # the checkpoint stops it on purpose
                runtime = self._runtime(rec)
                await runtime.thaw(rec.instance)  # a checkpoint needs a running sandbox
                try:
                    row = await self._take_snapshot(rec, "pause", stop=True)
                except Exception as exc:
                    await self._stay_frozen(rec, exc)
                    return
                rec.pause_snapshot = row.snapshot_id
                await self._enter(rec, S.PAUSED, tier="disk")
                self.telemetry.observe("move_to_disk", "disk", time.monotonic() - started)
                await self.logs.event(
                    sandbox_id,
                    "info",
                    f"paused sandbox moved to disk: {reason}",
                    tier="disk",
                    duration_ms=str(elapsed_ms(started)),
                )
        except (NotFound, Conflict):
            return  # resumed or killed meanwhile

    async def _stay_frozen(self, rec: SandboxRecord, exc: BaseException) -> None:
        """A checkpoint that failed: freeze the sandbox again if it survived, else it is lost."""
        assert rec.instance is not None
        log.warning("moving paused sandbox %s to disk failed: %s", rec.sandbox_id, exc)
        if await self._is_alive(rec) and await self._freeze(rec):
            await self._enter(rec, S.PAUSED, tier="frozen")
            self._watch(rec)
            return
        await self._destroy(
            rec, reason=f"moving the paused sandbox to disk failed and it did not survive: {exc}"
        )

    async def _restore_in_place(
        self, rec: SandboxRecord, row: SnapshotRow, *, rollback: bool = False
    ) -> None:
        """Bring ``rec`` back from ``row`` with its own id, address and network (resume, a fork's
        parent, recovery's revive), or with its own id only (a rollback: its instance is gone).
        A rollback's snapshot may be another sandbox's: its envd holds that one's token, which
        ``/init`` then replaces with ``rec``'s."""
        async with self.catalog.use(row) as ref:
            rec.instance = await self._runtime(rec).restore(self._spec(rec, self._image_of(rec, row)), ref)
        rec.memory_base = row.snapshot_id
        current = SnapshotMeta.of(row).envd_access_token if rollback else None
        await self.envd.init(rec.instance, rec.envs, rec.envd_access_token, current_token=current)

    def _image_of(self, rec: SandboxRecord, row: SnapshotRow) -> TemplateImage:
        """The template ``rec`` stands on: the built template, else as the snapshot recorded it
        (sandboxes made from a user snapshot carry the snapshot's id as their template)."""
        try:
            image = templates.load(rec.template_id, self.settings).image
        except templates.TemplateNotFound:
            return SnapshotMeta.of(row).image(rec.template_id)
        # The snapshot's disk lies on the root it recorded; a later build's root is another one.
        recorded = SnapshotMeta.of(row).template_rootfs
        return dataclasses.replace(image, rootfs=Path(recorded)) if recorded else image

    # -- snapshots -----------------------------------------------------------------------------

    async def _take_snapshot(
        self, rec: SandboxRecord, kind: SnapshotKind, *, stop: bool, name: str | None = None
    ) -> SnapshotRow:
        """Snapshot ``rec`` (caller holds its lock), commit it and add its row."""
        assert rec.instance is not None
        meta = SnapshotMeta(
            template_rootfs=rec.instance.template_rootfs,
            cpu_count=rec.cpu_count,
            memory_mb=rec.memory_mb,
            disk_mb=rec.disk_mb,
            envs=rec.envs,
            metadata=rec.metadata,
            envd_access_token=rec.envd_access_token,
        )
        row = await self.catalog.take(
            self._runtime(rec),
            rec.instance,
            kind=kind,
            stop=stop,
            template_id=rec.template_id,
            meta=meta,
            name=name,
            parent=await self.catalog.parent_for(rec.memory_base),
        )
        rec.memory_base = row.snapshot_id
        await self.store.save(rec)
        await self.logs.event(
            rec.sandbox_id,
            "info",
            f"{kind} snapshot {row.snapshot_id} taken",
            duration_ms=str(SnapshotMeta.of(row).duration_ms),
        )
        return row

    async def _after_failed_snapshot(self, rec: SandboxRecord, exc: BaseException) -> None:
        """Back to running if the sandbox survived, else destroy it (never leak it)."""
        log.warning("snapshot of %s failed: %s", rec.sandbox_id, exc)
        if await self._is_alive(rec):
            # Reachable again first: a registry that cannot take the write now (its disk full,
            # the very reason the snapshot failed) must not cut a running sandbox off.
            self._attach(rec)
            try:
                await self._enter(rec, S.RUNNING)
            except ForkyardError as save_failed:  # the row says running already
                log.warning("recording %s running again failed: %s", rec.sandbox_id, save_failed)
            return
        await self._destroy(rec, reason=f"snapshot failed and the sandbox did not survive: {exc}")

    async def create_snapshot(self, sandbox_id: str, name: str | None) -> SnapshotRow:
        async with self._operate(sandbox_id, "snapshot") as rec:
            self._detach(sandbox_id)
            try:
                row = await self._take_snapshot(rec, "snapshot", stop=False, name=name)
            except Exception as exc:
                await self._after_failed_snapshot(rec, exc)
                raise_failure(exc, f"snapshot of sandbox {sandbox_id}")
            self._attach(rec)
            self.telemetry.observe("snapshot", "running", SnapshotMeta.of(row).duration_ms / 1000)
            return row

    async def list_snapshots(self, source: str | None = None, name: str | None = None) -> list[SnapshotRow]:
        rows = await self.catalog.rows("snapshot", source=source)
        if name:
            key = name.split("/")[-1].split(":")[0]
            rows = [r for r in rows if key in (r.name, r.snapshot_id)]
        return rows

    async def delete_snapshot(self, name_or_id: str) -> None:
        await self.template_owner.delete_snapshot(name_or_id)

    # -- rollback (our extension: POST /sandboxes/{id}/rollback) --------------------------------

    async def rollback(self, sandbox_id: str, snapshot_id: str) -> SandboxRecord:
        """Put a running sandbox back to a user snapshot in place: its memory, processes and disk
        become the snapshot's; its id, timeout, metadata, env vars and access tokens stay.

        The running instance is killed and the snapshot restored under the same id (a restore
        needs the id's container, cgroup and network names free), then envd is re-initialised.
        Everything that can refuse is checked before the kill; a failure after it cannot bring
        the old state back, so its undo destroys the sandbox (as a failed resume does)."""
        started = time.monotonic()
        async with self._operate(sandbox_id, "rollback") as rec:
            row = await self._rollback_target(rec, snapshot_id)
            assert rec.instance is not None
            old = rec.instance
            undo = Undo(f"rolling back sandbox {sandbox_id}")
            self._detach(sandbox_id)
            await self._enter(rec, S.RESUMING)
            undo.push("sandbox", lambda: self._destroy(rec, reason=f"rollback to {row.snapshot_id} failed"))
            try:
                await self._runtime(rec).kill(old)
                await self._restore_in_place(rec, row, rollback=True)
                await self._enter(rec, S.RUNNING)
                self._attach(rec)
                undo.commit()
            except BaseException as exc:
                await undo.rollback()
                raise_failure(exc, f"rollback of sandbox {sandbox_id}")
        self.telemetry.observe("rollback", "", time.monotonic() - started)
        await self.logs.event(
            sandbox_id,
            "info",
            f"sandbox rolled back to snapshot {row.snapshot_id}",
            snapshot=row.snapshot_id,
            duration_ms=str(elapsed_ms(started)),
        )
        return rec

    async def _rollback_target(self, rec: SandboxRecord, snapshot_id: str) -> SnapshotRow:
        """The user snapshot ``rec`` may roll back to: one of the same runtime and template root
        file system (the sandbox keeps its template), whose envd token ``/init`` can replace."""
        row = await self.catalog.find_user_snapshot(snapshot_id)
        if row is None:
            raise NotFound(f"snapshot '{snapshot_id}' not found")
        meta = SnapshotMeta.of(row)
        assert rec.instance is not None
        if row.runtime != rec.runtime:
            raise Invalid(
                f"snapshot {row.snapshot_id} is of the {row.runtime} runtime, "
                f"sandbox {rec.sandbox_id} of {rec.runtime}"
            )
        if meta.template_rootfs != rec.instance.template_rootfs:
            raise Invalid(
                f"snapshot {row.snapshot_id} was taken of a sandbox on another template than "
                f"sandbox {rec.sandbox_id}'s ({rec.template_id})"
            )
        if meta.envd_access_token and not rec.envd_access_token:
            raise Invalid(
                f"snapshot {row.snapshot_id} is of a secured sandbox (envd access token); "
                f"sandbox {rec.sandbox_id} is not secured"
            )
        return row

    # -- fork ----------------------------------------------------------------------------------

    async def fork(
        self,
        sandbox_id: str,
        count: int,
        timeout_seconds: int,
        each: Callable[[ForkOutcome], None] | None = None,
    ) -> list[ForkOutcome]:
        """``count`` independent children with the parent's memory, processes and disk.

        The parent is checkpointed once. Where the runtime can, it keeps running through the
        checkpoint (paused only for it); else it is stopped and restored in place *alongside*
        its children (one more restore of the same image). Each child's timeout starts when the
        call returns, not when it was restored: a caller must be able to use it. With ``each``
        (a streaming fork, our extension), every child is handed to it as soon as it is up, its
        timeout starting then. A paused parent is not resumed: :meth:`_fork_paused`."""
        if not 1 <= count <= MAX_FORK_COUNT:
            raise Invalid(f"count must be between 1 and {MAX_FORK_COUNT}")
        started = time.monotonic()
        if (await self.get(sandbox_id)).pause_tier == "frozen":
            # Its memory must be on disk to restore children from: the frozen tier's own move.
            await self._move_to_disk(sandbox_id, "forked while paused")
        async with self._operate(sandbox_id, "fork") as rec:
            if rec.state == S.PAUSED:
                outcomes = await self._fork_paused(rec, count, timeout_seconds, each)
                self.telemetry.observe("fork", f"{count} paused", time.monotonic() - started)
                return outcomes
            assert rec.instance is not None
            keeps_running = await self._runtime(rec).snapshot_keeps_running(rec.instance)
            self._detach(sandbox_id)
            try:
                row = await self._take_snapshot(rec, "fork", stop=not keeps_running)
            except Exception as exc:
                await self._after_failed_snapshot(rec, exc)
                raise_failure(exc, f"fork of sandbox {sandbox_id}")
            gate = asyncio.Semaphore(FORK_PARALLELISM)
            children = [
                asyncio.ensure_future(self._fork_child(row, rec, gate, timeout_seconds, each))
                for _ in range(count)
            ]
            if keeps_running:
                self._attach(rec)
            else:
                await asyncio.shield(self._revive_parent(rec, row))
        try:
            outcomes = await asyncio.shield(asyncio.gather(*children))
        finally:
            # Children stand on the snapshot's disk layers (they hold them) and the runtime has
            # read the memory image: the snapshot itself is not needed any more.
            await self.catalog.delete(row.snapshot_id)
        self.telemetry.observe("fork", str(count), time.monotonic() - started)
        if each is not None:  # each child's timeout restarted when it was handed out
            return list(outcomes)
        return [await self._restart_timeout(o, timeout_seconds) for o in outcomes]

    async def _fork_paused(
        self,
        rec: SandboxRecord,
        count: int,
        timeout_seconds: int,
        each: Callable[[ForkOutcome], None] | None,
    ) -> list[ForkOutcome]:
        """Children of a paused sandbox restore its pause snapshot (a frozen one was moved to disk
        first); the parent stays paused, untouched. The caller holds the parent's lock until the
        children are up: a resume or kill of the parent deletes that snapshot."""
        if rec.pause_tier != "disk":
            # filesystem-only: no memory to fork; frozen: its move to disk failed (logged).
            raise Conflict(
                f"sandbox {rec.sandbox_id} is paused without its memory on disk ({rec.pause_tier}); "
                "resume it to fork it"
            )
        row = await self.catalog.get(rec.pause_snapshot or "")
        if row is None:
            raise Gone(f"the pause snapshot of sandbox {rec.sandbox_id} is missing")
        gate = asyncio.Semaphore(FORK_PARALLELISM)
        children = [self._fork_child(row, rec, gate, timeout_seconds, each) for _ in range(count)]
        outcomes = await asyncio.shield(asyncio.gather(*children))
        if each is not None:
            return list(outcomes)
        return [await self._restart_timeout(o, timeout_seconds) for o in outcomes]

    async def _revive_parent(self, rec: SandboxRecord, row: SnapshotRow) -> None:
        """A parent that cannot come back is destroyed; its children live on."""
        try:
            await self._restore_in_place(rec, row)
        except Exception as exc:
            # The children must still be awaited: a parent whose clean-up failed stays "killing"
            # (logged) and the next start-up retries it.
            with contextlib.suppress(Failed):
                await self._destroy(rec, reason=f"restoring the parent after its fork failed: {exc}")
            return
        await self.store.save(rec)
        self._attach(rec)

    async def _fork_child(
        self,
        row: SnapshotRow,
        parent: SandboxRecord,
        gate: asyncio.Semaphore,
        timeout_seconds: int,
        each: Callable[[ForkOutcome], None] | None = None,
    ) -> ForkOutcome:
        """A fork child is made like its parent: same metadata, network and traffic policy."""
        req = CreateRequest(
            template_id=row.snapshot_id,
            timeout_seconds=timeout_seconds,
            metadata=dict(parent.metadata),
            envs={},
            secure=parent.envd_access_token is not None,
            allow_public_traffic=parent.traffic_access_token is None,
            network=parent.network,
        )
        async with gate:
            try:
                outcome = ForkOutcome(await self._restore_new(row, req, origin="fork"), None)
            except ForkyardError as exc:
                outcome = ForkOutcome(None, exc)
        if each is not None:
            outcome = await self._restart_timeout(outcome, timeout_seconds)
            each(outcome)
        return outcome

    async def _restart_timeout(self, outcome: ForkOutcome, timeout_seconds: int) -> ForkOutcome:
        if outcome.record is None:
            return outcome
        try:
            return dataclasses.replace(
                outcome, record=await self.set_timeout(outcome.record.sandbox_id, timeout_seconds)
            )
        except (NotFound, Conflict):  # killed or paused by someone else meanwhile: theirs to say
            return outcome


def build_orchestrator(settings: Settings, runtime: Runtime) -> Orchestrator:
    """The composition root: the lifecycle owner and its collaborators for one node."""
    runtimes = RuntimeSet(settings, runtime)
    store = SandboxStore.from_settings(settings)
    background = Background()
    durable = DurableSnapshots(
        settings.data_dir,
        settings.s3,
        templates_dir=settings.templates_dir,
        objects=SnapshotObjects.from_settings(settings.s3),
        background=background,
    )
    catalog = SnapshotCatalog(
        settings.data_dir, durable=durable, runtimes=runtimes, templates_dir=settings.templates_dir
    )
    garbage = GarbageCollector(catalog.collect_garbage, background)
    catalog.on_delete(garbage.notify)
    durable.collect = garbage.collect  # its cache cap measures again after each eviction
    envd = EnvdClient()
    rowless = RowlessSandboxes(runtimes)  # the node's own sandboxes: template snapshots, pools, builds
    template_snapshots = TemplateSnapshots(settings, catalog, runtimes, background, envd, rowless)
    standbys = Standbys(settings, catalog, runtimes, envd, rowless)
    return Orchestrator(
        settings,
        runtimes=runtimes,
        store=store,
        catalog=catalog,
        template_snapshots=template_snapshots,
        standbys=standbys,
        background=background,
        envd=envd,
        logs=SandboxLogs(store, settings.data_dir / "sandboxes"),
        telemetry=Telemetry(settings.data_dir),
        template_owner=TemplateOwner(
            settings,
            catalog=catalog,
            runtimes=runtimes,
            template_snapshots=template_snapshots,
            standbys=standbys,
            background=background,
            garbage=garbage,
            rowless=rowless,
        ),
        garbage=garbage,
    )
