"""The node's own metrics (Prometheus text format at the API's ``/metrics``, our extension):
how long each lifecycle operation takes, and how many sandboxes are in each state and pause
tier (the E2B API shows both tiers as ``paused``; operators see which)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from agentenv.orchestrator.store import SandboxRecord

#: Seconds; dense below 100 ms where the frozen tier and warm pool live.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._durations = Histogram(
            "agentenv_lifecycle_seconds",
            "Duration of lifecycle operations (operation: create, pause, resume, move_to_disk, "
            "snapshot, fork, kill; detail: origin of a create, pause tier of a pause or resume)",
            ["operation", "detail"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self._sandboxes = Gauge(
            "agentenv_sandboxes",
            "Sandboxes on this node by state and pause tier",
            ["state", "tier"],
            registry=self.registry,
        )

    def observe(self, operation: str, detail: str, seconds: float) -> None:
        self._durations.labels(operation=operation, detail=detail).observe(seconds)

    def exposition(self, live: list[SandboxRecord]) -> bytes:
        """The metrics in Prometheus' text format, with the sandbox counts taken from ``live``."""
        self._sandboxes.clear()
        for rec in live:
            self._sandboxes.labels(state=str(rec.state), tier=rec.pause_tier or "").inc()
        return generate_latest(self.registry)
