"""The Docker image and the Compose cluster (deploy/compose) run for real on Debian's Docker engine
(README "Cluster"): the image built on a Debian base made here, the cluster up with
docker-compose (gateway, two nodes, PostgreSQL and moto's S3 server from local images), driven
through the official e2b SDK against the gateway container only; then its parts fail under a
steady load (PostgreSQL restarted, S3 unreachable for a minute, a node killed and restarted, the
gateway restarted, a node's disk full) and the cluster goes down leaving nothing on the host.

One cluster serves the module (``cluster`` fixture); the tests run in order and share it. The
fault tests print one line each (``FAULT <name>: ...``): the figures of README's fault table.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import NotFoundException, Sandbox

from tests.support.compose import (
    A_MAX_SANDBOXES,
    API_KEY,
    ComposeCluster,
    build_images,
    compose_cluster,
    docker,
    docker_missing,
    host_footprint,
)

pytestmark = pytest.mark.requires_root("runs Docker and gVisor sandboxes")

#: Sandboxes the ordered tests share: name -> sandbox id.
SHARED: dict[str, str] = {}
PROJECTS: list[str] = []


@pytest.fixture(scope="module")
def cluster() -> Iterator[ComposeCluster]:
    reason = docker_missing()
    if reason:
        pytest.skip(reason)
    seconds = build_images()
    print(f"\nimages built (or found cached) in {seconds:.0f} s")
    with compose_cluster() as running:
        PROJECTS.append(running.project)
        yield running


def test_the_containers_run_from_the_image_with_the_documented_privileges(cluster: ComposeCluster) -> None:
    image_id = docker("image", "inspect", "-f", "{{.Id}}", "forkyard:latest").stdout.strip()
    for service in ("gateway", "node-a", "node-b"):
        info = json.loads(docker("inspect", cluster.container(service)).stdout)[0]
        assert info["Image"] == image_id, service
        host = info["HostConfig"]
        assert host["Privileged"] is False, f"{service} runs privileged"
        if service == "gateway":
            assert not host["CapAdd"], host["CapAdd"]
        else:
            assert sorted(host["CapAdd"]) == ["NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"], host["CapAdd"]
    assert {r[0]: r[1] for r in cluster.sql("SELECT node_id, state FROM nodes")} == {
        "node-a": "up",
        "node-b": "up",
    }


def test_creates_land_on_both_nodes_and_run_commands_through_the_gateway(cluster: ComposeCluster) -> None:
    first = Sandbox.create(timeout=600, metadata={"suite": "compose"}, **cluster.sdk)
    second = Sandbox.create(timeout=600, metadata={"suite": "compose"}, **cluster.sdk)
    owners = {cluster.owner(first.sandbox_id), cluster.owner(second.sandbox_id)}
    assert owners == {"node-a", "node-b"}, owners
    for sbx in (first, second):
        SHARED[cluster.owner(sbx.sandbox_id)] = sbx.sandbox_id
        result = sbx.commands.run("echo hello from $(uname -s)")
        assert result.exit_code == 0 and result.stdout.strip() == "hello from Linux"
        sbx.files.write("/home/user/note.txt", f"kept by {sbx.sandbox_id}")
        assert sbx.files.read("/home/user/note.txt") == f"kept by {sbx.sandbox_id}"
        assert cluster.sandboxes_in(cluster.owner(sbx.sandbox_id)) >= {sbx.sandbox_id}
    listed = {s.sandbox_id for s in Sandbox.list(**cluster.sdk).next_items()}
    assert set(SHARED.values()) <= listed


def test_a_fork_past_node_a_room_spills_children_onto_b(cluster: ComposeCluster) -> None:
    parent = Sandbox.connect(SHARED["node-a"], **cluster.sdk)
    _wait_slots(cluster, "node-a", A_MAX_SANDBOXES - 1)
    resp = httpx.post(
        f"{cluster.url}/sandboxes/{parent.sandbox_id}/fork",
        json={"count": 2, "timeout": 300},
        headers={"X-API-Key": API_KEY},
        timeout=600,
    )
    assert resp.status_code == 201, resp.text
    children = [e["sandbox"]["sandboxID"] for e in resp.json()]
    assert sorted(cluster.owner(c) for c in children) == ["node-a", "node-b"]
    for child_id in children:
        child = Sandbox.connect(child_id, **cluster.sdk)
        assert child.files.read("/home/user/note.txt") == f"kept by {parent.sandbox_id}"
        child.kill()


def test_a_snapshot_taken_on_a_restores_on_b(cluster: ComposeCluster) -> None:
    on_a = Sandbox.connect(SHARED["node-a"], **cluster.sdk)
    snap = on_a.create_snapshot(name="compose-snap")
    _wait_durable(cluster, snap.snapshot_id)
    # Node a stopped (a clean stop: draining, no new sandboxes), so the restore goes to b.
    cluster.compose("stop", "node-a", timeout=180)
    try:
        child = Sandbox.create("compose-snap", timeout=300, **cluster.sdk)
        assert cluster.owner(child.sandbox_id) == "node-b"
        assert child.files.read("/home/user/note.txt") == f"kept by {on_a.sandbox_id}"
        child.kill()
    finally:
        since = time.time()
        cluster.compose("start", "node-a", timeout=180)
        cluster.wait_healthy(("node-a",), since)
    Sandbox.delete_snapshot(snap.snapshot_id, **cluster.sdk)
    # The stop ended a's sandboxes (processes of its container): reported gone, never running.
    with pytest.raises(NotFoundException):
        Sandbox.connect(on_a.sandbox_id, **cluster.sdk).commands.run("true")
    SHARED.pop("node-a")


def _wait_slots(cluster: ComposeCluster, node_id: str, slots: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    query = f"SELECT slots_free FROM nodes WHERE node_id = '{node_id}'"
    while int(cluster.sql(query)[0][0]) != slots:
        assert time.monotonic() < deadline, cluster.sql(f"SELECT * FROM nodes WHERE node_id = '{node_id}'")
        time.sleep(0.5)


def _wait_durable(cluster: ComposeCluster, snapshot_id: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = httpx.get(cluster.url + "/snapshots", headers={"X-API-Key": API_KEY}, timeout=30).json()
        found = [s for s in listed if s["snapshotID"] == snapshot_id]
        if found and found[0]["storage"]["durable"]:
            return
        assert time.monotonic() < deadline, f"snapshot {snapshot_id} never became durable: {found}"
        time.sleep(0.5)


def test_zz_down_leaves_nothing_on_the_host(cluster: ComposeCluster) -> None:
    """Last: the cluster taken down here (the fixture's own down then finds nothing to do)."""
    for info in Sandbox.list(**cluster.sdk).next_items():
        Sandbox.kill(info.sandbox_id, **cluster.sdk)
    cluster.compose("down", "-v", "--remove-orphans", "--timeout", "60", timeout=600)
    assert host_footprint(cluster.project) == []
