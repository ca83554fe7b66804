"""forkyard_rl (the RL client) against a real ``forkyard serve`` with the gVisor runtime, through
the official ``e2b`` SDK: groups, fork trees, rollback in place, the environment loop, and the
clean-up of a crashed client's sandboxes by their server-side timeout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from e2b import AsyncSandbox, Sandbox

from forkyard_rl import (
    Code,
    ForkTree,
    RollbackError,
    SandboxEnv,
    SandboxGroup,
    Trajectory,
    grpo_step,
    reward_tests_pass,
    rollback,
)
from forkyard_rl.group import GROUP_METADATA_KEY
from tests.support import REPO
from tests.support.counter import COUNTER_FILE, counter_command
from tests.support.leaks import wait_no_host_resources
from tests.support.server import ServerProcess

pytestmark = pytest.mark.requires_root("real gVisor sandboxes behind a real server")


async def gone(sandbox_id: str, server: ServerProcess) -> bool:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{server.url}/sandboxes/{sandbox_id}", headers=server.headers)
    return response.status_code == 404


async def read_counter(sbx: AsyncSandbox) -> int:
    return int((await sbx.commands.run(f"cat {COUNTER_FILE}")).stdout.strip())


async def start_counter(sbx: AsyncSandbox) -> int:
    """A process in memory that counts (see tests/support/counter.py); its first value."""
    await sbx.commands.run(counter_command())
    for _ in range(100):
        result = await sbx.commands.run(f"cat {COUNTER_FILE} 2>/dev/null || true")
        if result.stdout.strip():
            return int(result.stdout)
        await asyncio.sleep(0.1)
    raise AssertionError("the counter did not start")


async def counter_runs(sbx: AsyncSandbox) -> int:
    """The counter's value once it was seen going up (the process is alive)."""
    first = await read_counter(sbx)
    for _ in range(100):
        now = await read_counter(sbx)
        if now > first:
            return now
        await asyncio.sleep(0.1)
    raise AssertionError(f"the counter stopped at {first}")


@pytest_asyncio.fixture(loop_scope="session")
async def sandbox(forkyard_server: ServerProcess) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create("base", timeout=300)
    try:
        yield sbx
    finally:
        await sbx.kill()


# -- groups ------------------------------------------------------------------------------------


async def test_group_runs_in_every_member_and_kills_them_on_exit(forkyard_server: ServerProcess) -> None:
    async with await SandboxGroup.create("base", 3, lifetime=120, concurrency=2) as group:
        ids = group.sandbox_ids
        assert len(set(ids)) == 3
        results = await group.run(lambda i: f"echo member-{i}; echo oops >&2; exit {i}")
        assert [r.exit_code for r in results] == [0, 1, 2]
        assert [r.stdout for r in results] == ["member-0\n", "member-1\n", "member-2\n"]
        assert all(r.stderr == "oops\n" and r.error is None and r.duration_s > 0 for r in results)
        assert [r.sandbox_id for r in results] == ids
        code = await group.run(Code("import os\nprint(os.getuid(), 6 * 7)"))
        assert [r.stdout for r in code] == ["1000 42\n"] * 3
        slow = await group.run(["sleep 10", "true", "true"], command_timeout=1)
        assert slow[0].exit_code is None and slow[0].error, slow[0]
        assert slow[1].ok and slow[2].ok
        tagged = Sandbox.list(query=_query(group.group_id)).next_items()
        assert {s.sandbox_id for s in tagged} == set(ids)
        lines = Trajectory.read_jsonl(group.trajectory.to_jsonl())
        assert len(lines) == 9 and {s.member for s in lines} == {"0", "1", "2"}
        assert [s.index for s in lines if s.member == "1"] == [0, 1, 2]
    for sandbox_id in ids:
        assert await gone(sandbox_id, forkyard_server)
    for sandbox_id in ids:
        assert await asyncio.to_thread(wait_no_host_resources, sandbox_id) == []


def _query(group_id: str) -> object:
    from e2b import SandboxQuery

    return SandboxQuery(metadata={GROUP_METADATA_KEY: group_id})


