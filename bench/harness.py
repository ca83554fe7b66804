"""Shared benchmark plumbing: timing statistics, result files, and the server launcher of
tests/support/server.py (one launcher for tests and benchmarks)."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.support import REPO
from tests.support.server import ServerProcess
from tests.support.server import serve as server_process

__all__ = ["REPO", "RESULTS", "ServerProcess", "serve", "stats", "timed", "write_result"]

RESULTS = REPO / "bench" / "results"


def stats(samples_s: list[float]) -> dict[str, float | int]:
    """p50/p95/max in milliseconds over the samples (nearest-rank percentiles)."""
    ordered = sorted(samples_s)
    if not ordered:
        return {"n": 0}

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p * len(ordered) + 0.5) - 1))]

    return {
        "n": len(ordered),
        "p50_ms": round(rank(0.50) * 1000, 2),
        "p95_ms": round(rank(0.95) * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 2),
    }


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def serve(runtime: str = "auto", extra_env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A real `forkyard serve` with production settings (no test defaults: warm pools on) on a
    free port, a throw-away data dir and the shared template cache; afterwards every sandbox is
    killed, the server stopped and the data dir removed (tests/support/server.py, which the system
    tests use too). Its log: ``server.log_path``. The HTTPS listener for sandbox URLs is off (it
    binds one fixed port, and benches run servers side by side; nothing measured goes through it)."""
    with server_process(
        prefix="forkyard-bench-", runtime=runtime, extra_env=extra_env, defaults={"FORKYARD_TLS_PORT": "0"}
    ) as server:
        yield server


def write_result(name: str, payload: dict[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    recorded_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    payload = {"benchmark": name, "recorded_at": recorded_at, **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
