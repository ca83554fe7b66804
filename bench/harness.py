"""Shared benchmark plumbing: a real `agentenv serve`, timing statistics, result files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
API_KEY = "e2b_bench_0000000000000000000000000000"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    api_key: str
    process: subprocess.Popen[bytes]
    data_dir: Path

    def sdk_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}


@contextlib.contextmanager
def serve(runtime: str = "auto", extra_env: dict[str, str] | None = None) -> Iterator[Server]:
    """Start a real `agentenv serve` on a free port with a throw-away data dir and the shared
    template cache; stop it (and with it every sandbox) afterwards."""
    port = free_port()
    data_dir = Path(tempfile.mkdtemp(prefix="agentenv-bench-"))
    env = {
        **os.environ,
        "AGENTENV_DATA_DIR": str(data_dir),
        "AGENTENV_TEMPLATES_PATH": os.environ.get("AGENTENV_TEMPLATES_PATH", "/var/lib/agentenv/templates"),
        "AGENTENV_API_KEYS": json.dumps([API_KEY]),
        "AGENTENV_RUNTIME": runtime,
        **(extra_env or {}),
    }
    log = open(data_dir / "server.log", "wb")  # closed in the finally below
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentenv.cli.main", "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {(data_dir / 'server.log').read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code < 500:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start within 60 s")
            time.sleep(0.2)
        yield Server(url, API_KEY, proc, data_dir)
    finally:
        # Sandboxes outlive a stopped server (a restart re-attaches them): a throw-away server
        # must kill its own, even when the benchmark failed half-way.
        _kill_all(url)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        # The server removed its sandboxes on the way out; what is left is its own state.
        if not any(str(data_dir) in line for line in Path("/proc/mounts").read_text().splitlines()):
            shutil.rmtree(data_dir, ignore_errors=True)


def _kill_all(url: str) -> None:
    headers = {"X-API-Key": API_KEY}
    with contextlib.suppress(httpx.HTTPError, ValueError):
        for sandbox in httpx.get(f"{url}/v2/sandboxes", headers=headers, timeout=30).json():
            with contextlib.suppress(httpx.HTTPError):
                httpx.delete(f"{url}/sandboxes/{sandbox['sandboxID']}", headers=headers, timeout=120)


def write_result(name: str, payload: dict[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    recorded_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    payload = {"benchmark": name, "recorded_at": recorded_at, **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
