"""A counting process inside a sandbox: the proof that a sandbox's memory survived a pause, a
snapshot, a fork or a server restart (a restarted process would count from 0 again).

    before = start_state(sbx)            # a file on disk and the counter in memory
    ... pause / snapshot / fork / restart the server ...
    assert_state_continues(resumed, before)

``sbx`` is an official-SDK :class:`e2b.Sandbox`. ``request_timeout`` is passed to every SDK call
(slow guests, e.g. QEMU under TCG, need minutes).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from e2b import Sandbox

COUNTER_FILE = "/tmp/counter"
STATE_FILE = "/home/user/state.txt"
STATE = "parent-state"


def counter_command(step: float = 0.1) -> str:
    """A shell command that starts the counter in the background: it writes 1, 2, 3, ... to
    :data:`COUNTER_FILE` every ``step`` seconds, by rename (a reader never sees a torn file)."""
    return (
        f"nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > {COUNTER_FILE}.new; "
        f"mv {COUNTER_FILE}.new {COUNTER_FILE}; sleep {step}; done' >/dev/null 2>&1 &"
    )


def _timeouts(request_timeout: float | None) -> dict[str, Any]:
    if request_timeout is None:
        return {}
    return {"timeout": request_timeout, "request_timeout": request_timeout}


def read_counter(sbx: Sandbox, *, request_timeout: float | None = None) -> int:
    """The counter's current value (fails when it was never started in this sandbox)."""
    return int(sbx.commands.run(f"cat {COUNTER_FILE}", **_timeouts(request_timeout)).stdout.strip())


def wait_counter_passes(
    sbx: Sandbox, value: int, *, timeout: float = 30, request_timeout: float | None = None
) -> int:
    """Poll until the counter is above ``value``; return what it read. Fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        now = read_counter(sbx, request_timeout=request_timeout)
        if now > value:
            return now
        assert time.monotonic() < deadline, f"the counter process stopped at {now} (waited for > {value})"
        time.sleep(0.1)


def start_counter(
    sbx: Sandbox, *, step: float = 0.1, timeout: float = 30, request_timeout: float | None = None
) -> int:
    """Start the counter and wait for its first value; return the current one."""
    from e2b import CommandExitException

    sbx.commands.run(counter_command(step), **_timeouts(request_timeout))
    deadline = time.monotonic() + timeout
    while True:
        try:
            return read_counter(sbx, request_timeout=request_timeout)
        except CommandExitException:  # no counter file yet: `cat` exits 1
            assert time.monotonic() < deadline, f"the counter did not start in {timeout} s"
            time.sleep(0.1)


def start_state(
    sbx: Sandbox,
    content: str = STATE,
    *,
    step: float = 0.1,
    timeout: float = 30,
    request_timeout: float | None = None,
) -> int:
    """A file on disk (:data:`STATE_FILE`) and a counter process in memory; returns the counter."""
    sbx.files.write(STATE_FILE, content, request_timeout=request_timeout)
    return start_counter(sbx, step=step, timeout=timeout, request_timeout=request_timeout)


def assert_counter_runs(sbx: Sandbox, *, timeout: float = 30, request_timeout: float | None = None) -> None:
    """The counter process is alive: its value goes up."""
    first = read_counter(sbx, request_timeout=request_timeout)
    wait_counter_passes(sbx, first, timeout=timeout, request_timeout=request_timeout)


def assert_state_continues(
    sbx: Sandbox,
    before: int,
    content: str = STATE,
    *,
    timeout: float = 30,
    request_timeout: float | None = None,
) -> None:
    """The file is there, and the counter came back with its memory (not restarted from 0) and
    keeps counting."""
    assert sbx.files.read(STATE_FILE, request_timeout=request_timeout) == content
    first = read_counter(sbx, request_timeout=request_timeout)
    assert first >= before, f"the counter restarted: {first} < {before}"
    wait_counter_passes(sbx, first, timeout=timeout, request_timeout=request_timeout)
