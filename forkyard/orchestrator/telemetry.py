"""The node's own metrics (Prometheus text format at the API's ``/metrics``, our extension):
how long each lifecycle operation takes, how many sandboxes are in each state, pause tier and
runtime (the E2B API shows every tier as ``paused``; operators see which), and the node's
capacity beside what its sandboxes are allotted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from forkyard.orchestrator.store import SandboxRecord
from forkyard.types import SandboxState

#: Seconds; dense below 100 ms where the frozen tier and warm pool live.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Telemetry:
    def __init__(self, data_dir: Path | None = None) -> None:
        #: Where the node keeps sandboxes and snapshots: its disk capacity is measured there.
        self.data_dir = data_dir
        self.collectors = CollectorRegistry()
        self._durations = Histogram(
            "forkyard_lifecycle_seconds",
            "Duration of lifecycle operations (operation: create, pause, resume, move_to_disk, "
            "snapshot, fork, kill; detail: origin of a create, pause tier of a pause or resume)",
            ["operation", "detail"],
            buckets=BUCKETS,
            registry=self.collectors,
        )
        self._sandboxes = Gauge(
            "forkyard_sandboxes",
            "Sandboxes on this node by state, pause tier and runtime",
            ["state", "tier", "runtime"],
            registry=self.collectors,
        )
        self._cpus = Gauge("forkyard_node_cpus", "CPUs of the node", registry=self.collectors)
        self._memory = Gauge(
            "forkyard_node_memory_bytes",
            "Node memory (kind: total, available)",
            ["kind"],
            registry=self.collectors,
        )
        self._disk = Gauge(
            "forkyard_node_disk_bytes",
            "File system of the node's data directory (kind: total, free)",
            ["kind"],
            registry=self.collectors,
        )
        self._allotted = Gauge(
            "forkyard_node_allotted",
            "What running sandboxes are allotted (resource: vcpus, memory_bytes, disk_bytes)",
            ["resource"],
            registry=self.collectors,
        )

    def observe(self, operation: str, detail: str, seconds: float) -> None:
        self._durations.labels(operation=operation, detail=detail).observe(seconds)

    def exposition(self, live: list[SandboxRecord]) -> bytes:
        """The metrics in Prometheus' text format, with the sandbox counts taken from ``live``."""
        self._sandboxes.clear()
        for rec in live:
            self._sandboxes.labels(state=str(rec.state), tier=rec.pause_tier or "", runtime=rec.runtime).inc()
        self._capacity([r for r in live if r.state == SandboxState.RUNNING])
        return generate_latest(self.collectors)

    def _capacity(self, running: list[SandboxRecord]) -> None:
        self._cpus.set(os.cpu_count() or 1)
        memory = psutil.virtual_memory()
        self._memory.labels(kind="total").set(memory.total)
        self._memory.labels(kind="available").set(memory.available)
        if self.data_dir is not None and self.data_dir.exists():
            disk = shutil.disk_usage(self.data_dir)
            self._disk.labels(kind="total").set(disk.total)
            self._disk.labels(kind="free").set(disk.free)
        self._allotted.labels(resource="vcpus").set(sum(r.cpu_count for r in running))
        self._allotted.labels(resource="memory_bytes").set(sum(r.memory_mb for r in running) << 20)
        self._allotted.labels(resource="disk_bytes").set(sum(r.disk_mb for r in running) << 20)
