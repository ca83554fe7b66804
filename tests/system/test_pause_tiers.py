"""Tiered pause through the official ``e2b`` SDK against a real ``forkyard serve`` (gVisor): a
pause freezes the sandbox in place; after an idle period it moves to disk; a resume thaws it or
restores it; both tiers survive a server kill -9. The API shows both tiers as ``paused``."""

from __future__ import annotations

import datetime as dt
import os
import signal
import sqlite3
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import NotFoundException, Sandbox

from tests.support import base_template_missing
from tests.support.counter import assert_state_continues, start_state
from tests.support.leaks import wait_no_host_resources
from tests.support.procs import runsc_sandbox_pid
from tests.support.server import ServerProcess, kill_all_sandboxes, serve, start_server

pytestmark = pytest.mark.requires_root("gVisor sandboxes, network namespaces")


def tier(server: ServerProcess, sandbox_id: str) -> tuple[str, str | None]:
    db = sqlite3.connect(server.data_dir / "forkyard.sqlite3", timeout=5)
    try:
        state, pause_tier = db.execute(
            "SELECT state, pause_tier FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)
        ).fetchone()
    finally:
        db.close()
    return str(state), pause_tier


def log_messages(server: ServerProcess, sandbox_id: str) -> list[str]:
    db = sqlite3.connect(server.data_dir / "forkyard.sqlite3", timeout=5)
    try:
        rows = db.execute(
            "SELECT message FROM sandbox_logs WHERE sandbox_id = ? ORDER BY id", (sandbox_id,)
        ).fetchall()
    finally:
        db.close()
    return [str(m) for (m,) in rows]


def wait_tier(server: ServerProcess, sandbox_id: str, wanted: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while tier(server, sandbox_id) != ("paused", wanted):
        assert time.monotonic() < deadline, f"{sandbox_id} never reached {wanted}: {tier(server, sandbox_id)}"
        time.sleep(0.1)


def tiered_server(disk_after: float) -> Iterator[ServerProcess]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with serve(
        prefix="forkyard-tiers-", extra_env={"FORKYARD_PAUSE_DISK_AFTER_SECONDS": str(disk_after)}
    ) as server:
        yield server


@pytest.fixture()
def quick_disk_server() -> Iterator[ServerProcess]:
    """Frozen sandboxes move to disk after one second."""
    yield from tiered_server(1.0)


@pytest.fixture()
def frozen_server() -> Iterator[ServerProcess]:
    """Frozen sandboxes stay frozen for the whole test: a one-second idle timer raced the
    assertions on a loaded CI machine (the sandbox was already on disk when it was looked at)."""
    yield from tiered_server(600.0)


def test_freeze_then_idle_to_disk_then_resume_keeps_process_and_files(
    quick_disk_server: ServerProcess,
) -> None:
    opts = quick_disk_server.sdk_opts
    sbx = Sandbox.create(timeout=300, **opts)
    try:
        before = start_state(sbx)
        assert sbx.pause() is True
        assert Sandbox.get_info(sbx.sandbox_id, **opts).state.value == "paused"
        assert tier(quick_disk_server, sbx.sandbox_id)[1] in ("frozen", "moving", "disk")
        wait_tier(quick_disk_server, sbx.sandbox_id, "disk")
        assert Sandbox.get_info(sbx.sandbox_id, **opts).state.value == "paused"  # the tier is ours
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=300, **opts)
        assert_state_continues(resumed, before)
        assert tier(quick_disk_server, sbx.sandbox_id) == ("running", None)
        # A second round starts frozen again and thaws in place.
        resumed.pause()
        # The one-second idle timer may already be moving it; the pause itself froze it.
        assert tier(quick_disk_server, sbx.sandbox_id)[1] in ("frozen", "moving", "disk")
        assert log_messages(quick_disk_server, sbx.sandbox_id).count("sandbox paused (frozen)") == 2
        again = Sandbox.connect(sbx.sandbox_id, timeout=300, **opts)
        assert_state_continues(again, before)
    finally:
        sbx.kill()
    assert wait_no_host_resources(sbx.sandbox_id) == []


def test_frozen_pause_thaws_in_place(frozen_server: ServerProcess) -> None:
    opts = frozen_server.sdk_opts
    sbx = Sandbox.create(timeout=300, **opts)
    try:
        before = start_state(sbx)
        sbx.pause()
        assert tier(frozen_server, sbx.sandbox_id) == ("paused", "frozen")
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=300, **opts)
        assert_state_continues(resumed, before)
        messages = log_messages(frozen_server, sbx.sandbox_id)
        assert "sandbox paused (frozen)" in messages and "sandbox resumed (frozen)" in messages
    finally:
        sbx.kill()
    assert wait_no_host_resources(sbx.sandbox_id) == []


def test_killing_a_frozen_sandbox_frees_everything(frozen_server: ServerProcess) -> None:
    opts = frozen_server.sdk_opts
    sbx = Sandbox.create(timeout=300, **opts)
    sbx.pause()
    assert tier(frozen_server, sbx.sandbox_id) == ("paused", "frozen")
    assert Sandbox.kill(sbx.sandbox_id, **opts) is True
    assert wait_no_host_resources(sbx.sandbox_id) == []


