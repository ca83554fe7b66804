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

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from e2b import NotFoundException, Sandbox

from tests.support.compose import (
    A_MAX_SANDBOXES,
    API_KEY,
    ComposeCluster,
    build_images,
    compose_cluster,
    daemon_down,
    docker,
    docker_missing,
    engine_refused,
    host_footprint,
)
from tests.support.load import TOKEN_FILE, Load, Report, unclean

pytestmark = [
    pytest.mark.requires_root("runs Docker and gVisor sandboxes"),
    # The first test also pays for the image build after a code change (pip, minutes when the
    # machine is busy); a fault test runs a minute of fault under load and checks every snapshot.
    pytest.mark.timeout(1200),
]

#: Sandboxes the ordered tests share: name -> sandbox id.
SHARED: dict[str, str] = {}


@pytest.fixture(scope="module")
def cluster() -> Iterator[ComposeCluster]:
    reason = docker_missing() or engine_refused()
    if reason:
        pytest.skip(reason)
    seconds = build_images()
    print(f"\nimages built (or found cached) in {seconds:.0f} s")
    try:
        with compose_cluster() as running:
            yield running
        assert host_footprint(running.project) == []
    finally:
        assert daemon_down() == [], "Docker's iptables chains stayed after its engine stopped"


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


# -- faults under load ---------------------------------------------------------------------------

#: The figures of each fault (README's fault table), printed at the end of the module.
FAULTS: dict[str, Report] = {}
S3_DOWN_S = 60.0
DISK_FULL_S = 20.0
#: Restores per fault (each a few seconds here): the newest acknowledged snapshots.
RESTORES_PER_FAULT = 3


def test_fault_witnesses_are_made(cluster: ComposeCluster) -> None:
    """A sandbox on each node with a file, checked after every fault (none of them may lose it)."""
    for _ in range(4):
        sbx = Sandbox.create(timeout=3600, **cluster.sdk)
        node = cluster.owner(sbx.sandbox_id)
        if f"witness-{node}" in SHARED:
            sbx.kill()
            continue
        sbx.files.write("/home/user/witness.txt", sbx.sandbox_id)
        SHARED[f"witness-{node}"] = sbx.sandbox_id
    assert {"witness-node-a", "witness-node-b"} <= set(SHARED), SHARED


def test_fault_postgres_restarted(cluster: ComposeCluster) -> None:
    def inject() -> None:
        cluster.compose("restart", "-t", "10", "postgres", timeout=120)

    _under_load(cluster, "PostgreSQL restarted", inject)


def test_fault_s3_unreachable_for_a_minute(cluster: ComposeCluster) -> None:
    network = f"{cluster.project}_default"

    def inject() -> None:
        docker("network", "disconnect", network, cluster.container("s3"))
        threading.Event().wait(S3_DOWN_S)  # the fault's own length, not a wait for something
        docker("network", "connect", "--alias", "s3", network, cluster.container("s3"))

    _under_load(cluster, "S3 unreachable 60 s", inject)


def test_fault_node_killed_and_restarted(cluster: ComposeCluster) -> None:
    def inject() -> None:
        docker("kill", cluster.container("node-a"))
        since = time.time()
        docker("start", cluster.container("node-a"))
        cluster.wait_healthy(("node-a",), since)

    _under_load(cluster, "node killed (SIGKILL) and restarted", inject, lost=("node-a",))


def test_fault_gateway_restarted(cluster: ComposeCluster) -> None:
    def inject() -> None:
        since = time.time()
        cluster.compose("restart", "-t", "10", "gateway", timeout=120)
        cluster.wait_healthy(("gateway",), since)

    # The only gateway: while it restarts no server answers (connections refused, reset, closed).
    _under_load(cluster, "gateway restarted", inject, unanswered=True)


def test_fault_node_disk_full(cluster: ComposeCluster) -> None:
    fill = "/var/lib/forkyard/disk-full-test"

    def inject() -> None:
        docker(
            "exec",
            cluster.container("node-b"),
            "sh",
            "-c",
            # The load writes as the file grows (fallocate of "all that is free" failed with
            # ENOSPC here): write until the disk refuses, then keep what was written.
            f"cat /dev/zero > {fill} 2>/dev/null; test -s {fill}",
        )
        threading.Event().wait(DISK_FULL_S)
        docker("exec", cluster.container("node-b"), "rm", "-f", fill)

    _under_load(cluster, "node disk full 20 s", inject)


