"""The sandboxes a node makes for itself (template snapshots, warm pools, standbys, builds) have
no registry row; one owner makes and kills them, with the shape of a user sandbox's transitions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forkyard.config import Settings
from forkyard.errors import Failed
from forkyard.orchestrator.rowless import EDGES, RowlessSandboxes, RowlessState
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.types import SandboxInstance, SandboxSpec, TemplateImage
from tests.support.loopback import LoopbackRuntime

pytestmark = pytest.mark.asyncio(loop_scope="session")
FORKYARD = Path(__file__).resolve().parents[2] / "forkyard"


def _spec(tmp_path: Path, sandbox_id: str) -> SandboxSpec:
    return SandboxSpec(sandbox_id, TemplateImage("base", tmp_path / "rootfs"))


async def test_made_then_killed_or_claimed(tmp_path: Path) -> None:
    runtime = LoopbackRuntime(Settings(data_dir=tmp_path))
    rowless = RowlessSandboxes(RuntimeSet(runtime.settings, runtime))
    built = await rowless.create(runtime, _spec(tmp_path, "rl-build"), "build")
    pooled = await rowless.create(runtime, _spec(tmp_path, "rl-pool"), "warm-pool")
    assert rowless.live() == ["rl-build", "rl-pool"] and rowless.live("build") == ["rl-build"]
    rowless.claimed(pooled)  # a create took it: the lifecycle's now, no longer listed here
    await rowless.kill(built)
    assert rowless.live() == [] and runtime.killed == ["rl-build"]
    await runtime.kill(pooled)


async def test_a_failed_make_leaves_nothing_listed(tmp_path: Path) -> None:
    runtime = LoopbackRuntime(Settings(data_dir=tmp_path), fail_create=True)
    rowless = RowlessSandboxes(RuntimeSet(runtime.settings, runtime))
    with pytest.raises(Failed, match="injected"):
        await rowless.create(runtime, _spec(tmp_path, "rl-fail"), "template-snapshot")
    assert rowless.live() == []
    await runtime.kill(SandboxInstance.placeholder("rl-fail", "loopback"))  # the fake's leftover


async def test_one_sandbox_id_is_made_once(tmp_path: Path) -> None:
    runtime = LoopbackRuntime(Settings(data_dir=tmp_path))
    rowless = RowlessSandboxes(RuntimeSet(runtime.settings, runtime))
    first = await rowless.create(runtime, _spec(tmp_path, "rl-twice"), "standby")
    with pytest.raises(Failed, match="already being made"):
        await rowless.create(runtime, _spec(tmp_path, "rl-twice"), "standby")
    await rowless.kill(first)


async def test_claimed_and_killed_are_final() -> None:
    assert EDGES[RowlessState.CLAIMED] == frozenset() and EDGES[RowlessState.KILLED] == frozenset()
    assert RowlessState.CLAIMED not in EDGES[RowlessState.MAKING]


async def test_no_collaborator_makes_or_kills_a_runtime_sandbox_itself() -> None:
    """Outside the lifecycle owner (user sandboxes) and the rowless owner, nothing in the
    orchestrator creates, restores or kills a runtime instance (five modules used to)."""
    owners = {"lifecycle.py", "rowless.py"}
    calls = [
        f"{path.name}:{n}"
        for path in sorted((FORKYARD / "orchestrator").glob("*.py"))
        if path.name not in owners
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bruntime\)?\.(create|restore|kill)\(|\.named\([^)]*\)\.(create|restore|kill)\(", line)
    ]
    assert calls == []
