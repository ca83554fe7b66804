"""Pause/resume, snapshots and fork through the official ``e2b`` SDK against a real
``forkyard serve`` with the real gVisor runtime (runsc checkpoint/restore)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2b import Sandbox

from tests.support import base_template_missing
from tests.support.counter import assert_counter_runs, assert_state_continues, start_state
from tests.support.counter import read_counter as counter
from tests.support.leaks import wait_no_host_resources
from tests.support.server import ServerProcess, kill_all_sandboxes, serve, start_server


@pytest.fixture()
def parent(forkyard_server: ServerProcess) -> Iterator[Sandbox]:
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


def test_snapshot_then_three_sandboxes_see_the_state(parent: Sandbox, forkyard_server: ServerProcess) -> None:
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
    snapshots_dir = forkyard_server.data_dir / "snapshots"
    assert not (snapshots_dir / snap.snapshot_id).exists()


GROUP = 4


def test_groups_from_one_snapshot_claim_standbys_sized_to_the_group(
    parent: Sandbox, forkyard_server: ServerProcess
) -> None:
    """A trainer's step: a group created at once from one start state. The first group restores
    and sizes the snapshot's standbys (2 by default); the next claims one for every member, each
    with its own copy of the state."""
    parent.files.write("/home/user/task.txt", "start")
    snap = parent.create_snapshot()

    def group() -> list[Sandbox]:
        with ThreadPoolExecutor(GROUP) as pool:
            return list(pool.map(lambda _: Sandbox.create(snap.snapshot_id, timeout=120), range(GROUP)))

    members: list[Sandbox] = []
    try:
        members += group()
        for member in members:
            member.kill()
        full = re.compile(rf"warm pool {snap.snapshot_id}: \S+ ready in \d+ ms \({GROUP}/{GROUP}\)")
        deadline = time.monotonic() + 180
        while not full.search(forkyard_server.log_tail(1 << 20)):
            assert time.monotonic() < deadline, f"no {GROUP} standbys:\n{forkyard_server.log_tail()}"
            time.sleep(0.2)
        second = group()
        members += second
        for member in second:
            assert "from a standby of" in sandbox_log_messages(forkyard_server, member.sandbox_id)
            assert member.files.read("/home/user/task.txt") == "start"
        second[0].files.write("/home/user/task.txt", "member-0")
        assert second[1].files.read("/home/user/task.txt") == "start"
    finally:
        for member in members:
            with contextlib.suppress(Exception):
                member.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)


def test_a_restored_sandbox_keeps_its_captured_login(parent: Sandbox) -> None:
    """envd captures the login once (docs/LATENCY.md); a restore renumbers the overlay's inodes
    and a file written in the home changes its times, neither of which is what the profile read:
    the child's very first command starts without the profile (``--noprofile``), not through a
    ``bash -l`` of its own beside a new capture (that cost 50-100 ms per first command here)."""
    show_cmdline = "line=$(tr '\\0' ' ' < /proc/$$/cmdline); echo \"$line\""
    for _ in range(3):  # the default user's login is captured in the background at start-up
        if "--noprofile" in parent.commands.run(show_cmdline).stdout:
            break
        time.sleep(0.5)
    parent.files.write("/home/user/work.txt", "written next to .profile")
    snap = parent.create_snapshot()
    child = Sandbox.create(snap.snapshot_id, timeout=120)
    try:
        first = child.commands.run(show_cmdline).stdout
        assert "--noprofile" in first, first
        assert child.files.read("/home/user/work.txt") == "written next to .profile"
    finally:
        child.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)


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


def test_fork_without_a_timeout_hands_back_children_whose_timeout_starts_now(parent: Sandbox) -> None:
    """The API's default fork timeout (15 s) counts from when the caller gets the children, not
    from each child's own restore (a fork of many took longer than that, and its first children
    expired before the call returned)."""
    start_state(parent)
    results = parent.fork(count=4)
    returned = dt.datetime.now(dt.UTC)
    children = [c for c in results if isinstance(c, Sandbox)]
    assert len(children) == 4, [str(e) for e in results if not isinstance(e, Sandbox)]
    try:
        for child in children:
            end_at = Sandbox.get_info(child.sandbox_id).end_at
            assert end_at >= returned + dt.timedelta(seconds=14), (end_at, returned)
            assert child.files.read("/home/user/state.txt") == "parent-state"
    finally:
        for child in children:
            child.kill()


# -- server restarts ----------------------------------------------------------------------------


def own_server(prefix: str, extra_env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A server of a test's own in a throw-away data dir; its sandboxes are killed afterwards."""
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with serve(prefix=prefix, extra_env=extra_env) as server:
        yield server


