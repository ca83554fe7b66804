"""``GET /node`` (our extension, not E2B's): the node's capacity, its sandboxes by state and pause
tier, its runtime and that runtime's platform, and a summary of the lifecycle histograms of
``/metrics``, as JSON for ``forkyard node status`` and the console.

:class:`NodeHistory` samples the same figures every :data:`SAMPLE_SECONDS` in memory (the last
hour) so the console can chart capacity and lifecycle latencies over time without a Prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import psutil
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from forkyard.api.auth import require_api_key
from forkyard.orchestrator.lifecycle import Orchestrator
from forkyard.runtime.base import Runtime
from forkyard.types import HELD_STATES, SandboxState

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 5.0
HISTORY_SAMPLES = 720  # an hour at SAMPLE_SECONDS
LIFECYCLE_METRIC = "forkyard_lifecycle_seconds"


@dataclass
class Latency:
    """One ``operation``/``detail`` series of the lifecycle histogram (cumulative)."""

    count: int
    total_seconds: float
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count)

    def quantile(self, q: float) -> float | None:
        """The bucket bound below which ``q`` of the observations fall (Prometheus' estimate
        without interpolation: an upper bound)."""
        if self.count == 0:
            return None
        want = q * self.count
        for bound, seen in self.buckets:
            if seen >= want:
                return bound
        return None


def lifecycle(orch: Orchestrator) -> dict[str, Latency]:
    """The lifecycle histogram from the telemetry's collectors, keyed ``operation`` or
    ``operation/detail``."""
    series: dict[str, Latency] = {}
    for family in orch.telemetry.collectors.collect():
        if family.name != LIFECYCLE_METRIC:
            continue
        for sample in family.samples:
            labels = sample.labels
            key = labels["operation"] + (f"/{labels['detail']}" if labels.get("detail") else "")
            lat = series.setdefault(key, Latency(0, 0.0, []))
            if sample.name.endswith("_count"):
                lat.count = int(sample.value)
            elif sample.name.endswith("_sum"):
                lat.total_seconds = sample.value
            elif sample.name.endswith("_bucket"):
                lat.buckets.append((float(labels["le"]), sample.value))
    return series


def _mib(n: float) -> int:
    return int(n // (1 << 20))


async def node_status(app: FastAPI) -> dict[str, Any]:
    orch: Orchestrator = app.state.orchestrator
    runtime: Runtime = app.state.hub.runtime
    live = await orch.store.in_states(HELD_STATES)
    by_state: dict[str, int] = {}
    by_tier: dict[str, int] = {}
    for rec in live:
        by_state[str(rec.state)] = by_state.get(str(rec.state), 0) + 1
        if rec.state == SandboxState.PAUSED:
            tier = rec.pause_tier or "disk"
            by_tier[tier] = by_tier.get(tier, 0) + 1
    running = [r for r in live if r.state == SandboxState.RUNNING]
    mem = psutil.virtual_memory()
    disk = shutil.disk_usage(orch.settings.data_dir)
    return {
        "runtime": runtime.name,
        "platform": runtime.platform(),
        "capacity": {
            "cpuCount": os.cpu_count() or 1,
            "loadAverage1m": round(os.getloadavg()[0], 2),
            "memoryTotalMiB": _mib(mem.total),
            "memoryAvailableMiB": _mib(mem.available),
            "diskTotalMiB": _mib(disk.total),
            "diskFreeMiB": _mib(disk.free),
            "allocatedCpuCount": sum(r.cpu_count for r in running),
            "allocatedMemoryMiB": sum(r.memory_mb for r in running),
        },
        "sandboxes": {"total": len(live), "byState": by_state, "pausedByTier": by_tier},
        "lifecycle": {
            key: {
                "count": lat.count,
                "meanMs": round(lat.total_seconds / lat.count * 1000, 2) if lat.count else None,
                "p50UpperMs": _ms(lat.quantile(0.5)),
                "p95UpperMs": _ms(lat.quantile(0.95)),
            }
            for key, lat in sorted(lifecycle(orch).items())
        },
        "at": dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z"),
    }


def _ms(seconds: float | None) -> float | None:
    if seconds is None or seconds == float("inf"):
        return None
    return round(seconds * 1000, 2)


class NodeHistory:
    """Samples of capacity, sandbox counts and per-interval lifecycle means, newest last."""

    def __init__(self) -> None:
        self.samples: deque[dict[str, Any]] = deque(maxlen=HISTORY_SAMPLES)
        self._last: dict[str, tuple[int, float]] = {}

    async def sample(self, app: FastAPI) -> None:
        status = await node_status(app)
        now = lifecycle(app.state.orchestrator)
        # Mean latency of the operations that finished since the previous sample, per operation
        # (the histogram is cumulative; a chart of its running mean would hide changes).
        interval: dict[str, float] = {}
        for key, lat in now.items():
            op = key.split("/")[0]
            count, total = self._last.get(key, (0, 0.0))
            if lat.count > count:
                n, s = interval.get(op + "#n", 0.0), interval.get(op, 0.0)
                interval[op] = s + (lat.total_seconds - total)
                interval[op + "#n"] = n + (lat.count - count)
            self._last[key] = (lat.count, lat.total_seconds)
        means = {op: round(v / interval[op + "#n"] * 1000, 2) for op, v in interval.items() if "#" not in op}
        cap = status["capacity"]
        self.samples.append(
            {
                "t": time.time(),
                "memoryAvailableMiB": cap["memoryAvailableMiB"],
                "memoryTotalMiB": cap["memoryTotalMiB"],
                "allocatedMemoryMiB": cap["allocatedMemoryMiB"],
                "loadAverage1m": cap["loadAverage1m"],
                "byState": status["sandboxes"]["byState"],
                "latencyMs": means,
            }
        )

    async def run(self, app: FastAPI) -> None:
        while True:
            try:
                await self.sample(app)
            except Exception:  # a sample lost is a gap in a chart, never a dead sampler
                log.exception("node history: sampling failed")
            await asyncio.sleep(SAMPLE_SECONDS)


@contextlib.asynccontextmanager
async def history_lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Runs inside the app's lifespan (FastAPI merges router lifespans after the app's own, so
    the orchestrator is up)."""
    history = NodeHistory()
    app.state.node_history = history
    task = asyncio.create_task(history.run(app), name="node-history")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


router = APIRouter(dependencies=[Depends(require_api_key)], lifespan=history_lifespan)


@router.get("/node", include_in_schema=False)
async def get_node(request: Request) -> JSONResponse:
    """Our extension: the node's status as JSON (``forkyard node status``)."""
    return JSONResponse(await node_status(request.app))


@router.get("/node/history", include_in_schema=False)
async def get_node_history(request: Request) -> JSONResponse:
    """Our extension: the samples behind the console's charts, oldest first."""
    history: NodeHistory = request.app.state.node_history
    return JSONResponse({"intervalSeconds": SAMPLE_SECONDS, "samples": list(history.samples)})
