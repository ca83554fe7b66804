"""Each runtime's record of a sandbox is a dataclass of its own, persisted as opaque JSON in the
sandbox's row; the facts the layers above need (template root, network link) are typed fields
of the instance. Rows written before (everything inside ``state``, string keys) read back whole:
recovery after an upgrade kills and re-attaches the sandboxes they name."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import sqlite3
from pathlib import Path

import pytest

from forkyard.orchestrator.store import SandboxRecord, SandboxStore
from forkyard.runtime.firecracker.runtime import FirecrackerState
from forkyard.runtime.gvisor.state import GvisorState
from forkyard.runtime.microvm.state import MicroVMState
from forkyard.runtime.qemu.runtime import QemuState
from forkyard.types import SandboxInstance, SandboxNetwork, SandboxState

FORKYARD = Path(__file__).resolve().parents[2] / "forkyard"

NET = SandboxNetwork("s1", "ae-s1", 3, "aeh3", "aes3", "10.213.0.13", "10.213.0.14")

#: What the gVisor runtime wrote into an instance before its state was typed.
OLD_GVISOR = {
    "sandbox_id": "s1",
    "runtime": "gvisor",
    "envd_url": "http://10.213.0.14:49983",
    "address": "10.213.0.14",
    "state": {
        "container_id": "ae-s1",
        "network": NET.to_state(),
        "envd_bundle": "/var/lib/forkyard/envd-runtime/abc",
        "template_id": "base",
        "template_rootfs": "/t/base/rootfs",
        "vcpus": 2,
        "memory_mb": 1024,
        "disk_mb": 2048,
        "platform": "systrap",
        "sudo_shim": True,
    },
}

#: ... and the Firecracker runtime (its marker had the same keys).
OLD_FIRECRACKER = {
    "sandbox_id": "s1",
    "runtime": "firecracker",
    "envd_url": "http://10.213.0.14:49983",
    "address": "10.213.0.14",
    "state": {
        "paths": "/d/sandboxes/s1",
        "upper": "/d/layers/sandboxes/s1/upper.ext4",
        "images": {"base": "/d/images/base.ext4"},
        "vcpus": 1,
        "memory_mb": 512,
        "template_rootfs": "/t/base/rootfs",
        "network": NET.to_state(),
        "pvm": True,
        "dirty_since": "snap1",
        "pid": 4242,
        "uffd_pid": 4243,
    },
}


def test_an_old_gvisor_row_reads_back_typed() -> None:
    instance = SandboxInstance.from_json(OLD_GVISOR)
    assert instance.template_rootfs == "/t/base/rootfs"
    assert instance.network == NET
    assert GvisorState.of(instance) == GvisorState(
        container_id="ae-s1",
        envd_bundle="/var/lib/forkyard/envd-runtime/abc",
        template_id="base",
        vcpus=2,
        memory_mb=1024,
        disk_mb=2048,
        platform="systrap",
        sudo_shim=True,
    )


def test_an_old_microvm_row_reads_back_typed() -> None:
    instance = SandboxInstance.from_json(OLD_FIRECRACKER)
    assert (instance.template_rootfs, instance.network) == ("/t/base/rootfs", NET)
    state = FirecrackerState.of(instance)
    assert (state.pid, state.uffd_pid, state.pvm, state.dirty_since) == (4242, 4243, True, "snap1")
    assert (state.vcpus, state.memory_mb, state.network) == (1, 512, NET)
    # A QEMU row from before RAM files recorded no memory mode: it streamed.
    assert QemuState.from_json({**OLD_FIRECRACKER["state"], "pid": 7}).memory == "stream"


def test_a_gvisor_instance_round_trips() -> None:
    state = GvisorState(container_id="ae-s2", envd_bundle="/b", template_id="t", platform="ptrace")
    instance = SandboxInstance(
        "s2", "gvisor", "http://a:1", "a", state.to_json(), template_rootfs="/t/r", network=NET
    )
    again = SandboxInstance.from_json(json.loads(json.dumps(instance.to_json())))
    assert again == instance and GvisorState.of(again) == state
    # The shared facts are the instance's, not the runtime's record.
    assert "network" not in again.state and "template_rootfs" not in again.state


def test_a_microvm_state_round_trips_with_its_network_and_without() -> None:
    for state in (
        QemuState(paths="/p", upper="/u", images={"k": "v"}, vcpus=2, memory_mb=256, pid=9, memory="file"),
        QemuState(network=NET, vm_owner="/spare"),
        FirecrackerState.paused_with(NET),
        FirecrackerState(),
    ):
        assert type(state).from_json(json.loads(json.dumps(state.to_json()))) == state


def test_a_placeholder_has_no_shared_facts() -> None:
    bare = SandboxInstance.placeholder("s", "qemu")
    assert bare.template_rootfs is None and bare.network is None
    assert SandboxInstance.from_json(bare.to_json()) == bare
    assert MicroVMState.of(bare) == MicroVMState() and GvisorState.of(bare) == GvisorState()


@pytest.mark.asyncio(loop_scope="session")
async def test_the_store_reads_back_old_and_new_instances(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    typed = SandboxInstance.from_json(OLD_GVISOR)
    rec = SandboxRecord(
        sandbox_id="s1",
        template_id="base",
        client_id="c1",
        state=SandboxState.RUNNING,
        started_at=now,
        end_at=now + dt.timedelta(seconds=300),
        cpu_count=1,
        memory_mb=512,
        disk_mb=1024,
        runtime="gvisor",
        envd_version="0.1.0",
        instance=typed,
    )
    store = SandboxStore(tmp_path / "registry.sqlite3")
    await store.open()
    try:
        await store.insert(rec)
        await store.insert(dataclasses.replace(rec, sandbox_id="s0", instance=None))
        new = await store.get("s1")
        with sqlite3.connect(tmp_path / "registry.sqlite3") as db:  # as a node before the upgrade
            db.execute("UPDATE sandboxes SET instance = ? WHERE sandbox_id = 's0'", (json.dumps(OLD_GVISOR),))
        old = await store.get("s0")
    finally:
        await store.close()
    assert new is not None and new.instance == typed
    assert old is not None and old.instance == typed


def test_nothing_but_a_runtime_reads_a_runtime_record() -> None:
    """``SandboxInstance.state`` is read only through a runtime's own state class (one place,
    ``RuntimeState.of``); no string keys of it anywhere, in the runtimes either."""
    readers = [
        f"{path.relative_to(FORKYARD)}:{n}"
        for path in sorted(FORKYARD.rglob("*.py"))
        if path != FORKYARD / "runtime" / "state.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"instance\.state\b|\bstate(\[\"|\.get\(\")(?!sandbox\")", line)
    ]
    assert readers == []
