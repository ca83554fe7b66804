"""What a fork child placed on another node costs compared with one on the parent's node
(docs/CLUSTER.md "Fork across nodes"), on a real cluster on this machine (tests/support/cluster.py:
PostgreSQL, moto S3, a gateway and two nodes; node a takes 2 sandboxes at most).

    .venv/bin/python -m bench.fork_spill [--runs 8]

Rows, each p50/p95/max over ``--runs`` forks of one child through the gateway (``POST
/sandboxes/{id}/fork``, ``count`` 1) of a sandbox on node a:
- ``local_child``: a has room: the node forks (checkpoint, restore beside the parent);
- ``spilled_child``: a is full: the gateway takes a stored snapshot of the parent, waits for its
  upload to S3, creates the child on b from it (b fetches memory image and layers) and deletes
  the snapshot.
Each child is killed before the next fork (and a's heartbeat awaited). Writes
bench/results/fork_spill.json.
"""

from __future__ import annotations

import argparse
import time

import httpx
from e2b import Sandbox

from bench.harness import stats, write_result
from tests.support.cluster import API_KEY, Cluster, run_cluster
from tests.support.postgres import postgres_cluster
from tests.support.s3 import s3_server

HEADERS = {"X-API-Key": API_KEY}


def _on_a(cluster: Cluster) -> Sandbox:
    """A sandbox on node a (creates alternate between the nodes: the ones on b are killed)."""
    others = []
    for _ in range(4):
        sbx = Sandbox.create(timeout=1800, **cluster.sdk)
        if cluster.owner(sbx.sandbox_id) == "node-a":
            for other in others:
                other.kill()
            return sbx
        others.append(sbx)
    raise AssertionError("no create landed on node-a")


def _wait_slots(cluster: Cluster, slots: int) -> None:
    deadline = time.monotonic() + 30
    while cluster.rows("SELECT slots_free FROM nodes WHERE node_id = 'node-a'")[0][0] != slots:
        assert time.monotonic() < deadline, "node-a's heartbeat did not show the slot"
        time.sleep(0.1)


def _fork_one(cluster: Cluster, parent: Sandbox, expect_on: str) -> tuple[float, str]:
    started = time.perf_counter()
    resp = httpx.post(
        f"{cluster.gateway.url}/sandboxes/{parent.sandbox_id}/fork",
        json={"count": 1, "timeout": 300},
        headers=HEADERS,
        timeout=600,
    )
    elapsed = time.perf_counter() - started
    assert resp.status_code == 201, resp.text
    entry = resp.json()[0]
    assert "sandbox" in entry, entry
    child = entry["sandbox"]["sandboxID"]
    assert cluster.owner(child) == expect_on, (child, cluster.owner(child))
    return elapsed, child


def run(runs: int) -> dict[str, object]:
    node_env = {"node-a": {"FORKYARD_MAX_SANDBOXES": "2"}}
    with (
        postgres_cluster() as pg,
        s3_server() as s3,
        # The default sweep grace: each spill deletes its snapshot, the next one reuses its chunks
        # (with grace 0 a delete's sweep can take a chunk the next upload counted on).
        run_cluster(pg.new_database(), s3, node_env=node_env, gc_grace_seconds="600") as cluster,
    ):
        parent = _on_a(cluster)
        parent.files.write("/home/user/data.bin", "x" * (4 << 20))
        local, spilled = [], []
        for i in range(runs + 1):  # the first of each is a warm-up
            _wait_slots(cluster, 1)
            elapsed, child = _fork_one(cluster, parent, "node-a")
            local += [elapsed] if i else []
            Sandbox.kill(child, **cluster.sdk)
        _wait_slots(cluster, 1)
        _, keeper = _fork_one(cluster, parent, "node-a")  # a is full from here on
        _wait_slots(cluster, 0)
        for i in range(runs + 1):
            elapsed, child = _fork_one(cluster, parent, "node-b")
            spilled += [elapsed] if i else []
            Sandbox.kill(child, **cluster.sdk)
        Sandbox.kill(keeper, **cluster.sdk)
        parent.kill()
    local_stats, spilled_stats = stats(local), stats(spilled)
    return {
        "local_child": local_stats,
        "spilled_child": spilled_stats,
        "spill_extra_p50_ms": round(float(spilled_stats["p50_ms"]) - float(local_stats["p50_ms"]), 1),
        "runs": runs,
        "parent_extra_file_mib": 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fork_spill")
    parser.add_argument("--runs", type=int, default=8)
    args = parser.parse_args()
    print(write_result("fork_spill", run(args.runs)))


if __name__ == "__main__":
    main()
