"""Children as they come up and forks of paused sandboxes (issue 26, parts 1-2), on the loopback
runtime (no root): the orchestrator's ``fork(each=...)`` and paused path, our NDJSON routes, and
the RL client (``forkyard_rl.stream``, ``SandboxGroup``, ``ForkTree``, ``grpo_step``) through the
real ``e2b`` SDK against a real server. The gVisor end-to-end runs are in tests/system/test_rl.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from e2b import AsyncSandbox

from forkyard.errors import Conflict
from forkyard.orchestrator.lifecycle import ForkOutcome
from forkyard.orchestrator.timing import utcnow
from forkyard.types import SandboxState
from forkyard_rl import (
    Connection,
    ForkTree,
    GroupError,
    SandboxGroup,
    StreamError,
    fork_stream,
    from_snapshot,
    grpo_step,
)
from tests.support.loopback import LoopbackRuntime
from tests.unit.test_api import API_KEY, start_node
from tests.unit.test_lifecycle import loopback_node, request

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: The n-th restore of the loopback runtime takes n times this long.
STAGGER = 0.15


# -- the orchestrator ----------------------------------------------------------------------------


async def test_fork_hands_each_child_over_as_it_comes_up_with_its_own_timeout(tmp_path: Path) -> None:
    async with loopback_node(tmp_path, runtime_options=dict(restore_stagger=STAGGER)) as (orch, _):
        parent = await orch.create(request())
        handed: list[tuple[ForkOutcome, float]] = []
        started = time.monotonic()
        outcomes = await orch.fork(
            parent.sandbox_id, 4, 30, each=lambda o: handed.append((o, time.monotonic()))
        )
        assert [o for o, _ in handed] == outcomes and all(o.record for o in outcomes)
        times = [t - started for _, t in handed]
        assert times == sorted(times) and times[-1] - times[0] > 2 * STAGGER, times  # one by one
        for outcome, at in handed:  # each child's timeout counts from when it was handed over
            assert outcome.record is not None
            stored = await orch.get(outcome.record.sandbox_id)
            left = (stored.end_at - utcnow()).total_seconds() + (time.monotonic() - at)
            assert abs(left - 30) < 0.1, left
            await orch.kill(stored.sandbox_id)
        await orch.kill(parent.sandbox_id)


async def test_a_paused_parent_forks_from_its_pause_snapshot_and_stays_paused(tmp_path: Path) -> None:
    async with loopback_node(tmp_path) as (orch, runtime):
        parent = await orch.create(request())
        await orch.pause(parent.sandbox_id)  # the loopback runtime cannot freeze: paused on disk
        paused = await orch.get(parent.sandbox_id)
        assert paused.pause_tier == "disk"
        outcomes = await orch.fork(parent.sandbox_id, 3, 30)
        children = [o.record for o in outcomes if o.record is not None]
        assert len(children) == 3 and all(c.origin == "fork" for c in children)
        after = await orch.get(parent.sandbox_id)
        assert (after.state, after.pause_tier, after.pause_snapshot) == (
            SandboxState.PAUSED,
            "disk",
            paused.pause_snapshot,
        )
        assert {sid for sid, _ in runtime.restores} == {c.sandbox_id for c in children}  # not the parent
        assert await orch.catalog.get(paused.pause_snapshot or "") is not None  # its snapshot is kept
        resumed = await orch.resume(parent.sandbox_id, 60)  # and it resumes from it as before
        assert resumed.state == SandboxState.RUNNING
        for sid in [parent.sandbox_id, *(c.sandbox_id for c in children)]:
            await orch.kill(sid)


async def test_a_frozen_parent_moves_to_disk_for_its_fork_and_stays_paused(tmp_path: Path) -> None:
    async with loopback_node(tmp_path, runtime_options=dict(freezes=True), pause_disk_after_seconds=3600) as (
        orch,
        runtime,
    ):
        parent = await orch.create(request())
        await orch.pause(parent.sandbox_id)
        assert (await orch.get(parent.sandbox_id)).pause_tier == "frozen"
        outcomes = await orch.fork(parent.sandbox_id, 2, 30)
        assert all(o.record is not None for o in outcomes), [o.error for o in outcomes]
        after = await orch.get(parent.sandbox_id)
        assert (after.state, after.pause_tier) == (SandboxState.PAUSED, "disk")
        assert parent.sandbox_id not in {sid for sid, _ in runtime.restores}
        for sid in [parent.sandbox_id, *(o.record.sandbox_id for o in outcomes if o.record)]:
            await orch.kill(sid)


async def test_a_filesystem_paused_parent_has_no_memory_to_fork(tmp_path: Path) -> None:
    async with loopback_node(tmp_path) as (orch, _):
        parent = await orch.create(request())
        await orch.pause(parent.sandbox_id)
        rec = await orch.get(parent.sandbox_id)
        rec.pause_tier = "filesystem"  # the loopback runtime cannot keep a disk: its record says so
        await orch.store.save(rec)
        with pytest.raises(Conflict, match="without its memory"):
            await orch.fork(parent.sandbox_id, 2, 30)
        await orch.kill(parent.sandbox_id)


# -- the routes and the RL client against a real server ------------------------------------------


class Server:
    def __init__(self, url: str, runtime: LoopbackRuntime) -> None:
        self.url = url
        self.runtime = runtime
        self.connection = Connection(api_key=API_KEY, api_url=url, sandbox_url=url)
        self.client = httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30)

    async def sandbox(self) -> AsyncSandbox:
        return await AsyncSandbox.create("base", timeout=120, **self.connection.opts())

    async def state(self, sandbox_id: str) -> str | None:
        resp = await self.client.get(f"/sandboxes/{sandbox_id}")
        return str(resp.json()["state"]) if resp.status_code == 200 else None


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    runtime = LoopbackRuntime(restore_stagger=STAGGER / 3)
    uvicorn_server, task, settings = await start_node(tmp_path_factory.mktemp("stream"), runtime)
    srv = Server(f"http://127.0.0.1:{settings.port}", runtime)
    yield srv
    await srv.client.aclose()
    uvicorn_server.should_exit = True
    await task
    await runtime.close()


async def test_the_streaming_route_answers_a_line_per_child_as_it_comes_up(server: Server) -> None:
    parent = await server.sandbox()
    arrivals: list[tuple[dict[str, object], float]] = []
    async with server.client.stream(
        "POST", f"/sandboxes/{parent.sandbox_id}/fork/stream", json={"count": 4, "timeout": 60}
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-ndjson"
        async for line in resp.aiter_lines():
            if line:
                arrivals.append((json.loads(line), time.monotonic()))
    assert len(arrivals) == 4 and all("sandbox" in item for item, _ in arrivals)
    assert arrivals[-1][1] - arrivals[0][1] > STAGGER / 2  # not all at the end
    for item, _ in arrivals:
        await AsyncSandbox.kill(item["sandbox"]["sandboxID"], **server.connection.opts())  # type: ignore[index]
    await parent.kill()


async def test_streaming_refusals_are_e2b_errors_before_any_line(server: Server) -> None:
    resp = await server.client.post("/sandboxes/inope/fork/stream", json={"count": 2})
    assert resp.status_code == 404 and set(resp.json()) == {"code", "message"}
    resp = await server.client.post("/snapshots/nope/sandboxes", json={"count": 2})
    assert resp.status_code == 404 and "nope" in resp.json()["message"]
    parent = await server.sandbox()
    resp = await server.client.post(f"/sandboxes/{parent.sandbox_id}/fork/stream", json={"count": 0})
    assert resp.status_code == 400
    gone = await server.sandbox()
    await gone.kill()
    with pytest.raises(StreamError) as raised:  # the client does not fall back on a real 404
        async for _ in fork_stream(gone, 1):
            pass
    assert raised.value.code == 404
    await parent.kill()


async def test_a_client_that_goes_away_mid_stream_leaks_no_child(server: Server) -> None:
    parent = await server.sandbox()
    async with server.client.stream(
        "POST", f"/sandboxes/{parent.sandbox_id}/fork/stream", json={"count": 4, "timeout": 60}
    ) as resp:
        async for line in resp.aiter_lines():
            first = json.loads(line)["sandbox"]["sandboxID"]
            break
    for _ in range(300):  # the children it was not sent are killed once they are up
        listed = (await server.client.get("/v2/sandboxes", params={"state": "running"})).json()
        alive = {s["sandboxID"] for s in listed} - {parent.sandbox_id}
        if alive == {first}:
            break
        await asyncio.sleep(0.1)
    assert alive == {first}
    await AsyncSandbox.kill(first, **server.connection.opts())
    await parent.kill()


async def test_rl_fork_stream_yields_the_first_child_before_the_last_is_up(server: Server) -> None:
    parent = await server.sandbox()
    seen: list[float] = []
    children = []
    async for started in fork_stream(parent, 5, lifetime=60):
        assert started.sandbox is not None, started.error
        seen.append(time.monotonic())
        children.append(started.sandbox)
        assert started.template_id  # the fork's checkpoint, as the server reports it
    assert len({c.sandbox_id for c in children}) == 5
    assert seen[-1] - seen[0] > STAGGER / 2, seen
    assert (await children[0].commands.run("true")).exit_code == 0  # a usable SDK sandbox
    # The SDK's own fork answers once, with every child (what an E2B server gives).
    fallback = [s async for s in fork_stream(parent, 2, lifetime=60, use_extension=False)]
    assert all(s.sandbox is not None for s in fallback)
    for c in [*children, *(s.sandbox for s in fallback if s.sandbox)]:
        await c.kill()
    await parent.kill()


async def test_rl_n_from_a_snapshot_in_one_call_and_by_concurrent_creates(server: Server) -> None:
    parent = await server.sandbox()
    snapshot = await parent.create_snapshot()
    for use_extension in (True, False):
        made = [
            s
            async for s in from_snapshot(
                snapshot.snapshot_id,
                3,
                lifetime=60,
                metadata={"run": "7"},
                connection=server.connection,
                use_extension=use_extension,
            )
        ]
        assert all(s.sandbox is not None for s in made), [s.error for s in made]
        for s in made:
            assert s.sandbox is not None
            info = await s.sandbox.get_info()
            assert info.metadata == {"run": "7"} and info.template_id == snapshot.snapshot_id
            await s.sandbox.kill()
    await parent.kill()


async def test_group_work_starts_on_each_member_as_it_comes_up(server: Server) -> None:
    parent = await server.sandbox()
    snapshot = await parent.create_snapshot()
    began: dict[int, float] = {}

    async def rollout(i: int, member: AsyncSandbox) -> str:
        began[i] = time.monotonic()
        return member.sandbox_id

    group = await SandboxGroup.from_snapshot(
        snapshot.snapshot_id, 4, each=rollout, connection=server.connection, lifetime=60
    )
    assert group.each_results == group.sandbox_ids and len(group) == 4
    assert began[3] - began[0] > STAGGER / 2  # member 0's work began before member 3 was up
    tags = {(await m.get_info()).metadata.get("forkyard_rl.group") for m in group.members}
    assert tags == {group.group_id}
    await group.kill()
    forked = await SandboxGroup.fork(parent, 3, each=rollout, lifetime=60)
    assert forked.each_results == forked.sandbox_ids
    await forked.kill()
    await parent.kill()


async def test_a_child_that_fails_ends_the_group_and_kills_the_rest(server: Server) -> None:
    parent = await server.sandbox()
    snapshot = await parent.create_snapshot()
    server.runtime.fail_create = True  # restores create their upstream: all fail after coming up
    try:
        with pytest.raises(GroupError):
            await SandboxGroup.from_snapshot(snapshot.snapshot_id, 2, connection=server.connection)
    finally:
        server.runtime.fail_create = False
    listed = (await server.client.get("/v2/sandboxes", params={"state": "running"})).json()
    assert {s["sandboxID"] for s in listed} == {parent.sandbox_id}
    await parent.kill()


async def test_grpo_step_acts_in_each_child_as_it_comes_up(server: Server) -> None:
    tree = ForkTree(await server.sandbox())
    began: list[float] = []

    async def reward(sandbox: AsyncSandbox, result: object) -> float:
        began.append(time.monotonic())
        return float(len(began))

    outcome = await grpo_step(tree, tree.root, lambda i: f"echo {i}", reward, n=4, lifetime=60)
    assert len(outcome.nodes) == 4 and all(r.ok for r in outcome.results)
    assert sorted(outcome.rewards) == [1.0, 2.0, 3.0, 4.0]
    assert began[-1] - began[0] > STAGGER / 2
    assert all(not n.alive for n in outcome.nodes)  # pruned
    assert all(n.parent_id == tree.root.node_id and n.origin_snapshot_id for n in outcome.nodes)
    await tree.close()
