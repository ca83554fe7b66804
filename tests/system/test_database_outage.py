"""The registry's PostgreSQL restarted under load (issue 28): a gateway and a node as real
processes on a PostgreSQL of their own, three SDK clients looping create -> write -> command ->
kill through the gateway while PostgreSQL is stopped (``pg_ctl stop -m fast``, as an operator's
restart: every session is terminated) and started again.

Asserted: every call that failed was answered 503 in E2B's shape (the SDK's
``ServiceBusyException``), none hung (each has the SDK's request timeout), the load flows again
after the restart, and nothing leaked: once the load has stopped and what it could not kill is
killed, no registry row is left in a live state and no sandbox process runs for any row (a create
or kill that the outage cut half-way is reconciled by the node's deferred record writes).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from tests.support import base_template_missing
from tests.support.cluster import Cluster, run_cluster
from tests.support.leaks import sandbox_processes
from tests.support.load import Call, Load
from tests.support.postgres import PostgresCluster, missing, postgres_cluster

pytestmark = pytest.mark.requires_root("runs gVisor sandboxes")

#: No snapshots in this load (their cost is not what the fault is about).
NO_SNAPSHOTS = 10**9
SETTLE_S = 30.0


@pytest.fixture(scope="module")
def registry() -> Iterator[PostgresCluster]:
    reason = missing() or base_template_missing()
    if reason:
        pytest.skip(reason)
    with postgres_cluster() as pg:  # its own: this module stops and starts it
        yield pg


@pytest.fixture(scope="module")
def cluster(registry: PostgresCluster) -> Iterator[Cluster]:
    with run_cluster(registry.new_database(), None, node_names=("node-a",)) as running:
        yield running


def _answered_503(call: Call) -> bool:
    """The call failed with E2B's 503 and our message, or it is a command that found no file
    because the write before it was refused so (that write is counted on its own)."""
    if "database is unreachable" in call.error:
        return call.error.startswith(("ServiceBusyException", "SandboxException: 503:"))
    return call.op == "command" and "No such file or directory" in call.error


def test_a_registry_restart_under_load_fails_calls_with_503_only_and_leaks_nothing(
    registry: PostgresCluster, cluster: Cluster
) -> None:
    with Load(cluster.sdk, clients=3, snapshot_every=NO_SNAPSHOTS) as load:
        load.wait_calls(2)
        fault_started = time.monotonic()
        registry.stop()
        try:
            load.wait_failed(after=fault_started)
        finally:
            registry.start()
        fault_ended = time.monotonic()
        load.wait_calls(3, after=fault_ended, timeout=120)
    report = load.report(fault_started, fault_ended)
    print(f"\nFAULT registry restarted ({fault_ended - fault_started:.1f} s down): {report.line()}")
    assert report.hung == 0, report.line()
    not_503 = [c.error for c in load.calls if not c.ok and not _answered_503(c)]
    assert not_503 == [], report.samples
    assert report.recovery_s is not None

    for sandbox_id in load.unkilled:  # kills the outage refused: the client tries again
        Sandbox.kill(sandbox_id, **cluster.sdk)
    live, running = _settled(cluster)
    assert (live, running) == ([], []), _log_of(cluster, [line.split()[0] for line in live])


def _log_of(cluster: Cluster, sandbox_ids: list[str]) -> str:
    """The node's log lines about ``sandbox_ids`` (what happened to a leaked one)."""
    lines = cluster.nodes["node-a"].log_path.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if any(sid in line for sid in sandbox_ids))[-8000:]


def _settled(cluster: Cluster) -> tuple[list[str], list[str]]:
    """(rows left in a live state, sandbox processes of any row) once both are gone, else when
    ``SETTLE_S`` ran out: a deferred record is written within a second of the registry's return,
    a killed sandbox's processes are gone when its kill returns."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        rows = cluster.rows("SELECT sandbox_id, state FROM sandboxes")
        live = [f"{sid} {state}" for sid, state in rows if state != "killed"]
        running = [p for sid, _ in rows for p in sandbox_processes(sid)]
        if (not live and not running) or time.monotonic() > deadline:
            return live, running
        time.sleep(0.5)
