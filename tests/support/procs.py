"""Host processes of a sandbox, found the way an operator would (by their command lines)."""

from __future__ import annotations

from forkyard.runtime.gvisor.watch import find_sentry


def runsc_sandbox_pid(sandbox_id: str) -> int:
    """The host pid of the sandbox's runsc sandbox process (the sentry)."""
    pid = find_sentry(f"ae-{sandbox_id}")
    assert pid is not None, f"no runsc sandbox process for {sandbox_id}"
    return pid
