"""A sandbox's network policy is one typed value on its record, stored in the columns the untyped
record used (so rows written before it was typed, by a node being upgraded with sandboxes
running, read back whole)."""

from __future__ import annotations

import datetime as dt
import json
import re
import sqlite3
from pathlib import Path

import pytest

from forkyard.orchestrator.store import NetworkPolicy, SandboxRecord, SandboxStore
from forkyard.types import EgressPolicy, SandboxState

pytestmark = pytest.mark.asyncio(loop_scope="session")
FORKYARD = Path(__file__).resolve().parents[2] / "forkyard"


def record(sandbox_id: str, network: NetworkPolicy) -> SandboxRecord:
    now = dt.datetime.now(dt.UTC)
    return SandboxRecord(
        sandbox_id=sandbox_id,
        template_id="base",
        client_id="c1",
        state=SandboxState.RUNNING,
        started_at=now,
        end_at=now + dt.timedelta(seconds=300),
        cpu_count=1,
        memory_mb=512,
        disk_mb=1024,
        runtime="loopback",
        envd_version="0.1.0",
        network=network,
    )


POLICY = NetworkPolicy(
    allow_internet_access=False,
    egress=EgressPolicy(allow_out=("8.8.8.8/32",), deny_out=("0.0.0.0/0",), allow_domains=("example.com",)),
    mask_request_host="app.local:${PORT}",
    dns_servers=("1.1.1.1",),
)


async def test_the_policy_round_trips_in_the_columns_the_untyped_record_used(tmp_path: Path) -> None:
    store = SandboxStore(tmp_path / "registry.sqlite3")
    await store.open()
    try:
        await store.insert(record("typed", POLICY))
        await store.insert(record("plain", NetworkPolicy()))
        typed, plain = await store.get("typed"), await store.get("plain")
    finally:
        await store.close()
    assert typed is not None and typed.network == POLICY
    assert plain is not None and plain.network == NetworkPolicy() and plain.network.internet

    with sqlite3.connect(tmp_path / "registry.sqlite3") as db:
        row = db.execute(
            "SELECT allow_internet_access, network, egress FROM sandboxes WHERE sandbox_id = 'typed'"
        ).fetchone()
    assert row[0] == 0
    assert json.loads(row[1]) == {"maskRequestHost": "app.local:${PORT}", "dnsServers": ["1.1.1.1"]}
    assert json.loads(row[2])["allow_domains"] == ["example.com"]


async def test_a_row_written_by_the_untyped_record_reads_back_whole(tmp_path: Path) -> None:
    store = SandboxStore(tmp_path / "registry.sqlite3")
    await store.open()
    try:
        await store.insert(record("old", NetworkPolicy()))
        # What the code before the typed policy wrote for a create with this network.
        with sqlite3.connect(tmp_path / "registry.sqlite3") as db:
            db.execute(
                "UPDATE sandboxes SET allow_internet_access = 1, network = ?, egress = ?"
                " WHERE sandbox_id = 'old'",
                (
                    json.dumps({"maskRequestHost": "h:1"}),
                    json.dumps(
                        {"allow_out": ["10.1.0.0/16"], "deny_out": [], "allow_domains": [], "resolvers": []}
                    ),
                ),
            )
        old = await store.get("old")
    finally:
        await store.close()
    assert old is not None
    assert old.network == NetworkPolicy(
        allow_internet_access=True, egress=EgressPolicy(allow_out=("10.1.0.0/16",)), mask_request_host="h:1"
    )


async def test_no_layer_above_the_runtimes_reads_an_instance_state_dict() -> None:
    """``SandboxInstance.state`` is the runtime's own: the layers above read the typed facts."""
    repo = FORKYARD
    readers = [
        f"{path.relative_to(repo)}:{n}"
        for layer in ("api", "gateway", "orchestrator", "cli")
        for path in sorted((repo / layer).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"instance\.state\b|\.state\.get\(\"(template_rootfs|network)\"", line)
    ]
    assert readers == []