def _under_load(
    cluster: ComposeCluster,
    name: str,
    inject: Callable[[], None],
    lost: tuple[str, ...] = (),
    *,
    unanswered: bool = False,
) -> None:
    with Load(cluster.sdk, clients=3) as load:
        load.wait_calls(ok_creates=3)
        started = time.monotonic()
        inject()
        ended = time.monotonic()
        load.wait_calls(ok_creates=3, after=ended, timeout=600)
    report = load.report(started, ended)
    FAULTS[name] = report
    print(f"\nFAULT {name}: fault {ended - started:.1f} s, {report.line()}")
    for kind, message in report.samples.items():
        print(f"  {kind}: {message}")
    for sandbox_id in load.unkilled:
        with contextlib.suppress(Exception):
            Sandbox.kill(sandbox_id, **cluster.sdk)
    assert report.hung == 0, report
    # Failed calls are clean answers to the fault (503/507 in E2B's shape the SDK reports), or a
    # sandbox reported gone with its killed node, or no server there at all: never a 500, a
    # non-JSON answer or a timeout.
    assert unclean(report.failures, gone=bool(lost), unanswered=unanswered) == [], report.samples
    report.lost = _lost_data(cluster, load, lost)
    report.leaks = _leaks(cluster)
    assert report.lost == [], report.lost
    assert report.leaks == [], report.leaks


def _lost_data(cluster: ComposeCluster, load: Load, lost_nodes: tuple[str, ...]) -> list[str]:
    """Witnesses: alive with their file, or (on a killed node) reported gone, never both; every
    acknowledged snapshot becomes durable and restores with its token."""
    problems: list[str] = []
    for key in [k for k in SHARED if k.startswith("witness-")]:
        sandbox_id = SHARED[key]
        try:
            read = Sandbox.connect(sandbox_id, **cluster.sdk).files.read("/home/user/witness.txt")
        except NotFoundException:
            if key.removeprefix("witness-") not in lost_nodes:
                problems.append(f"{key} {sandbox_id} is gone")
            SHARED.pop(key)
            continue
        if read != sandbox_id:
            problems.append(f"{key} {sandbox_id} reads {read!r}")
    # Every acknowledged snapshot becomes durable; the last few (those of the fault) are restored.
    restored = list(load.snapshots)[-RESTORES_PER_FAULT:]
    for snapshot_id, token in load.snapshots.items():
        try:
            _wait_durable(cluster, snapshot_id)
            if snapshot_id in restored:
                child = Sandbox.create(snapshot_id, timeout=120, **cluster.sdk)
                if child.files.read(TOKEN_FILE) != token:
                    problems.append(f"snapshot {snapshot_id} restored without its token")
                child.kill()
            Sandbox.delete_snapshot(snapshot_id, **cluster.sdk)
        except Exception as exc:
            problems.append(f"snapshot {snapshot_id}: {type(exc).__name__}: {exc}"[:300])
    return problems


def _leaks(cluster: ComposeCluster, timeout: float = 60) -> list[str]:
    """Each node runs exactly the sandboxes the registry says it runs (kills are asynchronous:
    wait a little for them)."""
    deadline = time.monotonic() + timeout
    while True:
        problems = []
        for node in ("node-a", "node-b"):
            rows = cluster.sql(
                "SELECT sandbox_id FROM sandboxes"
                f" WHERE node_id = '{node}' AND state IN ('running', 'creating')"
            )
            registry = {r[0] for r in rows}
            running = cluster.sandboxes_in(node)
            problems += [f"{node} runs {s}, the registry does not say so" for s in sorted(running - registry)]
            problems += [
                f"the registry says {node} runs {s}, it does not" for s in sorted(registry - running)
            ]
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(1)


def test_zy_fault_table(cluster: ComposeCluster) -> None:
    """The figures, one line per fault (README's table is made of these)."""
    print("\n| fault | calls | failed | hung | data lost | leaks | recovery s |")
    for name, r in FAULTS.items():
        rec = "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        print(f"| {name} | {r.calls} | {r.failed} | {r.hung} | {len(r.lost)} | {len(r.leaks)} | {rec} |")


def test_zz_down_leaves_nothing_on_the_host(cluster: ComposeCluster) -> None:
    """Last: the cluster taken down here (the fixture's own down then finds nothing to do)."""
    for info in Sandbox.list(**cluster.sdk).next_items():
        Sandbox.kill(info.sandbox_id, **cluster.sdk)
    cluster.compose("down", "-v", "--remove-orphans", "--timeout", "60", timeout=600)
    assert host_footprint(cluster.project) == []
