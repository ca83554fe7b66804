"""Pause/resume, snapshots and fork through the official ``e2b`` SDK against a real
``agentenv serve`` with the real gVisor runtime (runsc checkpoint/restore)."""

from __future__ import annotations

import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2e_fixtures import *  # noqa: F403  (the agentenv_server fixture)
from e2e_fixtures import (
    ServerProcess,
    base_template_missing,
    kill_all_sandboxes,
    start_server,
    wait_no_host_resources,
)

# Written by rename, so a reader never sees a truncated file.
COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; "
    "mv /tmp/counter.new /tmp/counter; sleep 0.1; done' >/dev/null 2>&1 &"
)


def counter(sbx: Sandbox) -> int:
    return int(sbx.commands.run("cat /tmp/counter").stdout.strip())


def start_state(sbx: Sandbox) -> int:
    """A file on disk and a counter process in memory; returns the counter's value."""
    sbx.files.write("/home/user/state.txt", "parent-state")
    sbx.commands.run(COUNTER)
    time.sleep(0.5)
    return counter(sbx)


def assert_state_continues(sbx: Sandbox, before: int) -> None:
    assert sbx.files.read("/home/user/state.txt") == "parent-state"
    first = counter(sbx)
    assert first >= before  # the process came back with its memory, not restarted from 0
    time.sleep(0.4)
    assert counter(sbx) > first  # ... and keeps running


@pytest.fixture()
def parent(agentenv_server: ServerProcess) -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=300)
    try:
        yield sbx
    finally:
        sbx.kill()


def test_pause_resume_keeps_file_and_process(parent: Sandbox) -> None:
    before = start_state(parent)
    assert parent.pause() is True
    info = Sandbox.get_info(parent.sandbox_id)
    assert info.state.value == "paused"
    assert parent.pause() is False  # already paused: 409 -> False
    resumed = Sandbox.connect(parent.sandbox_id, timeout=300)
    assert_state_continues(resumed, before)
    assert Sandbox.get_info(parent.sandbox_id).state.value == "running"


def test_snapshot_then_three_sandboxes_see_the_state(parent: Sandbox, agentenv_server: ServerProcess) -> None:
    before = start_state(parent)
    snap = parent.create_snapshot()
    assert snap.snapshot_id
    assert any(s.snapshot_id == snap.snapshot_id for s in Sandbox.list_snapshots().next_items())
    assert counter(parent) >= before  # the parent keeps running
    children = [Sandbox.create(snap.snapshot_id, timeout=120) for _ in range(3)]
    try:
        for child in children:
            assert_state_continues(child, before)
        children[0].files.write("/home/user/state.txt", "child-0")
        assert children[1].files.read("/home/user/state.txt") == "parent-state"
        assert parent.files.read("/home/user/state.txt") == "parent-state"
    finally:
        for child in children:
            child.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    snapshots_dir = agentenv_server.data_dir / "snapshots"
    assert not (snapshots_dir / snap.snapshot_id).exists()


def test_fork_16_children_diverge_and_survive_the_parent(parent: Sandbox) -> None:
    before = start_state(parent)
    started = time.monotonic()
    results = parent.fork(count=16, timeout=900)
    print(f"fork 16: {time.monotonic() - started:.2f} s")
    children = [c for c in results if isinstance(c, Sandbox)]
    assert len(children) == 16, [str(e) for e in results if not isinstance(e, Sandbox)]
    try:
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 16 and parent.sandbox_id not in ids
        for i, child in enumerate(children):
            assert child.files.read("/home/user/state.txt") == "parent-state"
            assert counter(child) >= before
            child.files.write("/home/user/state.txt", f"child-{i}")
        for i, child in enumerate(children):
            assert child.files.read("/home/user/state.txt") == f"child-{i}"
        assert parent.files.read("/home/user/state.txt") == "parent-state"
        parent.kill()
        for child in children:
            assert_counter_runs(child)
    finally:
        for child in children:
            child.kill()
        for child in children:
            assert wait_no_host_resources(child.sandbox_id) == []


