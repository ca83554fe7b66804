"""Captured logins (forkyard.envd.process.loginenv): a capture that only ran out of time is tried again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from forkyard.envd.process import loginenv
from forkyard.envd.process.loginenv import LoginEnvironments, LoginKey
from forkyard.envd.users import User


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


async def test_a_capture_cut_by_a_snapshot_and_restore_is_captured_again_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A template snapshot taken mid-capture: restored later, the capture's deadline has passed
    (the clock jumped). That is no timeout of the login: envd captures again right away, so the
    first commands of the restored sandbox do not run the profile."""
    captured = object()
    attempts: list[int] = []
    restored = asyncio.Event()

    async def capture(self: Any, key: LoginKey) -> object:
        attempts.append(1)
        if len(attempts) == 1:
            await restored.wait()  # the snapshot; /init of the restore comes meanwhile
            raise loginenv._Transient(loginenv.TIMED_OUT)
        return captured

    monkeypatch.setattr(LoginEnvironments, "_capture_and_verify", capture)
    monkeypatch.setattr(loginenv._Watches, "unchanged", lambda self: True)
    logins = LoginEnvironments(spawner=None)  # type: ignore[arg-type]
    key = _key()
    logins.prewarm(key)  # envd's start-up
    await asyncio.sleep(0)
    logins.revalidate()  # /init after the restore
    restored.set()
    await _settle(logins)
    await _settle(logins)
    assert len(attempts) == 2
    assert logins.lookup(key) is captured  # the very first command is served


async def test_settled_waits_for_the_capture_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """envd's start-up answers only after the default user's capture (a template snapshot is
    taken when envd answers); a capture that hangs holds it back only ``limit_s`` seconds."""
    captured = object()
    release = asyncio.Event()

    async def capture(self: Any, key: LoginKey) -> object:
        await release.wait()
        return captured

    monkeypatch.setattr(LoginEnvironments, "_capture_and_verify", capture)
    logins = LoginEnvironments(spawner=None)  # type: ignore[arg-type]
    key = _key()
    logins.prewarm(key)
    await logins.settled(0.05)  # still hanging: returns anyway
    assert logins.lookup(key) is None
    asyncio.get_running_loop().call_later(0.05, release.set)
    await logins.settled(5)
    assert logins.lookup(key) is captured
