"""Captured logins (agentenv.envd.loginenv): a capture that only ran out of time is tried again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentenv.envd import loginenv
from agentenv.envd.loginenv import LoginEnvironments, LoginKey
from agentenv.envd.users import User


def _key() -> LoginKey:
    user = User(name="user", uid=1000, gid=1000, home="/home/user", shell="/bin/bash")
    return LoginKey.of(user, "/home/user", {"PATH": "/usr/bin"})


async def _settle(logins: LoginEnvironments) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
    await asyncio.gather(*logins._running, return_exceptions=True)


@pytest.mark.parametrize("timeouts, served", [(1, True), (loginenv._TIMEOUT_RETRIES + 1, False)])
async def test_a_capture_that_timed_out_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, timeouts: int, served: bool
) -> None:
    captured = object()
    attempts: list[int] = []

    async def capture(self: Any, key: LoginKey) -> object:
        attempts.append(1)
        if len(attempts) <= timeouts:
            raise loginenv._Transient(loginenv.TIMED_OUT)
        return captured

    monkeypatch.setattr(LoginEnvironments, "_capture_and_verify", capture)
    logins = LoginEnvironments(spawner=None)  # type: ignore[arg-type]
    key = _key()
    logins.prewarm(key)  # /init: the capture runs (and runs out of time)
    await _settle(logins)
    results = []
    for _ in range(loginenv._TIMEOUT_RETRIES + 3):  # commands of the key, one after another
        results.append(logins.lookup(key))
        await _settle(logins)
    assert (captured in results) is served
    # Never more than the retries: a key whose captures keep running out of time runs bash -l.
    assert len(attempts) <= loginenv._TIMEOUT_RETRIES + 1


async def test_a_refused_capture_is_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[int] = []

    async def capture(self: Any, key: LoginKey) -> None:
        attempts.append(1)
        return None  # refused for good (profile output, state differs, a process left behind)

    monkeypatch.setattr(LoginEnvironments, "_capture_and_verify", capture)
    logins = LoginEnvironments(spawner=None)  # type: ignore[arg-type]
    key = _key()
    logins.prewarm(key)
    await _settle(logins)
    for _ in range(4):
        assert logins.lookup(key) is None
        await _settle(logins)
    assert len(attempts) == 1