async def test_a_group_of_a_missing_template_is_an_error_and_leaves_nothing(
    forkyard_server: ServerProcess,
) -> None:
    from forkyard_rl import GroupError

    with pytest.raises(GroupError) as raised:
        await SandboxGroup.create("no-such-template", 2, lifetime=60)
    assert len(raised.value.errors) == 2
    assert "not found" in str(raised.value).lower()


# -- fork trees ---------------------------------------------------------------------------------


async def test_fork_tree_keeps_lineage_diverges_and_prunes(forkyard_server: ServerProcess) -> None:
    async with await ForkTree.create("base", lifetime=300) as tree:
        root = tree.root
        await root.live().files.write("/home/user/state.txt", "root")
        before = await start_counter(root.live())
        kids = await tree.fork(root, 2, lifetime=300)
        grandkids = await tree.fork_each(kids, 2, lifetime=300)
        assert [len(g) for g in grandkids] == [2, 2]
        assert len(tree.nodes) == 7
        assert {k.parent_id for k in kids} == {root.node_id}
        assert kids[0].origin_snapshot_id and kids[0].origin_snapshot_id == kids[1].origin_snapshot_id
        g00 = grandkids[0][0]
        assert [n.node_id for n in tree.lineage(g00)] == [g00.node_id, kids[0].node_id, root.node_id]
        assert g00.depth == 2 and g00.origin_snapshot_id != kids[0].origin_snapshot_id
        everyone = [root, *kids, *grandkids[0], *grandkids[1]]
        await tree.run(everyone, lambda i: f"echo node-{i} > /home/user/state.txt")
        seen = await tree.run(everyone, f"cat /home/user/state.txt && cat {COUNTER_FILE}")
        assert [r.stdout.split()[0] for r in seen] == [f"node-{i}" for i in range(7)]
        assert all(int(r.stdout.split()[1]) >= before for r in seen)  # memory came along
        pruned = await tree.prune(kids[0])
        assert set(pruned) == {kids[0].node_id, *(g.node_id for g in grandkids[0])}
        for sandbox_id in pruned:
            assert await gone(sandbox_id, forkyard_server)
        assert {n.node_id for n in tree.leaves()} == {g.node_id for g in grandkids[1]}
        assert await counter_runs(grandkids[1][1].live()) > before
        shape = tree.to_dict()
        assert len(shape["nodes"]) == 7 and sum(n["alive"] for n in shape["nodes"]) == 4
        alive = [n.node_id for n in tree.nodes.values() if n.alive]
    for sandbox_id in alive:
        assert await gone(sandbox_id, forkyard_server)


async def test_grpo_step_forks_acts_rewards_and_prunes(forkyard_server: ServerProcess) -> None:
    async def reward(sbx: AsyncSandbox, result: object) -> float:
        answer = await sbx.commands.run("cat /home/user/answer")
        return 1.0 if answer.stdout.strip() == "4" else 0.0

    async with await ForkTree.create("base", lifetime=300) as tree:
        await tree.root.live().files.write("/home/user/prompt", "2+2")
        outcome = await grpo_step(
            tree, tree.root, lambda i: f"echo {i % 5} > /home/user/answer", reward, n=5, lifetime=120
        )
        assert outcome.rewards == [0.0, 0.0, 0.0, 0.0, 1.0]
        assert outcome.advantages[4] > 0 > outcome.advantages[0]
        assert abs(sum(outcome.advantages)) < 1e-9
        rewarded = {s.member: s.reward for s in tree.trajectory if s.member != tree.root.node_id}
        assert rewarded == {n.node_id: r for n, r in zip(outcome.nodes, outcome.rewards, strict=True)}
        for node in outcome.nodes:
            assert not node.alive and await gone(node.node_id, forkyard_server)
        assert tree.root.alive
        # A node's durable checkpoint, and the node back to it in place.
        snapshot_id = await tree.checkpoint(tree.root)
        await tree.root.live().files.write("/home/user/prompt", "changed")
        await tree.rollback(tree.root)
        assert await tree.root.live().files.read("/home/user/prompt") == "2+2"
    assert not any(s.snapshot_id == snapshot_id for s in Sandbox.list_snapshots().next_items())


# -- rollback -----------------------------------------------------------------------------------


