"""What a sandbox restored ahead of demand goes through before it is pooled
(orchestrator/envd_client.py ``initialised``): its restore's /init, then a warm-up command."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from forkyard.errors import Failed, Unavailable
from forkyard.orchestrator import envd_client
from forkyard.orchestrator.envd_client import WARM_UP_COMMAND, initialised
from forkyard.types import SandboxInstance


class FakeEnvd:
    def __init__(self, init_error: Exception | None = None, run: str = "ok") -> None:
        self.init_error = init_error
        self.run_mode = run
        self.calls: list[tuple[str, Any]] = []

    async def init(self, instance: SandboxInstance, envs: dict[str, str], token: str | None) -> None:
        self.calls.append(("init", (envs, token)))
        if self.init_error is not None:
            raise self.init_error

    async def run(self, instance: SandboxInstance, argv: list[str], **kwargs: Any) -> None:
        self.calls.append(("run", (argv, kwargs)))
        if self.run_mode == "fails":
            raise Failed("bash: not found")
        if self.run_mode == "hangs":
            await asyncio.sleep(3600)


class FakeRuntime:
    def __init__(self) -> None:
        self.killed: list[str] = []

    async def kill(self, instance: SandboxInstance) -> None:
        self.killed.append(instance.sandbox_id)


def _instance() -> SandboxInstance:
    return SandboxInstance.placeholder("sbx-pooled", "gvisor")


async def test_init_then_one_warm_up_command_as_the_default_user() -> None:
    envd, runtime = FakeEnvd(), FakeRuntime()
    instance = await initialised(envd, envd, runtime, _instance(), {"A": "1"}, "tok")  # type: ignore[arg-type]
    assert instance.sandbox_id == "sbx-pooled" and not runtime.killed
    assert envd.calls == [
        ("init", ({"A": "1"}, "tok")),
        ("run", (WARM_UP_COMMAND, {"user": None, "access_token": "tok"})),
    ]


async def test_a_failed_init_kills_the_sandbox() -> None:
    envd, runtime = FakeEnvd(init_error=Unavailable("envd /init unreachable")), FakeRuntime()
    with pytest.raises(Unavailable):
        await initialised(envd, envd, runtime, _instance(), {}, None)  # type: ignore[arg-type]
    assert runtime.killed == ["sbx-pooled"] and [c[0] for c in envd.calls] == ["init"]


@pytest.mark.parametrize("mode", ["fails", "hangs"])
async def test_a_warm_up_that_fails_or_hangs_still_pools_the_sandbox(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(envd_client, "WARM_UP_TIMEOUT_S", 0.05)
    envd, runtime = FakeEnvd(run=mode), FakeRuntime()
    instance = await initialised(envd, envd, runtime, _instance(), {}, None)  # type: ignore[arg-type]
    assert instance.sandbox_id == "sbx-pooled" and not runtime.killed