def test_kill9_of_a_frozen_sandbox_is_noticed(frozen_server: ServerProcess) -> None:
    """A frozen sandbox's processes live on, so they can die (a SIGKILL, the OOM killer; under
    cgroup v1 the signal lands when they are thawed). Then its memory is lost: it is reported
    gone, with its resources freed, at once (cgroup v2) or on the resume that thaws it (v1),
    which fails with E2B's not-found rather than hanging or claiming success."""
    opts = frozen_server.sdk_opts
    sbx = Sandbox.create(timeout=300, **opts)
    sbx.pause()
    assert tier(frozen_server, sbx.sandbox_id) == ("paused", "frozen")
    os.kill(runsc_sandbox_pid(sbx.sandbox_id), signal.SIGKILL)
    time.sleep(1)
    try:
        gone_while_frozen = Sandbox.get_info(sbx.sandbox_id, **opts).state.value != "paused"
    except NotFoundException:
        gone_while_frozen = True
    if not gone_while_frozen:  # cgroup v1: the kill waits for the thaw
        with pytest.raises(NotFoundException):
            Sandbox.connect(sbx.sandbox_id, timeout=300, **opts)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **opts)
    assert wait_no_host_resources(sbx.sandbox_id, timeout=5) == []
    assert any("died" in m for m in log_messages(frozen_server, sbx.sandbox_id))


def test_server_kill_9_with_sandboxes_in_every_tier_loses_and_leaks_nothing() -> None:
    """running, frozen and on disk across a kill -9 of the server: each comes back as it was."""
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with serve(prefix="forkyard-tiers-", extra_env={"FORKYARD_PAUSE_DISK_AFTER_SECONDS": "1"}) as first:
        opts = first.sdk_opts
        on_disk = Sandbox.create(timeout=600, **opts)
        disk_state = start_state(on_disk)
        on_disk.pause()
        wait_tier(first, on_disk.sandbox_id, "disk")
        first.kill_hard()
        # Same data dir, a server that keeps frozen sandboxes frozen for long.
        second = start_server(
            first.data_dir,
            port=first.port,
            api_key=first.api_key,
            extra_env={"FORKYARD_PAUSE_DISK_AFTER_SECONDS": "600"},
        )
        try:
            running = Sandbox.create(timeout=600, **opts)
            running_state = start_state(running)
            frozen = Sandbox.create(timeout=600, **opts)
            frozen_state = start_state(frozen)
            frozen.pause()
            assert tier(second, frozen.sandbox_id) == ("paused", "frozen")
            second.kill_hard()
            third = start_server(
                first.data_dir,
                port=first.port,
                api_key=first.api_key,
                extra_env={"FORKYARD_PAUSE_DISK_AFTER_SECONDS": "600"},
            )
            try:
                assert tier(third, on_disk.sandbox_id) == ("paused", "disk")
                assert tier(third, frozen.sandbox_id) == ("paused", "frozen")
                assert tier(third, running.sandbox_id) == ("running", None)
                assert_state_continues(
                    Sandbox.connect(running.sandbox_id, timeout=600, **opts), running_state
                )
                assert_state_continues(Sandbox.connect(frozen.sandbox_id, timeout=600, **opts), frozen_state)
                assert_state_continues(Sandbox.connect(on_disk.sandbox_id, timeout=600, **opts), disk_state)
                ids = [running.sandbox_id, frozen.sandbox_id, on_disk.sandbox_id]
                for sid in ids:
                    assert Sandbox.kill(sid, **opts) is True
                for sid in ids:
                    assert wait_no_host_resources(sid) == []
            finally:
                kill_all_sandboxes(third)
                third.stop()
        finally:
            kill_all_sandboxes(second)  # nothing when it is already down
            second.stop()


def _wait_state(sbx: Sandbox, wanted: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while (state := str(sbx.get_info().state.value)) != wanted:
        assert time.monotonic() < deadline, f"{sbx.sandbox_id} never became {wanted}: {state}"
        time.sleep(0.2)


def test_auto_resume_on_traffic_and_on_sdk_calls(forkyard_server: ServerProcess) -> None:
    """E2B's ``lifecycle={"on_timeout": "pause", "auto_resume": True}``: a request to one of the
    paused sandbox's ports, or an SDK call to its envd, resumes it with the timeout it was created
    with, counted from the resume; without ``auto_resume`` it stays paused (E2B's suite:
    test_auto_resume_wakes_on_http_request)."""
    sbx = Sandbox.create("base", timeout=4, lifecycle={"on_timeout": "pause", "auto_resume": True})
    plain = Sandbox.create("base", timeout=4, lifecycle={"on_timeout": "pause"})
    try:
        sbx.commands.run("python3 -m http.server 8000 >/dev/null 2>&1", background=True)
        _wait_state(sbx, "paused")
        _wait_state(plain, "paused")
        route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
        woken = httpx.get(forkyard_server.url + "/", headers=route, timeout=30)
        assert woken.status_code == 200 and "Directory listing" in woken.text
        info = sbx.get_info()
        assert str(info.state.value) == "running"
        left = (info.end_at - dt.datetime.now(dt.UTC)).total_seconds()
        assert 0 < left <= 4.5, f"the resumed timeout is the created one (4 s), not {left:.1f} s"
        _wait_state(sbx, "paused")  # that timeout pauses it again
        assert sbx.commands.run("echo awake").stdout == "awake\n"  # an SDK call wakes it too
        stays = {"E2b-Sandbox-Id": plain.sandbox_id, "E2b-Sandbox-Port": "49983"}
        assert httpx.get(forkyard_server.url + "/health", headers=stays, timeout=30).status_code == 502
        assert str(plain.get_info().state.value) == "paused"
    finally:
        sbx.kill()
        plain.kill()