async def test_rollback_restores_files_and_processes_in_place(
    sandbox: AsyncSandbox, forkyard_server: ServerProcess
) -> None:
    await sandbox.files.write("/home/user/state.txt", "at-snapshot")
    at_snapshot = await start_counter(sandbox)
    info_before = await sandbox.get_info()
    snap = await sandbox.create_snapshot()
    try:
        await sandbox.files.write("/home/user/state.txt", "changed")
        await sandbox.files.write("/home/user/new.txt", "made after the snapshot")
        await sandbox.commands.run("pkill -f '[w]hile true' || true")
        await sandbox.commands.run("sleep 1")
        after_kill = await read_counter(sandbox)
        await sandbox.commands.run("sleep 0.5")
        assert await read_counter(sandbox) == after_kill  # the counter process is gone
        started = time.monotonic()
        await rollback(sandbox, snap.snapshot_id)
        print(f"rollback: {time.monotonic() - started:.2f} s")
        assert await sandbox.files.read("/home/user/state.txt") == "at-snapshot"
        assert not await sandbox.files.exists("/home/user/new.txt")
        restored = await counter_runs(sandbox)  # the process is back, counting from its memory
        assert restored >= at_snapshot
        info = await sandbox.get_info()
        assert info.sandbox_id == info_before.sandbox_id and info.end_at == info_before.end_at
        assert info.metadata == info_before.metadata and info.state.value == "running"
        # A second rollback to the same snapshot, from a later state, works the same way.
        await sandbox.files.write("/home/user/state.txt", "changed again")
        await rollback(sandbox, snap.snapshot_id)
        assert await sandbox.files.read("/home/user/state.txt") == "at-snapshot"
    finally:
        await AsyncSandbox.delete_snapshot(snap.snapshot_id)


async def test_rollback_of_another_sandbox_to_a_snapshot_keeps_its_own_token(
    sandbox: AsyncSandbox, forkyard_server: ServerProcess
) -> None:
    """The snapshot's envd holds its source's access token; the rolled-back sandbox answers to
    its own (the SDK object keeps working), and its old instance leaves nothing behind."""
    await sandbox.files.write("/home/user/state.txt", "from the source")
    snap = await sandbox.create_snapshot()
    other = await AsyncSandbox.create("base", timeout=120)
    try:
        assert other._envd_access_token != sandbox._envd_access_token
        await rollback(other, snap.snapshot_id)
        assert await other.files.read("/home/user/state.txt") == "from the source"
        await other.files.write("/home/user/state.txt", "other's own")
        assert await sandbox.files.read("/home/user/state.txt") == "from the source"
    finally:
        await other.kill()
        await AsyncSandbox.delete_snapshot(snap.snapshot_id)
    assert await asyncio.to_thread(wait_no_host_resources, other.sandbox_id) == []


async def test_rollback_refusals_are_e2b_shaped(
    sandbox: AsyncSandbox, forkyard_server: ServerProcess
) -> None:
    url = f"{forkyard_server.url}/sandboxes/{sandbox.sandbox_id}/rollback"
    async with httpx.AsyncClient(timeout=60, headers=forkyard_server.headers) as client:
        missing = await client.post(url, json={"snapshotID": "snapdoesnotexist"})
        no_body = await client.post(url)
        wrong_type = await client.post(url, json={"snapshotID": 7})
        no_sandbox = await client.post(
            f"{forkyard_server.url}/sandboxes/nosuchsandbox/rollback", json={"snapshotID": "x"}
        )
    assert missing.status_code == 404 and missing.json()["code"] == 404, missing.text
    assert "snapdoesnotexist" in missing.json()["message"]
    for bad in (no_body, wrong_type):
        assert bad.status_code == 400 and set(bad.json()) == {"code", "message"}, bad.text
    assert no_sandbox.status_code == 404 and no_sandbox.json()["code"] == 404
    snap = await sandbox.create_snapshot()
    try:
        await sandbox.pause()
        with pytest.raises(RollbackError) as raised:
            await rollback(sandbox, snap.snapshot_id)
        assert raised.value.code == 409 and "paused" in raised.value.message
        await AsyncSandbox.connect(sandbox.sandbox_id)
        assert (await sandbox.commands.run("echo alive")).stdout == "alive\n"  # a refusal harms nothing
    finally:
        await AsyncSandbox.delete_snapshot(snap.snapshot_id)


# -- the environment loop ------------------------------------------------------------------------


