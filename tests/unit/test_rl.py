"""The pure parts of forkyard_rl: actions as shell commands, bounded concurrency, trajectories as
JSON lines, GRPO advantages, tree shape, the rollback request, and its import-linter contract.
The parts that talk to a server are in tests/system/test_rl.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from forkyard_rl import Code, Command, Connection, ForkTree, RunResult, Trajectory, advantages
from forkyard_rl.actions import as_command, bounded, describe, per_member
from forkyard_rl.api import RollbackError, check_rollback, rollback_request
from tests.unit.test_import_layers import REPO, lint_imports


def result(sandbox_id: str = "sbx", code: int | None = 0, out: str = "", err: str = "") -> RunResult:
    return RunResult(sandbox_id, code, out, err, duration_s=0.25, started_at=1.0)


# -- actions -------------------------------------------------------------------------------------


def test_a_string_is_a_shell_command_and_code_runs_in_python_from_a_quoted_document() -> None:
    assert as_command("echo hi") == Command("echo hi")
    source = "print('$HOME `x` \"q\"')\nimport sys\n"
    cmd = as_command(Code(source, user="root", cwd="/tmp"))
    assert cmd.user == "root" and cmd.cwd == "/tmp"
    assert cmd.cmd.startswith("python3 -c \"$(cat <<'FORKYARD_CODE_")
    marker = cmd.cmd.split("<<'")[1].split("'")[0]
    assert f'\n{source}\n{marker}\n)"' in cmd.cmd  # verbatim: a quoted here-document expands nothing
    assert describe(Code(source)) == ("code:python", source)
    assert describe("ls") == ("command", "ls")


def test_the_code_document_runs_in_a_real_shell_verbatim() -> None:
    """The command as bash would run it in the sandbox (here on the host), quotes and all."""
    source = "import sys\nprint('a $HOME `b` \"c\"', sys.argv[0])\nprint('FORKYARD_CODE_' + 'x')"
    if shutil.which("bash") is None or shutil.which("python3") is None:
        pytest.skip("needs bash and python3 on the host")
    done = subprocess.run(["bash", "-c", as_command(Code(source)).cmd], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == 'a $HOME `b` "c" -c\nFORKYARD_CODE_x\n'


def test_per_member_actions() -> None:
    assert per_member("x", 3) == ["x", "x", "x"]
    assert per_member(lambda i: f"echo {i}", 2) == ["echo 0", "echo 1"]
    assert per_member(["a", Code("b")], 2) == ["a", Code("b")]
    with pytest.raises(ValueError, match="3 actions for 2 members"):
        per_member(["a", "b", "c"], 2)


def test_run_result_ok_and_output() -> None:
    assert result(out="o", err="e").output == "oe"
    assert result().ok and not result(code=1).ok
    assert not RunResult("s", None, "", "", 1.0, 0.0, error="timeout").ok


async def test_bounded_keeps_order_and_the_limit() -> None:
    running = peak = 0

    async def job(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01 * (5 - i))
        running -= 1
        return i

    assert await bounded(2, [lambda i=i: job(i) for i in range(5)]) == [0, 1, 2, 3, 4]
    assert peak == 2
    with pytest.raises(ValueError):
        await bounded(0, [])


async def test_bounded_lets_every_job_end_before_raising() -> None:
    ended: list[int] = []

    async def job(i: int) -> int:
        await asyncio.sleep(0.01 * i)
        ended.append(i)
        if i == 0:
            raise RuntimeError("first")
        return i

    with pytest.raises(RuntimeError, match="first"):
        await bounded(3, [lambda i=i: job(i) for i in range(3)])
    assert sorted(ended) == [0, 1, 2]


# -- trajectories ----------------------------------------------------------------------------------


def test_trajectory_numbers_steps_per_member_and_round_trips_json_lines(tmp_path: Path) -> None:
    traj = Trajectory("test")
    a = traj.record("0", "echo a", result("s0", out="a\n"))
    traj.record("1", Code("print(1)"), result("s1", code=3), parent="root", note="x")
    b = traj.record("0", "echo b", result("s0"))
    traj.set_reward(b, 0.5)
    assert [s.index for s in traj.of("0")] == [0, 1] and traj.members() == ["0", "1"]
    lines = traj.to_jsonl().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["source"] == "test" for line in lines)
    steps = Trajectory.read_jsonl(traj.to_jsonl())
    assert steps[0] == a and steps[2].reward == 0.5
    assert steps[1].kind == "code:python" and steps[1].exit_code == 3
    assert steps[1].parent == "root" and steps[1].info == {"note": "x"}
    path = traj.write_jsonl(tmp_path / "t.jsonl")
    traj.write_jsonl(path)  # appends
    assert len(path.read_text().splitlines()) == 6
    with pytest.raises(ValueError):
        traj.set_reward(b, 1.0)  # b itself was replaced by its rewarded copy


def test_set_reward_of_a_step_not_in_the_trajectory_fails() -> None:
    traj = Trajectory()
    other = Trajectory().record("0", "x", result())
    with pytest.raises(ValueError, match="not in this trajectory"):
        traj.set_reward(other, 1.0)


# -- GRPO and trees -------------------------------------------------------------------------------


def test_advantages_are_group_normalised() -> None:
    adv = advantages([0.0, 0.0, 1.0, 1.0])
    assert adv == [-1.0, -1.0, 1.0, 1.0]
    assert advantages([0.3, 0.3]) == [0.0, 0.0]
    assert advantages([]) == []
    skewed = advantages([1.0, 0.0, 0.0, 0.0])
    assert abs(sum(skewed)) < 1e-12 and skewed[0] > 0


def fake_sandbox(sandbox_id: str) -> Any:
    config = SimpleNamespace(api_key="k", api_url="http://api", headers={}, request_timeout=None)
    return SimpleNamespace(sandbox_id=sandbox_id, connection_config=config)


def test_tree_shape_lineage_subtree_and_leaves() -> None:
    from forkyard_rl.tree import Node

    tree = ForkTree(fake_sandbox("root"))
    for node_id, parent in [("a", "root"), ("b", "root"), ("a1", "a"), ("a2", "a")]:
        up = tree.nodes[parent]
        tree.nodes[node_id] = Node(node_id, fake_sandbox(node_id), parent, up.depth + 1, "snapX")
        up.children.append(node_id)
    assert [n.node_id for n in tree.lineage(tree.nodes["a2"])] == ["a2", "a", "root"]
    assert [n.node_id for n in tree.subtree(tree.nodes["a"])] == ["a", "a1", "a2"]
    assert {n.node_id for n in tree.leaves()} == {"a1", "a2", "b"}
    tree.nodes["a1"].sandbox = None
    tree.nodes["a2"].sandbox = None
    assert {n.node_id for n in tree.leaves()} == {"a", "b"}
    shape = tree.to_dict()
    assert shape["root"] == "root" and len(shape["nodes"]) == 5
    with pytest.raises(ValueError, match="pruned"):
        tree.nodes["a1"].live()


# -- the rollback request -------------------------------------------------------------------------


def test_rollback_request_uses_the_sdk_connection() -> None:
    config = SimpleNamespace(
        api_url="http://127.0.0.1:3000/", api_key="e2b_k", headers={"User-Agent": "x"}, request_timeout=5
    )
    req = rollback_request(cast(Any, config), "sbx1", "snap1")
    assert req["url"] == "http://127.0.0.1:3000/sandboxes/sbx1/rollback"
    assert req["json"] == {"snapshotID": "snap1"}
    assert req["headers"] == {"User-Agent": "x", "X-API-Key": "e2b_k"}
    assert req["timeout"] >= 120  # a kill and a restore: never cut at the SDK's short default


def test_rollback_errors_carry_the_e2b_shape() -> None:
    check_rollback(httpx.Response(200, json={}))
    with pytest.raises(RollbackError) as raised:
        check_rollback(httpx.Response(404, json={"code": 404, "message": "snapshot 'x' not found"}))
    assert raised.value.code == 404 and raised.value.message == "snapshot 'x' not found"
    with pytest.raises(RollbackError, match="502: bad gateway"):
        check_rollback(httpx.Response(502, text="bad gateway"))


def test_connection_passes_only_what_is_set() -> None:
    assert Connection().opts() == {}
    assert Connection(api_key="k", request_timeout=3).opts() == {"api_key": "k", "request_timeout": 3}


# -- the layer contract ---------------------------------------------------------------------------


def test_rl_importing_a_server_layer_is_caught(tmp_path: Path) -> None:
    shutil.copytree(
        REPO / "forkyard", tmp_path / "forkyard", ignore=shutil.ignore_patterns("__pycache__", "*_pb.py")
    )
    shutil.copytree(
        REPO / "clients" / "rl" / "forkyard_rl",
        tmp_path / "forkyard_rl",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "forkyard_rl" / "offender.py").write_text("import forkyard.orchestrator.lifecycle\n")

    outcome = lint_imports(tmp_path)

    assert outcome.returncode != 0
    assert "forkyard_rl.offender -> forkyard.orchestrator.lifecycle" in outcome.stdout


# -- the server side of rollback: the lifecycle owner on the loopback runtime (no root) -----------


def secured(template_id: str = "base", secure: bool = True) -> Any:
    from forkyard.orchestrator.lifecycle import CreateRequest
    from forkyard.orchestrator.store import NetworkPolicy

    return CreateRequest(
        template_id=template_id,
        timeout_seconds=60,
        metadata={"k": "v"},
        envs={"E": "1"},
        secure=secure,
        network=NetworkPolicy(allow_internet_access=True),
    )


async def test_rollback_replaces_the_instance_and_keeps_the_sandbox(tmp_path: Path) -> None:
    from forkyard.types import SandboxState
    from tests.unit.test_lifecycle import loopback_node

    async with loopback_node(tmp_path) as (orch, runtime):
        rec = await orch.create(secured())
        snap = await orch.create_snapshot(rec.sandbox_id, "task")
        before = await orch.get(rec.sandbox_id)
        old_address = before.instance.address if before.instance else ""
        after = await orch.rollback(rec.sandbox_id, "task")  # by name or id, as a create
        assert after.sandbox_id == rec.sandbox_id and after.state == SandboxState.RUNNING
        assert after.end_at == before.end_at and after.metadata == {"k": "v"}
        assert after.envd_access_token == before.envd_access_token
        assert runtime.restores[-1][0] == rec.sandbox_id
        assert runtime.restores[-1][1].snapshot_id == snap.snapshot_id
        assert rec.sandbox_id in runtime.killed  # the running instance went first
        route = orch.route(rec.sandbox_id)
        assert route is not None and route.address != old_address
        assert after.memory_base == snap.snapshot_id
        init = runtime.seen[rec.sandbox_id].inits[-1]
        assert init["accessToken"] == before.envd_access_token and init["envVars"] == {"E": "1"}
        # Another secured sandbox rolls back to that snapshot and keeps its own token.
        other = await orch.create(secured())
        rolled = await orch.rollback(other.sandbox_id, snap.snapshot_id)
        assert rolled.envd_access_token == other.envd_access_token != before.envd_access_token
        assert runtime.seen[other.sandbox_id].inits[-1]["accessToken"] == other.envd_access_token
        messages = [ln.message for ln in await orch.store.logs(rec.sandbox_id, start=None, limit=50)]
        assert any(m.startswith(f"sandbox rolled back to snapshot {snap.snapshot_id}") for m in messages)
        for sid in (rec.sandbox_id, other.sandbox_id):
            await orch.kill(sid)


async def test_rollback_refusals_touch_nothing(tmp_path: Path) -> None:
    from forkyard.errors import Conflict, Invalid, NotFound
    from tests.unit.test_lifecycle import loopback_node

    async with loopback_node(tmp_path) as (orch, runtime):
        rec = await orch.create(secured())
        snap = await orch.create_snapshot(rec.sandbox_id, None)
        plain = await orch.create(secured(secure=False))
        with pytest.raises(NotFound, match="snapshot 'snapnope' not found"):
            await orch.rollback(rec.sandbox_id, "snapnope")
        with pytest.raises(NotFound):
            await orch.rollback("nosuchsandbox", snap.snapshot_id)
        with pytest.raises(Invalid, match="not secured"):
            await orch.rollback(plain.sandbox_id, snap.snapshot_id)
        await orch.pause(rec.sandbox_id)
        with pytest.raises(Conflict, match="paused, not running"):
            await orch.rollback(rec.sandbox_id, snap.snapshot_id)
        assert runtime.restores == [] or all(sid != plain.sandbox_id for sid, _ in runtime.restores)
        assert plain.sandbox_id not in runtime.killed
        assert orch.route(plain.sandbox_id) is not None
        for sid in (rec.sandbox_id, plain.sandbox_id):
            await orch.kill(sid)


async def test_a_failed_rollback_is_undone_by_destroying_the_sandbox(tmp_path: Path) -> None:
    from forkyard.errors import Failed, NotFound
    from forkyard.types import SandboxState
    from tests.unit.test_lifecycle import loopback_node

    async with loopback_node(tmp_path) as (orch, runtime):
        rec = await orch.create(secured())
        snap = await orch.create_snapshot(rec.sandbox_id, None)

        async def broken_restore(*_: Any) -> Any:
            raise Failed("injected restore failure")

        runtime.restore = broken_restore  # type: ignore[method-assign]
        with pytest.raises(Failed, match=r"rollback of sandbox .* failed: injected restore failure"):
            await orch.rollback(rec.sandbox_id, snap.snapshot_id)
        with pytest.raises(NotFound):
            await orch.get(rec.sandbox_id)
        stored = await orch.store.get(rec.sandbox_id)
        assert stored is not None and stored.state == SandboxState.KILLED
        assert orch.route(rec.sandbox_id) is None and rec.sandbox_id not in runtime.servers
        messages = [ln.message for ln in await orch.store.logs(rec.sandbox_id, start=None, limit=50)]
        assert any("rollback to" in m and "failed" in m for m in messages), messages
        assert await orch.catalog.get(snap.snapshot_id) is not None  # the snapshot is not harmed


def test_only_failures_that_may_pass_next_time_are_retried() -> None:
    from e2b import InvalidArgumentException, NotFoundException, SandboxException, TimeoutException

    from forkyard_rl.group import retryable

    assert retryable(SandboxException("500: restore failed")) and retryable(TimeoutException("slow"))
    assert retryable(SandboxException("429: rate limited"))
    assert not retryable(SandboxException("404: template 'x' not found"))
    assert not retryable(NotFoundException("gone")) and not retryable(InvalidArgumentException("bad"))