@pytest.fixture()
def private_server() -> Iterator[ServerProcess]:
    """A server of our own (tests restart and kill -9 it)."""
    yield from own_server("forkyard-snap-")


def sdk_opts(server: ServerProcess) -> dict[str, str]:
    return server.sdk_opts


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


#: What a test interrupts with kill -9: (request path, JSON body, seconds into the request).
INTERRUPTED = {
    "pause": ("pause", None, 0.2),  # inside the checkpoint (0.3-0.7 s on this runsc)
    "snapshot": ("snapshots", {}, 0.2),  # checkpoint, seal or the parent's restore
    "fork": ("fork", {"count": 4}, 0.0),  # children restoring (waits for the commit)
}


def fork_committed(server: ServerProcess) -> bool:
    db = sqlite3.connect(server.data_dir / "forkyard.sqlite3", timeout=5)
    try:
        return db.execute("SELECT 1 FROM snapshots WHERE kind = 'fork'").fetchone() is not None
    finally:
        db.close()


@pytest.fixture()
def disk_pause_server() -> Iterator[ServerProcess]:
    """A server of our own whose pauses checkpoint to disk at once (no frozen tier): a kill -9
    lands inside the checkpoint (tests/system/test_pause_tiers.py covers the frozen tier)."""
    yield from own_server("forkyard-snap-", {"FORKYARD_PAUSE_FREEZE": "false"})


@pytest.mark.parametrize("operation", sorted(INTERRUPTED))
def test_kill_9_mid_operation_keeps_committed_snapshots_and_leaks_nothing(
    disk_pause_server: ServerProcess, operation: str
) -> None:
    private_server = disk_pause_server
    opts = sdk_opts(private_server)
    sbx = Sandbox.create(timeout=300, **opts)
    start_state(sbx)
    committed = sbx.create_snapshot()
    path, body, delay = INTERRUPTED[operation]
    done = threading.Event()

    def interrupted_request() -> None:
        try:
            httpx.post(
                f"{private_server.url}/sandboxes/{sbx.sandbox_id}/{path}",
                json=body,
                headers={"X-API-Key": private_server.api_key},
                timeout=60,
            )
        except httpx.HTTPError:
            pass
        done.set()

    threading.Thread(target=interrupted_request, daemon=True).start()
    if operation == "fork":
        # Right after the fork's checkpoint is committed: the parent is stopped, children restore.
        deadline = time.monotonic() + 30
        while not fork_committed(private_server):
            assert time.monotonic() < deadline, "the fork's checkpoint was never committed"
            time.sleep(0.005)
    else:
        time.sleep(delay)
    private_server.kill_hard()
    done.wait(30)
    restarted = start_server(
        private_server.data_dir, port=private_server.port, api_key=private_server.api_key
    )
    try:
        # The committed snapshot is intact and usable.
        names = {s.snapshot_id for s in Sandbox.list_snapshots(**opts).next_items()}
        assert committed.snapshot_id in names
        db = sqlite3.connect(private_server.data_dir / "forkyard.sqlite3")
        states = dict(db.execute("SELECT sandbox_id, state FROM sandboxes").fetchall())
        registered = dict(db.execute("SELECT snapshot_id, kind FROM snapshots").fetchall())
        db.close()
        # Every snapshot directory on disk is a committed registry row: the interrupted
        # operation left none behind (a pause may also have committed just before the kill).
        leftovers = {p.name for p in (private_server.data_dir / "snapshots").iterdir()}
        assert leftovers == set(registered)
        assert registered[committed.snapshot_id] == "snapshot"
        pauses = [sid for sid, kind in registered.items() if kind == "pause"]
        assert len(pauses) == (1 if states[sbx.sandbox_id] == "paused" else 0), (states, registered)
        # No sandbox leaked: each one is live and answering, paused, or gone without a trace.
        for sandbox_id, state in states.items():
            if state == "running":
                assert Sandbox.connect(sandbox_id, **opts).commands.run("echo up").stdout.strip() == "up"
            elif state != "paused":
                assert state == "killed", (sandbox_id, state)
                assert wait_no_host_resources(sandbox_id) == []
        if operation == "fork":  # the parent was stopped by the fork: recovery restored it
            assert states[sbx.sandbox_id] == "running"
            parent = Sandbox.connect(sbx.sandbox_id, **opts)
            assert parent.files.read("/home/user/state.txt") == "parent-state"
            assert_counter_runs(parent)
        child = Sandbox.create(committed.snapshot_id, timeout=120, **opts)
        assert child.files.read("/home/user/state.txt") == "parent-state"
        child.kill()
        assert wait_no_host_resources(child.sandbox_id) == []
    finally:
        kill_all_sandboxes(restarted)
        restarted.stop()


