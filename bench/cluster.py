"""The gateway's cost on a sandbox round trip (issue 11's "gateway proxy overhead on a command
round trip (vs the node directly)"), on a real cluster on this machine (tests/support/cluster.py:
PostgreSQL, moto S3, a gateway and two nodes).

    .venv/bin/python -m bench.cluster [--runs 200]     (or: python -m bench --only cluster)

Rows, each p50/p95/max over ``--runs``:
- ``envd_file_read``: ``GET /files`` of a small file from envd, one keep-alive httpx client,
  through the gateway (SDK -> gateway -> node proxy -> envd) vs to the node directly (signed as a
  gateway signs, the node's proxy -> envd): the difference is the gateway hop.
- ``command_round_trip_via_gateway``: ``sandbox.commands.run("true")`` through the SDK against the
  gateway (the node cannot be reached by the SDK directly: it answers only signed requests).
Writes bench/results/cluster.json.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
from e2b import Sandbox

from bench.harness import stats, write_result
from forkyard.api import nodeauth
from tests.support.cluster import API_KEY, SECRET, run_cluster
from tests.support.postgres import postgres_cluster
from tests.support.s3 import s3_server

PATH = "/home/user/bench.txt"


def _signing_hook(request: httpx.Request) -> None:
    """Sign as a gateway does for envd traffic (body not read ahead: UNSIGNED-PAYLOAD)."""
    target = request.url.raw_path.decode("latin-1")
    request.headers.update(
        nodeauth.signed_headers([SECRET], "bench", request.method, target, nodeauth.UNSIGNED_PAYLOAD)
    )


def _file_reads(base_url: str, sandbox_id: str, token: str, runs: int, sign: bool) -> list[float]:
    headers = {"E2B-Sandbox-Id": sandbox_id, "E2B-Sandbox-Port": "49983", "X-Access-Token": token}
    hooks: dict[str, Any] = {"request": [_signing_hook]} if sign else {}
    samples = []
    with httpx.Client(base_url=base_url, headers=headers, event_hooks=hooks, trust_env=False) as client:
        for i in range(runs + 5):
            started = time.perf_counter()
            resp = client.get("/files", params={"path": PATH, "username": "user"})
            elapsed = time.perf_counter() - started
            assert resp.status_code == 200 and resp.text == "bench", (resp.status_code, resp.text[:200])
            if i >= 5:  # warm-up: connections opened, caches filled
                samples.append(elapsed)
    return samples


def run(runs: int) -> dict[str, object]:
    with postgres_cluster() as pg, s3_server() as s3, run_cluster(pg.new_database(), s3) as cluster:
        sbx = Sandbox.create(timeout=600, **cluster.sdk)
        sbx.files.write(PATH, "bench")
        node = cluster.nodes[cluster.owner(sbx.sandbox_id)]
        detail = httpx.get(
            f"{cluster.gateway.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": API_KEY}
        ).json()
        token = detail.get("envdAccessToken") or ""
        via_gateway = _file_reads(cluster.gateway.url, sbx.sandbox_id, token, runs, sign=False)
        direct = _file_reads(node.url, sbx.sandbox_id, token, runs, sign=True)
        commands = []
        for i in range(min(runs, 100) + 3):
            started = time.perf_counter()
            sbx.commands.run("true")
            if i >= 3:
                commands.append(time.perf_counter() - started)
        sbx.kill()
    gateway_stats, direct_stats = stats(via_gateway), stats(direct)
    return {
        "envd_file_read": {"via_gateway": gateway_stats, "node_directly": direct_stats},
        "gateway_overhead_p50_ms": round(float(gateway_stats["p50_ms"]) - float(direct_stats["p50_ms"]), 3),
        "command_round_trip_via_gateway": stats(commands),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--result", default="cluster", help="name of the result file under bench/results/")
    args = parser.parse_args()
    print(write_result(args.result, run(args.runs)))


if __name__ == "__main__":
    main()
