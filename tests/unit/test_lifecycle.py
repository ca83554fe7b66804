"""The lifecycle owner's state machine and undo list, with the loopback runtime (no root)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from forkyard.config import Settings
from forkyard.errors import Conflict, Failed, InsufficientStorage, Invalid, NotFound
from forkyard.orchestrator.envd_client import WARM_UP_COMMAND
from forkyard.orchestrator.lifecycle import (
    EDGES,
    STARTS_FROM,
    TIER_EDGES,
    CreateRequest,
    Orchestrator,
    build_orchestrator,
)
from forkyard.orchestrator.store import NetworkPolicy, SandboxRecord
from forkyard.orchestrator.timing import utcnow
from forkyard.orchestrator.undo import Undo
from forkyard.types import ENVD_INIT_REVALIDATE, SandboxState, VolumeMount
from tests.support.loopback import LoopbackRuntime, write_template

#: Every test on both registry backends (the default SQLite file, and PostgreSQL).
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.usefixtures("registry_backend")]

TRANSIENT = {SandboxState.CREATING, SandboxState.PAUSING, SandboxState.RESUMING, SandboxState.KILLING}


async def test_every_state_has_edges_and_every_live_state_can_end_killed() -> None:
    assert set(EDGES) == set(SandboxState)
    for state in SandboxState:
        seen, frontier = {state}, [state]
        while frontier:
            for nxt in EDGES[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert SandboxState.KILLED in seen, f"{state} can never end killed"


async def test_operations_start_only_from_states_seen_under_the_lock() -> None:
    for op, states in STARTS_FROM.items():
        assert states and not states & TRANSIENT, op
        assert SandboxState.KILLED not in states, op


async def test_undo_runs_newest_first_and_past_a_failing_step() -> None:
    done: list[str] = []

    async def step(name: str) -> None:
        done.append(name)
        if name == "b":
            raise OSError("b cannot be undone")

    undo = Undo("test")
    for name in "abc":
        undo.push(name, lambda n=name: step(n))
    await undo.rollback()
    assert done == ["c", "b", "a"]
    await undo.rollback()  # nothing twice
    assert done == ["c", "b", "a"]


async def test_a_committed_undo_undoes_nothing() -> None:
    done: list[str] = []

    async def record() -> None:
        done.append("x")

    undo = Undo("test")
    undo.push("x", record)
    undo.commit()
    await undo.rollback()
    assert done == []


@contextlib.asynccontextmanager
async def loopback_node(
    tmp_path: Path, runtime_options: dict[str, bool] | None = None, **settings: Any
) -> AsyncIterator[tuple[Orchestrator, LoopbackRuntime]]:
    """A started orchestrator on the loopback runtime in ``tmp_path`` (no template snapshots, no
    warm pool unless ``settings`` say so), closed afterwards."""
    write_template(tmp_path / "templates")
    options: dict[str, Any] = {"template_snapshots": False, "warm_pool_high": 0, **settings}
    config = Settings(data_dir=tmp_path / "data", templates_path=tmp_path / "templates", **options)
    runtime = LoopbackRuntime(config, **(runtime_options or {}))
    orch = build_orchestrator(config, runtime)
    await orch.start()
    try:
        yield orch, runtime
    finally:
        await orch.close()
        await runtime.close()


@pytest_asyncio.fixture(loop_scope="session")
async def orchestrator(tmp_path: Path) -> AsyncIterator[tuple[Orchestrator, LoopbackRuntime]]:
    async with loopback_node(tmp_path) as node:
        yield node


def request(template_id: str = "base") -> CreateRequest:
    return CreateRequest(
        template_id=template_id,
        timeout_seconds=60,
        metadata={"k": "v"},
        envs={},
        secure=False,
        network=NetworkPolicy(allow_internet_access=True),
    )


async def test_create_kill_and_the_states_recorded(
    orchestrator: tuple[Orchestrator, LoopbackRuntime],
) -> None:
    orch, runtime = orchestrator
    rec = await orch.create(request())
    assert rec.state == SandboxState.RUNNING and rec.origin == "boot"
    assert orch.route(rec.sandbox_id) is not None
    stored = await orch.store.get(rec.sandbox_id)
    assert stored is not None and stored.state == SandboxState.RUNNING
    await orch.kill(rec.sandbox_id)
    stored = await orch.store.get(rec.sandbox_id)
    assert stored is not None and stored.state == SandboxState.KILLED
    assert orch.route(rec.sandbox_id) is None and rec.sandbox_id in runtime.killed
    with pytest.raises(NotFound):
        await orch.kill(rec.sandbox_id)


async def test_a_create_under_the_disk_reserve_is_507_before_anything_is_made(tmp_path: Path) -> None:
    # More than any disk holds: the data dir is always under it.
    async with loopback_node(tmp_path, disk_reserve_mb=1 << 40) as (orch, runtime):
        with pytest.raises(InsufficientStorage, match=r"disk is full.*FORKYARD_DISK_RESERVE_MB"):
            await orch.create(request())
        assert runtime.servers == {} and await orch.store.in_states(set(SandboxState)) == []
    async with loopback_node(tmp_path / "room", disk_reserve_mb=1) as (orch, _):
        rec = await orch.create(request())  # the positive control: the same create with room
        await orch.kill(rec.sandbox_id)


async def test_operations_from_the_wrong_state_conflict(
    orchestrator: tuple[Orchestrator, LoopbackRuntime],
) -> None:
    orch, _ = orchestrator
    rec = await orch.create(request())
    with pytest.raises(Conflict, match="already running"):
        await orch.resume(rec.sandbox_id, 60)
    await orch.kill(rec.sandbox_id)


async def test_an_illegal_edge_is_refused(orchestrator: tuple[Orchestrator, LoopbackRuntime]) -> None:
    orch, _ = orchestrator
    rec = await orch.create(request())
    with pytest.raises(Failed, match="no transition from running to paused"):
        await orch._enter(rec, SandboxState.PAUSED)  # a pause passes through "pausing"
    assert (await orch.get(rec.sandbox_id)).state == SandboxState.RUNNING
    await orch.kill(rec.sandbox_id)


async def test_every_pause_tier_is_entered_from_none_and_left_to_none() -> None:
    tiers = [t for t in TIER_EDGES if t is not None]
    assert set(TIER_EDGES[None]) | {"moving"} == set(tiers)
    for tier in tiers:  # each tier ends in a resume (to None), through "disk" or directly
        assert None in TIER_EDGES[tier] or (None in TIER_EDGES["disk"] and "disk" in TIER_EDGES[tier])


async def test_an_illegal_pause_tier_change_is_refused(
    orchestrator: tuple[Orchestrator, LoopbackRuntime],
) -> None:
    """Tier changes go through the same gate as states: a sandbox on disk cannot start a move to
    disk, and a tier needs the paused state."""
    orch, _ = orchestrator
    rec = await orch.create(request())
    with pytest.raises(Failed, match="a pause tier \\(frozen\\) outside paused"):
        await orch._enter(rec, SandboxState.RUNNING, tier="frozen")
    await orch.pause(rec.sandbox_id)  # this runtime cannot freeze: straight to disk
    rec = await orch.get(rec.sandbox_id)
    assert rec.pause_tier == "disk"
    with pytest.raises(Failed, match="no pause tier change from disk to moving"):
        await orch._enter(rec, SandboxState.PAUSED, tier="moving")
    stored = await orch.store.get(rec.sandbox_id)
    assert stored is not None and stored.pause_tier == "disk"
    await orch.kill(rec.sandbox_id)


async def test_a_failed_create_is_undone(tmp_path: Path) -> None:
    async with loopback_node(tmp_path, runtime_options=dict(fail_create=True)) as (orch, runtime):
        with pytest.raises(Failed, match="sandbox creation failed: injected create failure"):
            await orch.create(request())
        assert not runtime.servers  # the half-made instance was killed
        [rec] = await orch.store.in_states((SandboxState.KILLED,))
        messages = [ln.message for ln in await orch.store.logs(rec.sandbox_id, start=None, limit=10)]
        assert any("sandbox creation failed" in m for m in messages)


async def test_an_unknown_template_is_not_found(orchestrator: tuple[Orchestrator, LoopbackRuntime]) -> None:
    orch, _ = orchestrator
    with pytest.raises(NotFound, match="template 'nope' not found"):
        await orch.create(request("nope"))


async def test_volume_mounts_on_a_runtime_without_volumes_are_a_clear_400(
    orchestrator: tuple[Orchestrator, LoopbackRuntime],
) -> None:
    """What the QEMU and Firecracker runtimes answer too (they do not have ``Capability.VOLUMES``)."""
    orch, runtime = orchestrator
    mount = VolumeMount(name="v", volume_id="1", source=str(orch.settings.data_dir), path="/mnt/v")
    req = dataclasses.replace(request(), volumes=(mount,))
    with pytest.raises(Invalid, match="volumeMounts are not supported by the loopback runtime"):
        await orch.create(req)
    assert runtime.servers == {}  # nothing was started


async def test_pause_resume_keep_the_id_and_move_through_the_states(
    orchestrator: tuple[Orchestrator, LoopbackRuntime],
) -> None:
    orch, runtime = orchestrator
    rec = await orch.create(request())
    await orch.pause(rec.sandbox_id)
    paused = await orch.get(rec.sandbox_id)
    assert paused.state == SandboxState.PAUSED and paused.pause_snapshot is not None
    assert orch.route(rec.sandbox_id) is None
    with pytest.raises(Conflict, match="already paused"):
        await orch.pause(rec.sandbox_id)
    resumed, was_paused = await orch.connect(rec.sandbox_id, 60)
    assert was_paused and resumed.state == SandboxState.RUNNING and resumed.pause_snapshot is None
    assert await orch.catalog.get(paused.pause_snapshot) is None  # a resumed pause snapshot is gone
    assert runtime.restores[-1][0] == rec.sandbox_id
    await orch.kill(rec.sandbox_id)


async def test_each_snapshot_names_the_previous_one_as_its_parent(
    orchestrator: tuple[Orchestrator, LoopbackRuntime],
) -> None:
    """The Diff-snapshot path needs ``SnapshotRef.parent``: the snapshot the sandbox's memory was
    last written to or restored from, while it still exists."""
    orch, runtime = orchestrator
    rec = await orch.create(request())
    first = await orch.create_snapshot(rec.sandbox_id, "first")
    second = await orch.create_snapshot(rec.sandbox_id, None)
    await orch.pause(rec.sandbox_id)
    parents = [
        dest.parent.snapshot_id if dest.parent else None
        for sid, dest, _ in runtime.snapshots
        if sid == rec.sandbox_id
    ]
    assert parents == [None, first.snapshot_id, second.snapshot_id]
    assert second.parent_id == first.snapshot_id
    await orch.resume(rec.sandbox_id, 60)
    await orch.delete_snapshot(second.snapshot_id)
    await orch.create_snapshot(rec.sandbox_id, None)  # its base (the pause snapshot) is gone: full
    assert runtime.snapshots[-1][1].parent is None
    child = await orch.create(request(first.snapshot_id))
    assert child.restored_from == first.snapshot_id and child.origin == "snapshot"
    await orch.create_snapshot(child.sandbox_id, None)  # incremental to what it was restored from
    last = runtime.snapshots[-1][1].parent
    assert last is not None and last.snapshot_id == first.snapshot_id
    for sid in (rec.sandbox_id, child.sandbox_id):
        await orch.kill(sid)


async def test_fork_children_are_independent_and_their_timeout_starts_when_handed_back(
    orchestrator: tuple[Orchestrator, LoopbackRuntime],
) -> None:
    orch, _ = orchestrator
    parent = await orch.create(request())
    outcomes = await orch.fork(parent.sandbox_id, 3, 30)
    children = [o.record for o in outcomes]
    assert all(c is not None and c.origin == "fork" for c in children), [o.error for o in outcomes]
    ids = {c.sandbox_id for c in children if c}
    assert len(ids) == 3 and parent.sandbox_id not in ids
    returned = utcnow()
    for child in children:
        assert child is not None
        stored = await orch.get(child.sandbox_id)
        assert stored.state == SandboxState.RUNNING and stored.metadata == {"k": "v"}
        # counted from the end of the call, not from each child's own restore
        assert abs((stored.end_at - returned).total_seconds() - 30) < 2
    assert (await orch.get(parent.sandbox_id)).state == SandboxState.RUNNING
    assert orch.route(parent.sandbox_id) is not None
    assert await orch.catalog.rows("fork") == []  # the fork's one checkpoint is gone
    for sid in ids | {parent.sandbox_id}:
        await orch.kill(sid)


async def test_tiered_pause_freezes_moves_to_disk_and_resumes_from_either(tmp_path: Path) -> None:
    async with loopback_node(tmp_path, runtime_options=dict(freezes=True), pause_disk_after_seconds=3600) as (
        orch,
        runtime,
    ):
        rec = await orch.create(request())
        await orch.pause(rec.sandbox_id)
        frozen = await orch.get(rec.sandbox_id)
        assert (frozen.state, frozen.pause_tier, frozen.pause_snapshot) == (
            SandboxState.PAUSED,
            "frozen",
            None,
        )
        assert rec.sandbox_id in runtime.frozen and not runtime.snapshots
        resumed, was_paused = await orch.connect(rec.sandbox_id, 60)
        assert was_paused and resumed.pause_tier is None and rec.sandbox_id not in runtime.frozen
        assert not runtime.restores  # thawed in place, not restored
        # envd ran on, watched, until the freeze: the thaw's /init needs no revalidation.
        assert runtime.seen[rec.sandbox_id].inits[-1][ENVD_INIT_REVALIDATE] is False

        await orch.pause(rec.sandbox_id)
        orch.reaper.tier_policy.apply([])  # nothing frozen long enough, memory plentiful: nothing moves
        await orch._move_to_disk(rec.sandbox_id, "test")
        on_disk = await orch.get(rec.sandbox_id)
        assert (on_disk.state, on_disk.pause_tier) == (SandboxState.PAUSED, "disk")
        assert on_disk.pause_snapshot is not None and runtime.snapshots[-1][2] is True  # stop=True
        resumed, _ = await orch.connect(rec.sandbox_id, 60)
        assert resumed.state == SandboxState.RUNNING and runtime.restores[-1][0] == rec.sandbox_id
        assert ENVD_INIT_REVALIDATE not in runtime.seen[rec.sandbox_id].inits[-1]  # a restore: revalidate

        metrics = (await orch.node_metrics()).decode()
        assert 'forkyard_lifecycle_seconds_count{detail="frozen",operation="pause"} 2.0' in metrics
        assert 'forkyard_lifecycle_seconds_count{detail="disk",operation="resume"} 1.0' in metrics
        assert 'forkyard_sandboxes{runtime="loopback",state="running",tier=""} 1.0' in metrics
        assert "forkyard_node_cpus " in metrics and 'forkyard_node_memory_bytes{kind="available"}' in metrics
        assert 'forkyard_node_allotted{resource="vcpus"}' in metrics
        await orch.kill(rec.sandbox_id)


async def test_frozen_sandboxes_past_the_idle_period_move_to_disk(tmp_path: Path) -> None:
    async with loopback_node(tmp_path, runtime_options=dict(freezes=True), pause_disk_after_seconds=0.5) as (
        orch,
        _,
    ):
        rec = await orch.create(request())
        await orch.pause(rec.sandbox_id)
        for _ in range(600):  # the reaper's policy runs every half second (30 s: a loaded machine)
            if (await orch.get(rec.sandbox_id)).pause_tier == "disk":
                break
            await asyncio.sleep(0.05)
        assert (await orch.get(rec.sandbox_id)).pause_tier == "disk"
        await orch.kill(rec.sandbox_id)
        await orch.background.drain(5)  # a kill releases what the sandbox held after it returns
        assert await orch.catalog.rows("pause") == []  # a killed sandbox's pause snapshot goes too


async def test_a_snapshot_restored_twice_gets_standbys_that_creates_claim(tmp_path: Path) -> None:
    async with loopback_node(tmp_path, snapshot_standbys=2) as (orch, runtime):
        source = await orch.create(request())
        snap = await orch.create_snapshot(source.sandbox_id, "task-start")
        first = await orch.create(request(snap.snapshot_id))
        second = await orch.create(request(snap.snapshot_id))
        assert (first.origin, second.origin) == ("snapshot", "snapshot")
        for _ in range(3000):  # up to 30 s: standbys come up in the background (slow under load)
            if orch.standbys.pool.ready(snap.snapshot_id) == 2:
                break
            await asyncio.sleep(0.01)
        assert orch.standbys.pool.ready(snap.snapshot_id) == 2
        third = await orch.create(
            CreateRequest(
                template_id=snap.snapshot_id,
                timeout_seconds=60,
                metadata={},
                envs={"MINE": "1"},
                secure=False,
                network=NetworkPolicy(allow_internet_access=True),
            )
        )
        assert third.origin == "standby" and third.restored_from == snap.snapshot_id
        assert third.envs == {"MINE": "1"} and orch.route(third.sandbox_id) is not None
        # The standby had its restore's /init (revalidating) when it was made; the claim's only
        # hands it over.
        made, claimed = runtime.seen[third.sandbox_id].inits
        assert ENVD_INIT_REVALIDATE not in made and made["envVars"] == {}
        assert claimed[ENVD_INIT_REVALIDATE] is False and claimed["envVars"] == {"MINE": "1"}
        assert ENVD_INIT_REVALIDATE not in runtime.seen[first.sandbox_id].inits[-1]
        # ... and ran one warm-up command (it prints an empty line), as envd's default user, before the claim.
        (warm_up,) = runtime.seen[third.sandbox_id].starts
        assert [warm_up["process"]["cmd"], *warm_up["process"]["args"]] == WARM_UP_COMMAND
        assert warm_up["authorization"] is None
        assert not runtime.seen[first.sandbox_id].starts  # a restore on demand runs nothing
        await orch.delete_snapshot(snap.snapshot_id)
        assert orch.standbys.pool.ready(snap.snapshot_id) == 0  # its standbys went with it
        for rec in (source, first, second, third):
            await orch.kill(rec.sandbox_id)
    assert not runtime.servers  # nothing left running, standbys included


async def test_standbys_grow_to_the_largest_group_created_at_once(tmp_path: Path) -> None:
    """A trainer creating a group from one snapshot each step gets a standby for every member
    from the next group on (up to ``snapshot_standbys_max``), and no more while memory is short."""
    async with loopback_node(tmp_path, snapshot_standbys=2, snapshot_standbys_max=4) as (orch, runtime):
        source = await orch.create(request())
        snap = await orch.create_snapshot(source.sandbox_id, "task-start")
        sid = snap.snapshot_id

        async def group(size: int) -> list[SandboxRecord]:
            return list(await asyncio.gather(*(orch.create(request(sid)) for _ in range(size))))

        async def ready(count: int) -> None:
            for _ in range(300):
                if orch.standbys.pool.ready(sid) >= count:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{orch.standbys.pool.ready(sid)} standbys ready, wanted {count}")

        first = await group(6)  # restores (the snapshot is new), then standbys as they come
        assert [r.origin for r in first].count("snapshot") >= 2
        assert orch.standbys.wanted(sid) == 4  # a group of 6, at most 4
        await ready(4)
        second = await group(4)
        assert [r.origin for r in second] == ["standby"] * 4
        await ready(4)  # the claims emptied the pool: it refills to the group's size
        orch.standbys._memory_short = lambda: True  # type: ignore[method-assign]
        assert orch.standbys.wanted(sid) == 2  # only the base count while memory is short
        for rec in (source, *first, *second):
            await orch.kill(rec.sandbox_id)
    assert not runtime.servers


async def test_creates_far_apart_keep_the_base_count_of_standbys(tmp_path: Path) -> None:
    async with loopback_node(tmp_path, snapshot_standbys=2, snapshot_standbys_max=8) as (orch, _):
        source = await orch.create(request())
        snap = await orch.create_snapshot(source.sandbox_id, "task-start")
        made = []
        for _ in range(4):
            made.append(await orch.create(request(snap.snapshot_id)))
            await asyncio.sleep(0.3)  # more than GROUP_GAP_SECONDS apart: groups of one
        assert orch.standbys.wanted(snap.snapshot_id) == 2
        for rec in (source, *made):
            await orch.kill(rec.sandbox_id)
