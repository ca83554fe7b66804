"""Each running sandbox's sampled resource usage (E2B's ``GET /sandboxes/{id}/metrics``): the
reaper samples every sandbox every few seconds, a request adds a fresh sample."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from forkyard.orchestrator.timing import utcnow
from forkyard.runtime.base import Runtime
from forkyard.types import SandboxInstance, SandboxMetrics

log = logging.getLogger(__name__)

METRICS_HISTORY = 720  # one hour at the reaper's 5 s


@dataclass(frozen=True)
class MetricSample:
    at: dt.datetime
    metrics: SandboxMetrics


class MetricsHistory:
    def __init__(self, kept: int = METRICS_HISTORY) -> None:
        self._kept = kept
        self._samples: dict[str, list[MetricSample]] = {}

    async def sample(self, sandbox_id: str, runtime: Runtime, instance: SandboxInstance) -> None:
        try:
            m = await runtime.metrics(instance)
        except Exception as exc:  # a sandbox mid-transition has no metrics: skip this sample
            log.debug("metrics of %s failed: %s", sandbox_id, exc)
            return
        history = self._samples.setdefault(sandbox_id, [])
        history.append(MetricSample(utcnow(), m))
        del history[: -self._kept]

    def of(self, sandbox_id: str) -> list[MetricSample]:
        return list(self._samples.get(sandbox_id, []))

    def forget(self, sandbox_id: str) -> None:
        self._samples.pop(sandbox_id, None)
