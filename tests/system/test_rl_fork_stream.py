"""Children as they come up, forks of paused sandboxes and N sandboxes from a stored snapshot
(issue 26, parts 1-2) through the official ``e2b`` SDK and ``forkyard_rl`` against a real
``forkyard serve`` with the gVisor runtime; and a crashed trainer's forks ended by their timeout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox

from forkyard_rl import SandboxGroup, fork_stream
from tests.support import REPO
from tests.support.counter import COUNTER_FILE, counter_command
from tests.support.leaks import wait_no_host_resources
from tests.support.server import ServerProcess

pytestmark = pytest.mark.requires_root("real gVisor sandboxes behind a real server")


async def state(sandbox_id: str, server: ServerProcess) -> str | None:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{server.url}/sandboxes/{sandbox_id}", headers=server.headers)
    return str(response.json()["state"]) if response.status_code == 200 else None


async def counting(sbx: AsyncSandbox) -> int:
    """The counter process's value once it was seen going up (it lives in this sandbox's memory)."""
    first = None
    for _ in range(100):
        out = (await sbx.commands.run(f"cat {COUNTER_FILE} 2>/dev/null || true")).stdout.strip()
        if out and first is not None and int(out) > first:
            return int(out)
        first = int(out) if out else first
        await asyncio.sleep(0.1)
    raise AssertionError(f"the counter is not running (last {first})")


async def test_children_come_one_by_one_and_the_first_works_before_the_last_is_up(
    forkyard_server: ServerProcess,
) -> None:
    parent = await AsyncSandbox.create("base", timeout=300)
    try:
        await parent.files.write("/home/user/prompt", "2+2")
        arrived: list[float] = []
        first_done: float | None = None
        children: list[AsyncSandbox] = []
        work: list[asyncio.Task[None]] = []

        async def act(child: AsyncSandbox, i: int) -> None:
            nonlocal first_done
            await child.commands.run(f"echo {i} > /home/user/answer")
            if i == 0:
                first_done = time.monotonic()

        async for started in fork_stream(parent, 6, lifetime=120):
            assert started.sandbox is not None, started.error
            arrived.append(time.monotonic())
            children.append(started.sandbox)
            work.append(asyncio.ensure_future(act(started.sandbox, len(children) - 1)))
        await asyncio.gather(*work)
        print(f"arrivals after the first: {[round(t - arrived[0], 2) for t in arrived]} s")
        assert first_done is not None and first_done < arrived[-1], (first_done, arrived)
        answers = [(await c.files.read("/home/user/answer")).strip() for c in children]
        assert answers == [str(i) for i in range(6)]  # each child its own disk
        assert {(await c.files.read("/home/user/prompt")) for c in children} == {"2+2"}
        assert not await parent.files.exists("/home/user/answer")
        for c in children:
            await c.kill()
    finally:
        await parent.kill()


async def test_children_of_a_paused_parent_are_isolated_and_it_stays_paused(
    forkyard_server: ServerProcess,
) -> None:
    parent = await AsyncSandbox.create("base", timeout=300)
    try:
        await parent.files.write("/home/user/state", "parent")
        await parent.commands.run(counter_command())
        before = await counting(parent)
        await parent.pause()  # frozen in memory (the first pause tier)
        for round_ in range(2):  # frozen (moved to disk for the fork), then on disk
            group = await SandboxGroup.fork(parent, 3, lifetime=120)
            assert await state(parent.sandbox_id, forkyard_server) == "paused"
            assert len(set(group.sandbox_ids)) == 3 and parent.sandbox_id not in group.sandbox_ids
            seen = await group.run("cat /home/user/state")
            assert [r.stdout for r in seen] == ["parent"] * 3
            counts = [await counting(m) for m in group.members]
            assert min(counts) >= before, counts  # its memory came along: the counter runs on
            await group.run([f"echo child-{round_}-{i} > /home/user/state" for i in range(3)])
            seen = await group.run("cat /home/user/state")
            assert [r.stdout.strip() for r in seen] == [f"child-{round_}-{i}" for i in range(3)]
            await group.kill()
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(
                f"{forkyard_server.url}/v2/sandboxes/{parent.sandbox_id}/logs",
                headers=forkyard_server.headers,
            )
        logs = response.json()["logs"]
        assert any("moved to disk: forked while paused" in e["message"] for e in logs), logs
        assert not any("resumed" in e["message"] for e in logs)  # never resumed by the forks
        await parent.connect(timeout=120)
        assert (
            await parent.files.read("/home/user/state")
        ) == "parent"  # the children's writes stayed theirs
        assert await counting(parent) >= before
    finally:
        await parent.kill()


async def test_n_sandboxes_from_a_stored_snapshot_in_one_call(forkyard_server: ServerProcess) -> None:
    source = await AsyncSandbox.create("base", timeout=300)
    try:
        await source.files.write("/home/user/data", "prepared")
        snapshot = await source.create_snapshot()
        began: dict[int, float] = {}

        async def rollout(i: int, member: AsyncSandbox) -> str:
            began[i] = time.monotonic()
            await member.files.write("/home/user/mine", str(i))
            return (await member.files.read("/home/user/data")).strip()

        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream(
                "POST",
                f"{forkyard_server.url}/snapshots/{snapshot.snapshot_id}/sandboxes",
                json={"count": 2, "timeout": 60},
                headers=forkyard_server.headers,
            ) as response,
        ):
            assert response.status_code == 200, await response.aread()
            lines = [json.loads(line) async for line in response.aiter_lines() if line]
        assert [line["sandbox"]["templateID"] for line in lines] == [snapshot.snapshot_id] * 2  # one call
        for line in lines:
            await AsyncSandbox.kill(line["sandbox"]["sandboxID"])
        group = await SandboxGroup.from_snapshot(snapshot.snapshot_id, 4, each=rollout, lifetime=120)
        try:
            assert group.each_results == ["prepared"] * 4
            assert [(await m.files.read("/home/user/mine")) for m in group.members] == ["0", "1", "2", "3"]
            infos = [await m.get_info() for m in group.members]
            assert {i.template_id for i in infos} == {snapshot.snapshot_id}
            assert {i.metadata["forkyard_rl.group"] for i in infos} == {group.group_id}
        finally:
            await group.kill()
        await AsyncSandbox.delete_snapshot(snapshot.snapshot_id)
    finally:
        await source.kill()


CRASHING_TRAINER = textwrap.dedent(
    """
    import asyncio, json, sys
    from e2b import AsyncSandbox
    from forkyard_rl import SandboxGroup

    async def main() -> None:
        parent = await AsyncSandbox.connect(sys.argv[2])
        group = await SandboxGroup.fork(parent, 2, lifetime=int(sys.argv[1]))
        print(json.dumps(group.sandbox_ids), flush=True)
        await group.run("sleep 600", command_timeout=600)  # killed -9 in the middle of this

    asyncio.run(main())
    """
)


def test_a_crashed_trainers_forks_end_by_their_server_side_timeout(forkyard_server: ServerProcess) -> None:
    lifetime = 4
    parent = Sandbox.create("base", timeout=120)
    env = {**os.environ, **forkyard_server.sdk_env, "PYTHONPATH": str(REPO)}
    client = subprocess.Popen(
        [sys.executable, "-c", CRASHING_TRAINER, str(lifetime), parent.sandbox_id],
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
        time.sleep(1)
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
    finally:
        if client.poll() is None:
            client.kill()
    try:
        pending = set(ids)
        while pending and time.monotonic() < created + lifetime + 20:
            listed = httpx.get(
                f"{forkyard_server.url}/v2/sandboxes", headers=forkyard_server.headers, timeout=30
            ).json()
            pending &= {s["sandboxID"] for s in listed}
            time.sleep(0.5)
        assert not pending, f"still running {time.monotonic() - created:.0f} s after they came up: {pending}"
        for sandbox_id in ids:
            assert wait_no_host_resources(sandbox_id) == []
    finally:
        parent.kill()