def assert_counter_runs(sbx: Sandbox) -> None:
    first = counter(sbx)
    time.sleep(0.3)
    assert counter(sbx) > first


# -- server restarts ----------------------------------------------------------------------------


@pytest.fixture()
def private_server() -> Iterator[ServerProcess]:
    """A server of our own (tests restart and kill -9 it)."""
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="agentenv-snap-") as tmp:
        server = start_server(Path(tmp) / "data")
        holder = [server]
        try:
            yield server
        finally:
            live = holder[0]
            kill_all_sandboxes(live)
            live.stop()


def sdk_opts(server: ServerProcess) -> dict[str, str]:
    return {"api_key": server.api_key, "api_url": server.url, "sandbox_url": server.url}


def test_paused_sandbox_survives_server_restart(private_server: ServerProcess) -> None:
    opts = sdk_opts(private_server)
    sbx = Sandbox.create(timeout=300, **opts)
    before = start_state(sbx)
    sbx.pause()
    private_server.stop()
    restarted = start_server(
        private_server.data_dir, port=private_server.port, api_key=private_server.api_key
    )
    try:
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=300, **opts)
        assert_state_continues(resumed, before)
        resumed.kill()
        assert wait_no_host_resources(sbx.sandbox_id) == []
    finally:
        kill_all_sandboxes(restarted)
        restarted.stop()


def test_kill_9_mid_pause_keeps_committed_snapshots_and_leaks_nothing(private_server: ServerProcess) -> None:
    opts = sdk_opts(private_server)
    sbx = Sandbox.create(timeout=300, **opts)
    start_state(sbx)
    committed = sbx.create_snapshot()
    done = threading.Event()

    def pause() -> None:
        try:
            httpx.post(f"{private_server.url}/sandboxes/{sbx.sandbox_id}/pause",
                       headers={"X-API-Key": private_server.api_key}, timeout=60)
        except httpx.HTTPError:
            pass
        done.set()

    threading.Thread(target=pause, daemon=True).start()
    time.sleep(0.2)  # inside the checkpoint (0.3-0.7 s on this runsc), most of the time
    private_server.kill_hard()
    done.wait(30)
    restarted = start_server(
        private_server.data_dir, port=private_server.port, api_key=private_server.api_key
    )
    try:
        # The committed snapshot is intact and usable; the interrupted pause left no snapshot dir.
        names = {s.snapshot_id for s in Sandbox.list_snapshots(**opts).next_items()}
        assert committed.snapshot_id in names
        db = sqlite3.connect(private_server.data_dir / "agentenv.sqlite3")
        row = db.execute("SELECT state FROM sandboxes WHERE sandbox_id = ?", (sbx.sandbox_id,)).fetchone()
        state = row[0]
        registered = dict(db.execute("SELECT snapshot_id, kind FROM snapshots").fetchall())
        db.close()
        # Every snapshot directory on disk is a committed registry row: an interrupted pause leaves
        # none behind. The pause may also have committed just before the kill (it is fast now):
        # then the sandbox is paused and its one pause snapshot is registered.
        leftovers = {p.name for p in (private_server.data_dir / "snapshots").iterdir()}
        assert leftovers == set(registered)
        pauses = [sid for sid, kind in registered.items() if kind == "pause"]
        assert registered[committed.snapshot_id] == "snapshot"
        assert len(pauses) == (1 if state == "paused" else 0), (state, registered)
        if state != "paused":  # interrupted before the commit: recovery removed the sandbox
            assert state == "killed"
            assert wait_no_host_resources(sbx.sandbox_id) == []
        child = Sandbox.create(committed.snapshot_id, timeout=120, **opts)
        assert child.files.read("/home/user/state.txt") == "parent-state"
        child.kill()
        assert wait_no_host_resources(child.sandbox_id) == []
    finally:
        kill_all_sandboxes(restarted)
        restarted.stop()
