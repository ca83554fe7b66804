"""The operators' CLI through its real entry point (``.venv/bin/forkyard``, a subprocess with the
SDKs' variables) against a real ``forkyard serve`` on gVisor: list, kill, exec, logs, connect (a
scripted session on a real pseudo-terminal via pexpect), snapshots and node status."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest
from e2b import Sandbox

from tests.support.server import ServerProcess

FORKYARD = str(Path(sys.executable).with_name("forkyard"))


def cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FORKYARD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def tag() -> str:
    return "cli-" + secrets.token_hex(4)


@pytest.fixture(scope="module")
def pair(forkyard_server: ServerProcess, tag: str) -> Iterator[list[Sandbox]]:
    boxes = [Sandbox.create(timeout=300, metadata={"suite": tag, "n": str(i)}) for i in range(2)]
    try:
        yield boxes
    finally:
        for box in boxes:
            box.kill()


def test_list_filters_by_metadata_and_state(pair: list[Sandbox], tag: str) -> None:
    out = cli("sandbox", "list", "--json", "--metadata", f"suite={tag}")
    assert out.returncode == 0, out.stderr
    assert sorted(s["sandboxID"] for s in json.loads(out.stdout)) == sorted(b.sandbox_id for b in pair)
    one = cli("sandbox", "list", "--json", "-m", f"suite={tag}", "-m", "n=1")
    assert [s["sandboxID"] for s in json.loads(one.stdout)] == [pair[1].sandbox_id]
    paused = cli("sandbox", "list", "--json", "--state", "paused", "-m", f"suite={tag}")
    assert json.loads(paused.stdout) == []
    table = cli("sandbox", "list", "-m", f"suite={tag}")
    assert table.returncode == 0 and pair[0].sandbox_id in table.stdout and "running" in table.stdout
    bad = cli("sandbox", "list", "--state", "asleep")
    assert bad.returncode == 2 and "asleep" in bad.stderr


def test_exec_streams_output_and_passes_the_exit_code(pair: list[Sandbox]) -> None:
    sid = pair[0].sandbox_id
    out = cli("sandbox", "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (out.returncode, out.stdout, out.stderr) == (7, "out\n", "err\n")
    ok = cli("sandbox", "exec", sid, "-e", "WHO=cli", "--", "echo $WHO $(id -un)")
    assert (ok.returncode, ok.stdout) == (0, "cli user\n")


def test_connect_is_an_interactive_terminal(pair: list[Sandbox]) -> None:
    child = pexpect.spawn(
        FORKYARD,
        ["sandbox", "connect", pair[0].sandbox_id],
        env=dict(os.environ),
        timeout=60,
        dimensions=(24, 80),
    )
    try:
        child.expect(r"\$ ")  # bash's prompt, on the sandbox's PTY
        child.sendline("echo pty-$((6*7)) && tty")
        child.expect("pty-42")
        child.expect("/dev/pts/")
        child.setwinsize(30, 100)  # SIGWINCH to the CLI, which resizes the remote PTY
        time.sleep(0.5)
        child.sendline("stty size")
        child.expect("30 100")
        child.expect(r"\$ ")
        child.sendcontrol("c")  # raw mode: Ctrl-C reaches the remote shell, not the CLI
        # The new prompt first: typed before bash handled the interrupt, the next line's first
        # characters were discarded with the interrupted one ("cho: command not found", CI).
        child.expect(r"\$ ")
        child.sendline("echo still-$((1+1))")
        child.expect("still-2")
        child.sendline("exit 3")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 3


def test_snapshot_list_and_delete(pair: list[Sandbox]) -> None:
    snap = pair[1].create_snapshot()
    listed = cli("snapshot", "list", "--json", "--sandbox", pair[1].sandbox_id)
    assert listed.returncode == 0, listed.stderr
    assert snap.snapshot_id in [s["snapshotID"] for s in json.loads(listed.stdout)]
    gone = cli("snapshot", "delete", snap.snapshot_id)
    assert gone.returncode == 0, gone.stderr
    again = cli("snapshot", "delete", snap.snapshot_id)
    assert again.returncode == 1 and "not found" in again.stderr and "Traceback" not in again.stderr


def test_node_status(pair: list[Sandbox]) -> None:
    out = cli("node", "status", "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["runtime"] == "gvisor" and status["platform"] in ("ptrace", "systrap", "kvm")
    assert status["sandboxes"]["byState"].get("running", 0) >= 2
    assert status["capacity"]["memoryTotalMiB"] > 0 and status["capacity"]["allocatedCpuCount"] >= 2
    assert sum(v["count"] for k, v in status["lifecycle"].items() if k.split("/")[0] == "create") >= 2
    text = cli("node", "status")
    assert text.returncode == 0 and "gvisor" in text.stdout and "sandboxes" in text.stdout


def test_logs_follow_ends_when_killed_and_kill_by_metadata(pair: list[Sandbox], tag: str) -> None:
    first, second = pair
    logs = cli("sandbox", "logs", first.sandbox_id)
    assert logs.returncode == 0 and "INFO" in logs.stdout, logs.stderr
    follower = subprocess.Popen(
        [FORKYARD, "sandbox", "logs", "--follow", first.sandbox_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2)
        assert follower.poll() is None  # following
        killed = cli("sandbox", "kill", first.sandbox_id)
        assert killed.returncode == 0 and f"killed {first.sandbox_id}" in killed.stdout
        out, err = follower.communicate(timeout=30)  # ends by itself once the sandbox is gone
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, err
    assert "sandbox killed" in out
    by_meta = cli("sandbox", "kill", "--metadata", f"suite={tag}")
    assert by_meta.returncode == 0 and f"killed {second.sandbox_id}" in by_meta.stdout
    assert json.loads(cli("sandbox", "list", "--json", "-m", f"suite={tag}").stdout) == []


def test_errors_are_e2b_messages_not_tracebacks(forkyard_server: ServerProcess) -> None:
    missing = cli("sandbox", "kill", "inoexist0000000000000")
    assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "not found" in missing.stderr
    assert "Traceback" not in missing.stderr
    exec_missing = cli("sandbox", "exec", "inoexist0000000000000", "--", "true")
    assert exec_missing.returncode == 1 and "Traceback" not in exec_missing.stderr
    bad_key = cli("sandbox", "list", env={"E2B_API_KEY": "e2b_wrong"})
    assert bad_key.returncode == 1 and "invalid API key" in bad_key.stderr
    down = cli("node", "status", env={"E2B_API_URL": "http://127.0.0.1:9"})
    assert down.returncode == 1 and "cannot reach the API" in down.stderr
    no_template = cli("template", "delete", "no-such-template")
    assert no_template.returncode == 1 and no_template.stderr.startswith("error: no-such-template: ")
    base = cli("template", "delete", "base")  # refused (403): every sandbox's parent
    assert base.returncode == 1 and "Traceback" not in base.stderr
    usage = cli("sandbox", "kill", "--metadata", "novalue")
    assert usage.returncode == 2