# -- incremental snapshots, templates as snapshots, warm pools, auto-pause -----------------------


def snapshot_layers(server: ServerProcess, snapshot_id: str) -> list[str]:
    meta = json.loads((server.data_dir / "snapshots" / snapshot_id / "meta.json").read_text())
    return list(meta["layers"])


def layer_bytes(server: ServerProcess, layer_id: str) -> int:
    root = server.data_dir / "disk-layers" / layer_id
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*"))


def test_incremental_snapshots_chain_and_survive_deleting_ancestors(forkyard_server: ServerProcess) -> None:
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.commands.run("head -c 8388608 /dev/urandom > /home/user/big && echo one > /home/user/a.txt")
        s1 = sbx.create_snapshot()
        sbx.commands.run("rm /home/user/big && echo two > /home/user/b.txt")
        s2 = sbx.create_snapshot()
        sbx.files.write("/home/user/c.txt", "three")
        s3 = sbx.create_snapshot()
        chain1, chain2, chain3 = (snapshot_layers(forkyard_server, s.snapshot_id) for s in (s1, s2, s3))
        # Each snapshot adds one layer on top of its parent's chain, holding only what changed.
        assert chain2[1:] == chain1 and chain3[1:] == chain2
        assert layer_bytes(forkyard_server, chain1[0]) >= 8 << 20
        assert layer_bytes(forkyard_server, chain2[0]) < 1 << 20  # a whiteout and a small file
        assert layer_bytes(forkyard_server, chain3[0]) < 1 << 20
        # Deleting the ancestors never breaks a descendant: its layers stay while it needs them.
        assert Sandbox.delete_snapshot(s1.snapshot_id) and Sandbox.delete_snapshot(s2.snapshot_id)
        assert all((forkyard_server.data_dir / "disk-layers" / lid).is_dir() for lid in chain3)
        child = Sandbox.create(s3.snapshot_id, timeout=120)
        try:
            listing = child.commands.run(
                "cat /home/user/a.txt /home/user/b.txt /home/user/c.txt; echo; "
                "test -e /home/user/big || echo gone"
            ).stdout
            assert listing.split() == ["one", "two", "three", "gone"]
            child.files.write("/home/user/c.txt", "child")  # into the child's own upper
            assert sbx.files.read("/home/user/c.txt") == "three"
        finally:
            child.kill()
    finally:
        sbx.kill()
    assert Sandbox.delete_snapshot(s3.snapshot_id)
    # Nothing references the three layers any more: they are freed (in the background).
    deadline = time.monotonic() + 15
    while any((forkyard_server.data_dir / "disk-layers" / lid).exists() for lid in chain3[:3]):
        assert time.monotonic() < deadline, "unused disk layers were not freed"
        time.sleep(0.2)


