"""The node role (``forkyard node serve``): today's server, reached only through gateways.

:func:`install` makes an app built by :func:`forkyard.api.app.create_app` a cluster node: every
request must carry a gateway's signature (:class:`~forkyard.api.nodeauth.NodeAuth`, which then
stands in for the API key), and the node heartbeats its capacity into the shared database
(:class:`~forkyard.orchestrator.heartbeat.Heartbeat`) from start-up to shutdown.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI

from forkyard import __version__
from forkyard.api.auth import require_api_key
from forkyard.api.console.node import node_status
from forkyard.api.nodeauth import NodeAuth, require_gateway_signature
from forkyard.config import Settings
from forkyard.errors import Invalid
from forkyard.orchestrator.heartbeat import Capacity, Heartbeat
from forkyard.orchestrator.lifecycle import Orchestrator
from forkyard.storage.db import engine_for
from forkyard.types import ADMITTED_STATES

log = logging.getLogger(__name__)

#: A slot: room for one more sandbox of E2B's default size.
SLOT_MIB = 512


async def measure(app: FastAPI) -> Capacity:
    """The heartbeat's numbers, from what ``GET /node`` reports."""
    status = await node_status(app)
    cap = status["capacity"]
    settings: Settings = app.state.settings
    free = int(cap["memoryAvailableMiB"])
    by_state = status["sandboxes"]["byState"]
    # Those on their way to running count: the gateway spreads creates by this.
    held = sum(int(by_state.get(str(s), 0)) for s in ADMITTED_STATES)
    slots = max(0, free // SLOT_MIB)
    if settings.max_sandboxes > 0:  # the node refuses creates past it (Orchestrator._admit)
        slots = min(slots, max(0, settings.max_sandboxes - held))
    return Capacity(
        runtime=str(status["runtime"]),
        vcpus_total=int(cap["cpuCount"]),
        vcpus_free=max(0, int(cap["cpuCount"]) - int(cap["allocatedCpuCount"])),
        memory_total_mib=int(cap["memoryTotalMiB"]),
        memory_free_mib=free,
        disk_free_mib=int(cap["diskFreeMiB"]),
        sandboxes_running=held,
        slots_free=slots,
        warm_templates=list(settings.warm_pool_templates) if settings.warm_pool_high > 0 else [],
    )


def install(app: FastAPI, settings: Settings) -> None:
    """Call last in ``create_app``: the signature check must be the outermost middleware (in
    front of the sandbox proxy too)."""
    app.dependency_overrides[require_api_key] = require_gateway_signature

    @contextlib.asynccontextmanager
    async def heartbeat_lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Router lifespans run after the app's own: the orchestrator (and the schema) are up.
        orch: Orchestrator = app.state.orchestrator
        engine = engine_for(settings.resolved_database_url)

        async def reap() -> None:
            reaped = await orch.reap_killed_elsewhere()
            if reaped:
                log.warning("stopped sandboxes the cluster reported killed: %s", ", ".join(reaped))

        heartbeat = Heartbeat(engine, settings, lambda: measure(app), reap=reap, version=__version__)
        await heartbeat.start()
        log.info(
            "node %s: heartbeating as %s every %.1f s", heartbeat.node_id, heartbeat.url, heartbeat.interval
        )
        try:
            yield
        finally:
            await heartbeat.stop()
            await engine.dispose()

    app.include_router(APIRouter(lifespan=heartbeat_lifespan))
    app.add_middleware(NodeAuth, settings=settings)


def require_cluster_settings(settings: Settings, command: str) -> None:
    """Cluster roles share a database and a secret: refuse to start without them."""
    missing = []
    if not settings.database_url:
        missing.append("FORKYARD_DATABASE_URL (the shared database, postgresql+asyncpg://user@host:port/db)")
    if not [s for s in settings.node_secrets if s]:
        missing.append('FORKYARD_NODE_SECRETS (a JSON list of shared secrets, e.g. ["<32+ random bytes>"])')
    if missing:
        raise Invalid(f"{command} needs " + " and ".join(missing))
