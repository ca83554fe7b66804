"""envd calls through the two routes the official SDK takes, on one sandbox, in the same run:

- ``http_sandbox_url``: ``E2B_SANDBOX_URL`` set (what the other benchmarks use): plain HTTP to
  the API port, the sandbox named in headers;
- ``https_sandbox_domain``: no ``E2B_SANDBOX_URL`` (the SDK marks it deprecated): HTTPS to
  ``49983-{id}.{domain}`` on the TLS listener, as an E2B user's code runs by default.

Each run times five ``echo hi`` and five ``files.read`` of a small file back to back on each
route, the routes taking turns from run to run. The SDK's HTTP client reads its trust roots
once per process, so the measurement runs in a child process started with ``SSL_CERT_FILE`` set
(as a user's program).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from typing import Any

from bench.harness import REPO, serve, stats, timed
from bench.lifecycle import _first_command
from tests.support import free_port

DOMAIN = "forkyard.localhost"
ROUTES = ("http_sandbox_url", "https_sandbox_domain")
CALLS = ("echo_hi", "files_read")
CALLS_PER_RUN = 5
SMALL_FILE = "/tmp/bench-sandbox-urls"


def run(runs: int) -> dict[str, Any]:
    tls_port = free_port()
    env = {"FORKYARD_TLS_PORT": str(tls_port), "FORKYARD_SANDBOX_DOMAIN": DOMAIN}
    with serve(extra_env=env) as server:
        child_env = {k: v for k, v in os.environ.items() if k not in ("E2B_SANDBOX_URL", "E2B_DEBUG")}
        child_env |= {
            "SSL_CERT_FILE": str(server.data_dir / "tls" / "ca-bundle.pem"),
            "E2B_API_URL": server.url,
            "E2B_API_KEY": server.api_key,
        }
        argv = [sys.executable, "-m", "bench.sandbox_urls", str(runs), server.url]
        proc = subprocess.run(argv, env=child_env, cwd=REPO, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"sandbox_urls client failed: {proc.stderr[-3000:]}")
        samples: dict[str, dict[str, list[float]]] = json.loads(proc.stdout.strip().splitlines()[-1])
    result: dict[str, Any] = {
        route: {call: stats(samples[route][call]) for call in CALLS} for route in ROUTES
    }
    result["https_over_http_p50"] = {
        call: round(
            float(result["https_sandbox_domain"][call]["p50_ms"])
            / float(result["http_sandbox_url"][call]["p50_ms"]),
            3,
        )
        for call in CALLS
    }
    result["notes"] = (
        "One sandbox, both routes taking turns (5 calls back to back each); https_sandbox_domain = "
        "the SDK without E2B_SANDBOX_URL (TLS listener, *.forkyard.localhost), baseline "
        "http_sandbox_url."
    )
    return result


def _client(runs: int, api_url: str) -> None:
    """In the child: one sandbox, reached through both routes."""
    from e2b import Sandbox

    direct = Sandbox.create("base", timeout=600, sandbox_url=api_url)
    try:
        by_domain = Sandbox.connect(direct.sandbox_id)
        assert by_domain.envd_api_url.startswith("https://"), by_domain.envd_api_url
        direct.files.write(SMALL_FILE, "hello")
        sandboxes = {"http_sandbox_url": direct, "https_sandbox_domain": by_domain}
        samples: dict[str, dict[str, list[float]]] = {r: {c: [] for c in CALLS} for r in ROUTES}
        for sbx in sandboxes.values():  # each route's connection opened before timing
            sbx.commands.run("true")
        for n in range(runs):
            # Back to back on one route, as a user's loop calls: a connection idle between
            # calls leaves TCP's delayed ACKs off and would hide a stall that needs them on.
            for route in ROUTES if n % 2 == 0 else ROUTES[::-1]:
                sbx = sandboxes[route]
                for _ in range(CALLS_PER_RUN):
                    samples[route]["echo_hi"].append(timed(partial(_first_command, sbx)))
                for _ in range(CALLS_PER_RUN):
                    samples[route]["files_read"].append(timed(partial(sbx.files.read, SMALL_FILE)))
    finally:
        direct.kill()
    print(json.dumps(samples))


def main() -> None:
    """``python -m bench.sandbox_urls RUNS API_URL``: the child's side (see :func:`run`)."""
    _client(int(sys.argv[1]), sys.argv[2])


if __name__ == "__main__":
    main()