async def test_env_reset_step_reward_done_and_reset_again(forkyard_server: ServerProcess) -> None:
    setup = "printf 'value = 1\\n' > /home/user/task.py && echo 'make value 2' > /home/user/README"
    env = await SandboxEnv.from_setup(
        "base",
        setup,
        reward_tests_pass(
            "python3 -c 'import sys; sys.path[:0] = [\"/home/user\"]; import task; assert task.value == 2'"
        ),
        observe="cat /home/user/README",
        max_steps=3,
    )
    async with env:
        assert await env.reset() == "make value 2\n"
        sandbox_id = env.sandbox.sandbox_id if env.sandbox else ""
        obs, reward, done, info = await env.step("echo trying; echo '# nothing' >> /home/user/task.py")
        assert (obs, reward, done) == ("trying\n", 0.0, False)
        assert info["exit_code"] == 0 and info["step"] == 1 and info["episode"] == 0
        step = await env.step(Code("open('/home/user/task.py', 'w').write('value = 2\\n')"))
        assert step.reward == 1.0 and step.done and not step.info["truncated"]
        assert await env.reset() == "make value 2\n"  # a rollback to the task's snapshot
        assert env.sandbox is not None and env.sandbox.sandbox_id == sandbox_id
        assert (await env.sandbox.commands.run("cat /home/user/task.py")).stdout == "value = 1\n"
        for _ in range(2):
            assert not (await env.step("true")).done
        last = await env.step("true")
        assert last.done and last.info["truncated"] and last.reward == 0.0
        steps = Trajectory.read_jsonl(env.trajectory.to_jsonl())
        assert [s.member for s in steps] == ["episode-0"] * 2 + ["episode-1"] * 3
        assert [s.reward for s in steps] == [0.0, 1.0, 0.0, 0.0, 0.0]
        assert steps[1].kind == "code:python" and steps[1].info["done"] is True
    assert await gone(sandbox_id, forkyard_server)
    assert not any(s.snapshot_id == env.task_snapshot_id for s in Sandbox.list_snapshots().next_items())


# -- a crashed client ----------------------------------------------------------------------------

CRASHING_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from forkyard_rl import SandboxGroup

    async def main() -> None:
        group = await SandboxGroup.create("base", 2, lifetime=int(sys.argv[1]))
        print(json.dumps(group.sandbox_ids), flush=True)
        await group.run("sleep 600", command_timeout=600)  # killed -9 in the middle of this

    asyncio.run(main())
    """
)


def test_sandboxes_of_a_killed_client_end_by_their_server_side_timeout(
    forkyard_server: ServerProcess,
) -> None:
    lifetime = 4
    env = {**os.environ, **forkyard_server.sdk_env, "PYTHONPATH": str(REPO)}
    client = subprocess.Popen(
        [sys.executable, "-c", CRASHING_CLIENT, str(lifetime)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None
        line = client.stdout.readline()
        ids = json.loads(line) if line else []
        assert len(ids) == 2, client.stderr.read() if client.stderr else line
        created = time.monotonic()
        for sandbox_id in ids:
            assert Sandbox.get_info(sandbox_id).state.value == "running"
        time.sleep(1)  # the client is in the middle of its batch
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
    finally:
        if client.poll() is None:
            client.kill()
    deadline = created + lifetime + 20
    pending = set(ids)
    while pending and time.monotonic() < deadline:
        response = httpx.get(
            f"{forkyard_server.url}/v2/sandboxes", headers=forkyard_server.headers, timeout=30
        )
        listed = {s["sandboxID"] for s in response.json()}
        pending &= listed
        time.sleep(0.5)
    ended_after = time.monotonic() - created
    print(f"crashed client's sandboxes ended {ended_after:.1f} s after creation (lifetime {lifetime} s)")
    assert not pending, f"still running {ended_after:.0f} s after creation: {pending}"
    for sandbox_id in ids:
        logs = httpx.get(
            f"{forkyard_server.url}/v2/sandboxes/{sandbox_id}/logs",
            headers=forkyard_server.headers,
            timeout=30,
        ).json()["logs"]
        assert any("sandbox killed: timeout reached" in e["message"] for e in logs), logs
        assert wait_no_host_resources(sandbox_id) == []
