"""Cluster mode end to end (docs/CLUSTER.md): PostgreSQL as the registry, moto's S3 server as the
snapshot store, one gateway and two nodes as real processes on this machine (own data dirs,
subnets and ports), driven through the official e2b SDK against the gateway only.

One cluster serves the module, the tests run in order: creates spread over both nodes, envd
traffic through the gateway, lists across nodes, a node reached directly without a signature
answers 401, a fork of a's sandbox past a's room (``FORKYARD_MAX_SANDBOXES``) spills children onto
b, the operators' CLI through the gateway, a gateway restart and a second gateway lose and split
nothing, then node a is ``kill -9``ed: its sandboxes are reported gone within seconds while b's
runs on, its snapshot is restored on b from S3, and a restarted a destroys what the cluster
reported killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import NotFoundException, Sandbox, SandboxQuery, Volume
from e2b.exceptions import ServiceBusyException, VolumeException

from forkyard.api import nodeauth
from tests.support import base_template_missing, free_port
from tests.support.cluster import API_KEY, LOST_AFTER_S, SECRET, Cluster, gateway_proc, run_cluster
from tests.support.counter import COUNTER_FILE, assert_state_continues, start_state
from tests.support.leaks import wait_no_host_resources
from tests.support.postgres import PostgresCluster
from tests.support.s3 import s3_server

pytestmark = pytest.mark.requires_root("runs gVisor sandboxes")


@pytest.fixture(scope="module")
def cluster(postgres: PostgresCluster) -> Iterator[Cluster]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    # Node a takes 2 sandboxes at most: a fork of its sandbox spills over onto b.
    node_env = {"node-a": {"FORKYARD_MAX_SANDBOXES": str(A_MAX_SANDBOXES)}}
    with s3_server() as s3, run_cluster(postgres.new_database(), s3, node_env=node_env) as running:
        yield running


#: Sandboxes the ordered tests share: name -> sandbox id.
SHARED: dict[str, str] = {}
A_MAX_SANDBOXES = 2
FORKYARD = str(Path(sys.executable).with_name("forkyard"))


def test_a_node_reached_directly_without_a_signature_answers_401(cluster: Cluster) -> None:
    node = cluster.nodes["node-a"]
    for path in ("/sandboxes", "/v2/sandboxes", "/snapshots", "/node"):
        resp = httpx.get(node.url + path, headers={"X-API-Key": API_KEY}, timeout=10)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["code"] == 401 and "gateway" in resp.json()["message"]
    envd = httpx.get(node.url + "/health", headers={"E2B-Sandbox-Id": "x", "E2B-Sandbox-Port": "49983"})
    assert envd.status_code == 401
    rows = cluster.rows("SELECT node_id, state, url FROM nodes ORDER BY node_id")
    assert [(r[0], r[1]) for r in rows] == [("node-a", "up"), ("node-b", "up")], rows
    # The gateway checks API keys itself.
    assert httpx.get(cluster.gateway.url + "/sandboxes", timeout=10).status_code == 401


def test_creates_spread_over_both_nodes_and_envd_works_through_the_gateway(cluster: Cluster) -> None:
    first = Sandbox.create(timeout=300, metadata={"suite": "cluster"}, **cluster.sdk)
    second = Sandbox.create(timeout=300, metadata={"suite": "cluster"}, **cluster.sdk)
    owners = {cluster.owner(first.sandbox_id), cluster.owner(second.sandbox_id)}
    assert owners == {"node-a", "node-b"}, owners
    for sbx in (first, second):
        SHARED[cluster.owner(sbx.sandbox_id)] = sbx.sandbox_id
        result = sbx.commands.run("echo hello from $(hostname)")
        assert result.exit_code == 0 and result.stdout.startswith("hello from")
        sbx.files.write("/home/user/note.txt", f"written through the gateway to {sbx.sandbox_id}")
        assert sbx.files.read("/home/user/note.txt") == f"written through the gateway to {sbx.sandbox_id}"
        streamed: list[str] = []
        handle = sbx.commands.run("for i in 1 2 3; do echo line $i; sleep 0.2; done", background=True)
        handle.wait(on_stdout=streamed.append)
        assert "".join(streamed).split() == ["line", "1", "line", "2", "line", "3"]
        assert sbx.get_info().sandbox_id == sbx.sandbox_id
        # Signed URLs name no sandbox: the gateway finds it by the token that signs them.
        assert cluster.gateway.url in sbx.download_url("/home/user/note.txt")
        downloaded = httpx.get(
            sbx.download_url("/home/user/note.txt", use_signature_expiration=60), timeout=30
        )
        assert downloaded.status_code == 200 and downloaded.text.startswith("written through the gateway")
        upload = sbx.upload_url("/home/user/uploaded.txt")
        assert httpx.post(upload, files={"file": ("u.txt", b"uploaded via a signed URL")}).status_code == 200
        assert sbx.files.read("/home/user/uploaded.txt") == "uploaded via a signed URL"


def test_a_volume_lives_on_one_node_and_its_sandboxes_are_placed_there(cluster: Cluster) -> None:
    api = {"api_key": API_KEY, "api_url": cluster.gateway.url}
    vol = Volume.create("cluster-vol", **api)
    home = cluster.rows("SELECT node_id FROM volumes WHERE volume_id = :v", v=vol.volume_id)[0][0]
    assert home in ("node-a", "node-b")
    # The content API through the gateway, to the node holding the volume (the volume's token).
    vol.write_file("/seed.txt", "from the content API", api_url=cluster.gateway.url)
    assert [v.name for v in Volume.list(**api)].count("cluster-vol") == 1
    # One at a time (node a takes A_MAX_SANDBOXES and holds one already); unpinned, two creates in
    # a row would spread over both nodes (see the test above).
    for i in range(2):
        sbx = Sandbox.create(timeout=120, volume_mounts={"/mnt/v": vol}, **cluster.sdk)
        try:
            assert cluster.owner(sbx.sandbox_id) == home
            sbx.commands.run(f"cat /mnt/v/seed.txt > /mnt/v/copy{i}.txt")
            with pytest.raises(VolumeException, match="409"):
                Volume.destroy(vol.volume_id, **api)
        finally:
            sbx.kill()
    for i in range(2):
        assert vol.read_file(f"/copy{i}.txt", api_url=cluster.gateway.url) == "from the content API"
    assert Volume.destroy(vol.volume_id, **api) is True


def test_list_shows_sandboxes_of_both_nodes(cluster: Cluster) -> None:
    listed = Sandbox.list(**cluster.sdk).next_items()
    assert set(SHARED.values()) <= {s.sandbox_id for s in listed}

    filtered = Sandbox.list(query=SandboxQuery(metadata={"suite": "cluster"}), **cluster.sdk).next_items()
    assert {s.sandbox_id for s in filtered} == set(SHARED.values())
    paged = Sandbox.list(query=SandboxQuery(metadata={"suite": "cluster"}), limit=1, **cluster.sdk)
    pages = [paged.next_items(), paged.next_items()]
    assert sorted(s.sandbox_id for p in pages for s in p) == sorted(SHARED.values())
    assert not paged.has_next


def test_a_fork_past_node_a_room_places_the_other_children_on_b(cluster: Cluster) -> None:
    parent = Sandbox.connect(SHARED["node-a"], **cluster.sdk)
    before = start_state(parent, "the fork's parent")
    _wait_slots(cluster, "node-a", A_MAX_SANDBOXES - 1)  # a's heartbeat: room for one child
    resp = httpx.post(
        f"{cluster.gateway.url}/sandboxes/{parent.sandbox_id}/fork",
        json={"count": 3, "timeout": 120},
        headers={"X-API-Key": API_KEY},
        timeout=300,
    )
    assert resp.status_code == 201, resp.text
    entries = resp.json()
    assert all("sandbox" in e for e in entries), entries
    children = [e["sandbox"]["sandboxID"] for e in entries]
    SHARED["children"] = " ".join(children)
    assert sorted(cluster.owner(c) for c in children) == ["node-a", "node-b", "node-b"]
    for child_id in children:
        child = Sandbox.connect(child_id, **cluster.sdk)
        assert_state_continues(child, before, "the fork's parent")  # files and the running counter
        assert child.get_info().metadata == {"suite": "cluster"}
    assert_state_continues(parent, before, "the fork's parent")
    # a is full now: it refuses a create itself with E2B's 429 (the gateway would place it on b).
    body = json.dumps({"templateID": "base", "timeout": 60}).encode()
    signed = nodeauth.signed_headers([SECRET], "test", "POST", "/sandboxes", nodeauth.body_hash(body))
    full = httpx.post(
        cluster.nodes["node-a"].url + "/sandboxes",
        content=body,
        headers={**signed, "content-type": "application/json"},
        timeout=60,
    )
    assert full.status_code == 429 and "maximum of 2 concurrent sandboxes" in full.json()["message"], (
        full.text
    )
    # The snapshot that carried the parent to b is deleted; b's children do not need it.
    assert cluster.rows("SELECT snapshot_id FROM snapshots WHERE kind = 'snapshot'") == []
    parent.commands.run(f"pkill -f '[c]ounter.new'; rm -f {COUNTER_FILE}")  # later tests start theirs


def test_the_operators_cli_works_against_the_gateway(cluster: Cluster) -> None:
    children = SHARED.pop("children").split()
    on_b = [c for c in children if cluster.owner(c) == "node-b"]
    listed = _cli(cluster, "sandbox", "list", "--json", "-m", "suite=cluster")
    assert {s["sandboxID"] for s in json.loads(listed.stdout)} == {
        *children,
        SHARED["node-a"],
        SHARED["node-b"],
    }
    ran = _cli(cluster, "sandbox", "exec", on_b[0], "--", "cat", "/home/user/state.txt")
    assert ran.stdout == "the fork's parent"
    logs = _cli(cluster, "sandbox", "logs", on_b[0])
    assert logs.stdout.strip(), logs

    snap = Sandbox.connect(SHARED["node-b"], **cluster.sdk).create_snapshot(name="cli-snap")
    snapshots = _cli(cluster, "snapshot", "list", "--json", "--sandbox", SHARED["node-b"])
    assert [s["snapshotID"] for s in json.loads(snapshots.stdout)] == [snap.snapshot_id]
    _cli(cluster, "snapshot", "delete", snap.snapshot_id)

    status = json.loads(_cli(cluster, "node", "status", "--json").stdout)
    nodes = {n["nodeID"]: n for n in status["nodes"]}
    assert set(nodes) == {"node-a", "node-b"} and all(n["state"] == "up" for n in nodes.values())
    assert nodes["node-a"]["sandboxes"]["total"] == 2 and nodes["node-b"]["sandboxes"]["total"] == 3
    assert status["sandboxes"]["total"] == 5 and status["totals"]["nodesUp"] == 2
    table = _cli(cluster, "node", "status").stdout
    assert "node-a" in table and "node-b" in table and "2 of 2 nodes up" in table
    metrics = httpx.get(cluster.gateway.url + "/metrics", headers={"X-API-Key": API_KEY}, timeout=30).text
    assert 'node="node-a"' in metrics and 'node="node-b"' in metrics, metrics[:2000]

    _cli(cluster, "sandbox", "kill", *children)
    for child_id in children:
        with pytest.raises(NotFoundException):
            Sandbox.get_info(child_id, **cluster.sdk)


def _cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "E2B_API_KEY": API_KEY,
        "E2B_API_URL": cluster.gateway.url,
        "E2B_SANDBOX_URL": cluster.gateway.url,
    }
    done = subprocess.run([FORKYARD, *args], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


def _wait_slots(cluster: Cluster, node_id: str, slots: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while cluster.rows("SELECT slots_free FROM nodes WHERE node_id = :n", n=node_id)[0][0] != slots:
        assert time.monotonic() < deadline, cluster.rows("SELECT * FROM nodes WHERE node_id = :n", n=node_id)
        time.sleep(0.2)


def test_a_gateway_restart_and_a_second_gateway_lose_nothing(cluster: Cluster) -> None:
    before = {s.sandbox_id for s in Sandbox.list(**cluster.sdk).next_items()}
    cluster.gateway.stop()
    cluster.gateway.start()  # same port, nothing of its own to recover
    after = {s.sandbox_id for s in Sandbox.list(**cluster.sdk).next_items()}
    assert after == before
    other = gateway_proc(cluster.database_url, free_port(), cluster.data_dirs[0])
    other.start()
    try:
        opts = {"api_key": API_KEY, "api_url": other.url, "sandbox_url": other.url}
        assert {s.sandbox_id for s in Sandbox.list(**opts).next_items()} == before
        for sandbox_id in SHARED.values():
            sbx = Sandbox.connect(sandbox_id, **opts)
            assert sbx.files.read("/home/user/note.txt") == f"written through the gateway to {sandbox_id}"
    finally:
        other.stop()


def test_node_a_lost_its_sandboxes_gone_b_runs_on_and_a_snapshot_restores_on_b(cluster: Cluster) -> None:
    on_a = Sandbox.connect(SHARED["node-a"], **cluster.sdk)
    on_b = Sandbox.connect(SHARED["node-b"], **cluster.sdk)
    before = start_state(on_a, "from node a")
    snap = on_a.create_snapshot(name="cluster-snap")
    _wait_durable(cluster, snap.snapshot_id)

    node_a = cluster.nodes["node-a"]
    node_a.stop(signal.SIGKILL)
    lost_at = time.monotonic()
    while True:  # reported gone within a few seconds of the missed heartbeats
        try:
            Sandbox.get_info(on_a.sandbox_id, **cluster.sdk)
        except NotFoundException:
            break
        except ServiceBusyException:  # until it is marked lost: "the node ... is unreachable"
            pass
        assert time.monotonic() - lost_at < LOST_AFTER_S + 10, "node a's sandbox is still reported"
        time.sleep(0.25)
    assert cluster.rows("SELECT state FROM nodes WHERE node_id = 'node-a'")[0][0] == "lost"
    assert on_a.sandbox_id not in {s.sandbox_id for s in Sandbox.list(**cluster.sdk).next_items()}
    logs = cluster.rows("SELECT message FROM sandbox_logs WHERE sandbox_id = :s", s=on_a.sandbox_id)
    assert any("node lost" in r[0] for r in logs), logs

    # The gateway keeps serving; b's sandbox runs on.
    assert on_b.commands.run("echo still here").stdout.strip() == "still here"
    # a's durable snapshot is restored on b, from S3, with a's files and running process.
    child = Sandbox.create("cluster-snap", timeout=300, **cluster.sdk)
    assert cluster.owner(child.sandbox_id) == "node-b"
    assert_state_continues(child, before, "from node a")
    child.kill()

    # a comes back: the cluster killed its sandbox, so a's start-up destroys it.
    node_a.start()
    assert wait_no_host_resources(on_a.sandbox_id, timeout=30) == []
    assert cluster.rows("SELECT state FROM nodes WHERE node_id = 'node-a'")[0][0] == "up"
    again = Sandbox.create(timeout=120, **cluster.sdk)  # both nodes place again
    assert again.commands.run("true").exit_code == 0
    again.kill()
    on_b.kill()


def _wait_durable(cluster: Cluster, snapshot_id: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    headers = {"X-API-Key": API_KEY}
    while True:
        listed = httpx.get(cluster.gateway.url + "/snapshots", headers=headers, timeout=30).json()
        found = [s for s in listed if s["snapshotID"] == snapshot_id]
        if found and found[0]["storage"]["durable"]:
            return
        assert time.monotonic() < deadline, f"snapshot {snapshot_id} never became durable: {found}"
        time.sleep(0.3)
