"""runsc's control socket, spoken directly for the calls on a snapshot's critical path.

``runsc pause`` and ``runsc resume`` each start a runsc process that reads the container's state
file, connects to the sandbox's control socket and sends one urpc call; on this machine the
process costs 15-25 ms of start-up, the call itself 0.3-0.6 ms. A snapshot of a running sandbox
pauses and resumes it with the sandbox unavailable in between, so both calls are sent here.

urpc (gVisor ``pkg/urpc``) is one JSON object per call over the unix stream socket named in the
state file (``sandbox.controlSocketPath``): ``{"method": ..., "arg": ...}``, answered by
``{"success": bool, "err": str, "result": ...}``. ``containerManager.Pause`` stops every task of
the sandbox in the sentry (the sentry keeps answering, so a checkpoint can follow: a checkpoint
of a paused sandbox leaves it paused); ``containerManager.Resume`` starts them again. Unlike the
CLI these calls leave runsc's state file saying "running", which is what the CLI's own
checkpoint and every later command expect of a sandbox that is resumed right after.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from forkyard.errors import Failed

#: How long one control call may take (a pause waits for every task to stop).
CALL_TIMEOUT = 30.0
PAUSE = "containerManager.Pause"
RESUME = "containerManager.Resume"


def socket_path(state_file: Path) -> Path | None:
    """The control socket named in a container's runsc state file, None without one."""
    try:
        state = json.loads(state_file.read_text())
        path = state["sandbox"]["controlSocketPath"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(path) if isinstance(path, str) and path else None


async def call(socket: Path, method: str, arg: Any = None) -> Any:
    """One urpc call; its result, or :class:`Failed` with the sentry's error."""
    try:
        async with asyncio.timeout(CALL_TIMEOUT):
            reader, writer = await asyncio.open_unix_connection(str(socket))
            try:
                writer.write(json.dumps({"method": method, "arg": arg}).encode())
                await writer.drain()
                answer = await _one_object(reader)
            finally:
                writer.close()
    except (OSError, TimeoutError, ValueError) as exc:
        raise Failed(f"runsc control call {method} on {socket} failed: {exc}") from None
    if not isinstance(answer, dict) or not answer.get("success"):
        err = answer.get("err") if isinstance(answer, dict) else answer
        raise Failed(f"runsc control call {method} refused: {err}")
    return answer.get("result")


async def _one_object(reader: asyncio.StreamReader) -> Any:
    """Read until the bytes so far are one complete JSON value (urpc sends no length)."""
    data = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            raise ValueError(f"the socket closed after {len(data)} bytes of an answer")
        data += chunk
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            continue
