"""The host leak check of two pytest sessions run side by side (scripts/test.sh): each counts the
sandbox processes it started, never the other's."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import leaks


@pytest.fixture
def fake_vmm(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]]]]:
    """A program the check takes for a VMM (named like QEMU), and the processes started from it."""
    program = tmp_path / "qemu-system-leakcheck"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", program)
    started: list[subprocess.Popen[bytes]] = []
    yield program, started
    for proc in started:
        proc.kill()
        proc.wait()


def _start(fake: tuple[Path, list[subprocess.Popen[bytes]]], session: str | None) -> int:
    program, started = fake
    env = {k: v for k, v in os.environ.items() if k != leaks.SESSION_ENV}
    if session is not None:
        env[leaks.SESSION_ENV] = session
    proc = subprocess.Popen([str(program), "60"], env=env)
    started.append(proc)
    return proc.pid


Fake = tuple[Path, list[subprocess.Popen[bytes]]]


def test_each_session_counts_its_own_processes(fake_vmm: Fake) -> None:
    mine = os.environ[leaks.SESSION_ENV]  # set by tests/conftest.py for every session
    ours, theirs = _start(fake_vmm, mine), _start(fake_vmm, "another-session")
    unmarked = _start(fake_vmm, None)

    seen = leaks.host_state().processes
    assert ours in seen and unmarked in seen  # unmarked: possibly ours (runsc may clear the env)
    assert theirs not in seen

    surely_ours = leaks.host_state(processes_only=True)
    assert set(surely_ours.processes) & {ours, theirs, unmarked} == {ours}
    assert surely_ours.netns == frozenset() and surely_ours.links == frozenset()


CONTAINER = "5984dfd9fb149ba7a811ab1c8ebc4cd3f8b8cbcf97d9bda76ecc8a5ed52a37e3"


@pytest.mark.parametrize(
    ("cgroup", "container"),
    [
        # cgroup v1, cgroupfs driver: a runsc-sandbox of a Compose node (its environment is empty).
        (
            f"8:pids:/docker/{CONTAINER}/forkyard/j3yzop9auy7b\n4:memory:/docker/{CONTAINER}/forkyard/j3",
            CONTAINER,
        ),
        (f"0::/system.slice/docker-{CONTAINER}.scope\n", CONTAINER),  # cgroup v2, systemd driver
        ("8:pids:/forkyard/mm642e4ukgyf4cqofcyj\n4:memory:/forkyard/mm642e4ukgyf4cqofcyj\n", None),
        ("0::/user.slice/user-0.slice/session-1.scope\n", None),
        ("8:pids:/docker-notes/forkyard/x\n", None),
    ],
)
def test_a_docker_containers_processes_are_told_by_their_cgroup(cgroup: str, container: str | None) -> None:
    """The Compose cluster's sandboxes run in node containers, unmarked: their cgroup says whose
    they are, so the session beside it (scripts/test.sh) never takes them for its own."""
    assert leaks.container_of(cgroup) == container