#: What the server logs for each sandbox it puts into a warm pool.
POOLED = " ready in "
#: ... into ``base``'s pool (the shared template cache may hold other templates, pooled too).
BASE_POOLED = re.compile(r"warm pool \w+:base:\S+: \S+ ready in ")


def wait_for_base_pool(server: ServerProcess, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(BASE_POOLED.findall(server.log_tail(1 << 20))) < count:
        assert time.monotonic() < deadline, f"base's pool never had {count}:\n{server.log_tail()}"
        time.sleep(0.25)


def test_deep_snapshot_chains_are_squashed(forkyard_server: ServerProcess) -> None:
    """Past MAX_CHAIN layers the oldest are merged into one; files written, overwritten and
    deleted across the rounds (whiteouts) come out as they were."""
    from forkyard.runtime.gvisor.checkpoint import MAX_CHAIN

    sbx = Sandbox.create(timeout=600)
    try:
        sbx.files.write("/home/user/keep.txt", "kept")
        last = None
        for i in range(MAX_CHAIN + 2):
            sbx.commands.run(
                f"rm -f /home/user/round-{i - 1}; echo {i} > /home/user/round-{i}; "
                f"echo {i} > /home/user/counter"
            )
            last = sbx.create_snapshot()
        assert last is not None
        chain = snapshot_layers(forkyard_server, last.snapshot_id)
        assert len(chain) <= MAX_CHAIN
        child = Sandbox.create(last.snapshot_id, timeout=120)
        try:
            # A glob keeps this independent of coreutils (ls and stat are tested in test_sdk).
            result = child.commands.run("cd /home/user && echo round-* && cat counter keep.txt")
            assert result.stdout.split() == [f"round-{MAX_CHAIN + 1}", str(MAX_CHAIN + 1), "kept"]
        finally:
            child.kill()
    finally:
        sbx.kill()


def wait_for_log(server: ServerProcess, text: str, count: int = 1, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while server.log_tail(1 << 20).count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} x{count} not in the server log:\n{server.log_tail()}"
        time.sleep(0.25)


def sandbox_log_messages(server: ServerProcess, sandbox_id: str) -> str:
    db = sqlite3.connect(server.data_dir / "forkyard.sqlite3")
    try:
        rows = db.execute("SELECT message FROM sandbox_logs WHERE sandbox_id = ?", (sandbox_id,)).fetchall()
    finally:
        db.close()
    return "\n".join(r[0] for r in rows)


@pytest.fixture()
def pooled_server() -> Iterator[ServerProcess]:
    """A server that snapshots ``base`` at start-up and keeps 1-2 restored sandboxes ready."""
    yield from own_server(
        "forkyard-pool-",
        {
            "FORKYARD_WARM_POOL_TEMPLATES": '["base"]',
            "FORKYARD_WARM_POOL_LOW": "1",
            "FORKYARD_WARM_POOL_HIGH": "2",
        },
    )


def test_template_create_claims_warm_pool_sandboxes(pooled_server: ServerProcess) -> None:
    opts = sdk_opts(pooled_server)
    wait_for_base_pool(pooled_server, count=2)  # two restored sandboxes ready
    a = Sandbox.create("base", timeout=120, envs={"RUN": "a"}, **opts)
    b = Sandbox.create("base", timeout=120, envs={"RUN": "b"}, secure=True, **opts)
    try:
        for sbx, run in ((a, "a"), (b, "b")):
            assert "warm pool" in sandbox_log_messages(pooled_server, sbx.sandbox_id)
            assert sbx.commands.run("echo $RUN").stdout.strip() == run  # the create's envs, via /init
            assert Sandbox.get_info(sbx.sandbox_id, **opts).template_id == "base"
        # Independent sandboxes although restored from one image.
        a.files.write("/home/user/who", "a")
        assert b.commands.run("test -e /home/user/who || echo absent").stdout.strip() == "absent"
        # The secured one requires its own token: a request without it is refused.
        assert b._envd_access_token
        url = f"{pooled_server.url}/files?path=/etc/hostname"
        refused = httpx.get(url, headers={"E2b-Sandbox-Id": b.sandbox_id, "E2b-Sandbox-Port": "49983"})
        assert refused.status_code == 401, refused.text
        # The pool refills behind the claims.
        wait_for_base_pool(pooled_server, count=4)
    finally:
        a.kill()
        b.kill()
    for sbx in (a, b):
        assert wait_no_host_resources(sbx.sandbox_id) == []


def test_private_traffic_is_kept_by_pooled_and_snapshot_creates(pooled_server: ServerProcess) -> None:
    """A create asking for private traffic gets a traffic token whichever way it is made."""
    opts = sdk_opts(pooled_server)
    wait_for_log(pooled_server, POOLED, count=1)
    private = {"allow_public_traffic": False}
    pooled = Sandbox.create("base", timeout=120, network=private, **opts)  # type: ignore[arg-type]
    snap = pooled.create_snapshot()
    restored = Sandbox.create(snap.snapshot_id, timeout=120, network=private, **opts)  # type: ignore[arg-type]
    try:
        assert "warm pool" in sandbox_log_messages(pooled_server, pooled.sandbox_id)
        for sbx in (pooled, restored):
            token = sbx.traffic_access_token
            assert token
            headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
            refused = httpx.get(f"{pooled_server.url}/", headers=headers, timeout=30)
            assert refused.status_code == 403, refused.text
            admitted = httpx.get(
                f"{pooled_server.url}/", timeout=30, headers={**headers, "e2b-traffic-access-token": token}
            )
            assert admitted.status_code != 403  # past the token check (nothing listens on 8000)
    finally:
        restored.kill()
        pooled.kill()
        Sandbox.delete_snapshot(snap.snapshot_id, **opts)


def test_server_stop_leaves_no_pooled_sandbox(pooled_server: ServerProcess) -> None:
    wait_for_log(pooled_server, POOLED, count=2)
    pooled = re.findall(r"(\S+) ready in ", pooled_server.log_tail(1 << 20))
    assert pooled
    pooled_server.stop()
    for sandbox_id in pooled:
        assert wait_no_host_resources(sandbox_id) == []


def test_auto_pause_on_timeout_then_resume(forkyard_server: ServerProcess) -> None:
    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause"})
    before = start_state(sbx)
    deadline = time.monotonic() + 60
    while Sandbox.get_info(sbx.sandbox_id).state.value != "paused":
        assert time.monotonic() < deadline, "the sandbox was not paused on its timeout"
        time.sleep(0.5)
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    try:
        assert_state_continues(resumed, before)
    finally:
        resumed.kill()


def test_fork_64_on_one_node(forkyard_server: ServerProcess) -> None:
    """The SDKs cap ``count`` at 20 per call; the API takes up to 100 (openapi.yml)."""
    parent = Sandbox.create(timeout=600)
    children: list[Sandbox] = []
    try:
        parent.files.write("/home/user/state.txt", "parent-state")
        started = time.monotonic()
        response = httpx.post(
            f"{forkyard_server.url}/sandboxes/{parent.sandbox_id}/fork",
            json={"count": 64, "timeout": 600},
            headers={"X-API-Key": forkyard_server.api_key},
            timeout=900,
        )
        assert response.status_code == 201, response.text
        results = response.json()
        print(f"fork 64: {time.monotonic() - started:.1f} s")
        assert len(results) == 64
        assert [r["error"] for r in results if r.get("error")] == []
        children = [Sandbox.connect(r["sandbox"]["sandboxID"], timeout=600) for r in results]
        assert len({c.sandbox_id for c in children}) == 64
        for i, child in enumerate(children):
            assert (
                child.commands.run(f"cat /home/user/state.txt; echo -{i} >> /home/user/state.txt").stdout
                == "parent-state"
            )
        assert parent.files.read("/home/user/state.txt") == "parent-state"
        assert children[7].files.read("/home/user/state.txt") == "parent-state-7\n"
    finally:
        for child in children:
            child.kill()
        parent.kill()
    for child in children:
        assert wait_no_host_resources(child.sandbox_id) == []
