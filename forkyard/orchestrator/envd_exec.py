"""Commands and files in a sandbox through its envd, for the template builder.

The SDK's own wire (envd's Connect RPC ``process.Process/Start`` with the JSON codec, and
``POST /files``), spoken here with httpx so the server needs no SDK. A process keeps running when
its stream is left (envd detaches the client only), which is how a start command stays up.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from forkyard.errors import Failed, Unavailable
from forkyard.orchestrator.templates import StartCommand
from forkyard.types import SandboxInstance

#: Called with each chunk of output: (stream name "stdout"/"stderr", text).
OutputSink = Callable[[str, str], Awaitable[None]]
_END_STREAM = 0x02
#: How long a template's ready command may take to pass (E2B's builds wait minutes too).
READY_TIMEOUT_SECONDS = 300.0
#: One attempt of the ready command; then it is tried again.
READY_ATTEMPT_SECONDS = 30.0
READY_INTERVAL_SECONDS = 0.2


@dataclass(frozen=True)
class Exit:
    exit_code: int
    error: str | None = None


def _auth(user: str | None) -> dict[str, str]:
    """The request's user; None: envd's default user."""
    if user is None:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


def _envelope(message: dict[str, object]) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


async def _messages(resp: httpx.Response) -> AsyncIterator[tuple[int, dict[str, object]]]:
    """The Connect envelopes of a streaming response: (flags, JSON message)."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        while len(buf) >= 5:
            flags, size = struct.unpack(">BI", buf[:5])
            if len(buf) < 5 + size:
                break
            body, buf = buf[5 : 5 + size], buf[5 + size :]
            yield flags, (json.loads(body) if body else {})


class EnvdExec:
    def __init__(self) -> None:
        # No read timeout: a build step may print nothing for minutes; envd sends keepalives.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), trust_env=False)

    async def run(
        self,
        instance: SandboxInstance,
        argv: list[str],
        *,
        user: str | None,
        cwd: str | None = None,
        envs: dict[str, str] | None = None,
        output: OutputSink | None = None,
        detach: bool = False,
        access_token: str | None = None,
    ) -> Exit | None:
        """Run ``argv`` and return how it ended; with ``detach`` return once it started (None)."""
        process: dict[str, object] = {"cmd": argv[0], "args": argv[1:], "envs": envs or {}}
        if cwd:
            process["cwd"] = cwd
        url = instance.envd_url.rstrip("/") + "/process.Process/Start"
        headers = {
            **_auth(user),
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            **({"X-Access-Token": access_token} if access_token else {}),
        }
        body = _envelope({"process": process, "stdin": False})
        try:
            async with self._http.stream("POST", url, content=body, headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    raise Failed(f"envd refused to start {argv[0]!r} ({resp.status_code}): {text[:500]}")
                return await self._follow(resp, argv, output, detach)
        except httpx.TransportError as exc:
            raise Unavailable(f"envd of {instance.sandbox_id} unreachable: {exc}") from None

    async def _follow(
        self, resp: httpx.Response, argv: list[str], output: OutputSink | None, detach: bool
    ) -> Exit | None:
        async for flags, msg in _messages(resp):
            if flags & _END_STREAM:
                err = msg.get("error")
                if err:
                    raise Failed(f"running {argv[0]!r} failed: {err}")
                break
            event = msg.get("event")
            if not isinstance(event, dict):
                continue
            if "start" in event and detach:
                return None
            data = event.get("data")
            if isinstance(data, dict) and output is not None:
                for stream in ("stdout", "stderr"):
                    if stream in data:
                        await output(stream, base64.b64decode(str(data[stream])).decode(errors="replace"))
            end = event.get("end")
            if isinstance(end, dict):
                error = end.get("error")
                return Exit(int(str(end.get("exitCode", 0))), str(error) if error else None)
        raise Failed(f"envd's stream of {argv[0]!r} ended without the process's exit")

    async def upload(self, instance: SandboxInstance, src: Path, dest: str, *, user: str) -> None:
        """``POST /files``: write the host file ``src`` at ``dest`` in the sandbox."""
        url = instance.envd_url.rstrip("/") + "/files"
        data = await asyncio.to_thread(src.read_bytes)  # build contexts are small archives
        try:
            resp = await self._http.post(
                url,
                params={"path": dest, "username": user},
                files={"file": (Path(dest).name, data, "application/octet-stream")},
            )
        except httpx.TransportError as exc:
            raise Unavailable(f"envd of {instance.sandbox_id} unreachable: {exc}") from None
        if resp.status_code >= 300:
            raise Failed(f"uploading {dest} into the sandbox failed ({resp.status_code}): {resp.text[:300]}")

    async def close(self) -> None:
        await self._http.aclose()


def shell_argv(rootfs: Path, command: str) -> list[str]:
    """How E2B runs a command string: a bash login shell, or ``sh`` where the root has no bash."""
    if (rootfs / "bin" / "bash").exists() or (rootfs / "usr" / "bin" / "bash").exists():
        return ["/bin/bash", "-l", "-c", command]
    return ["/bin/sh", "-c", command]


async def start_and_wait_ready(
    envd: EnvdExec,
    instance: SandboxInstance,
    rootfs: Path,
    start: StartCommand,
    *,
    limit: float = READY_TIMEOUT_SECONDS,
    access_token: str | None = None,
) -> None:
    """Start a template's start command (left running) and return once its ready command
    exits 0; ``Failed`` with the last attempt's output when it does not within ``limit`` s."""
    user, cwd, envs = start.user, start.workdir, start.envs
    if start.start_cmd:
        argv = shell_argv(rootfs, start.start_cmd)
        await envd.run(instance, argv, user=user, cwd=cwd, envs=envs, detach=True, access_token=access_token)
    if not start.ready_cmd:
        return
    deadline = time.monotonic() + limit
    last = ""
    seen: list[str] = []

    async def collect(_stream: str, text: str) -> None:
        seen.append(text)

    while True:
        seen.clear()
        try:
            async with asyncio.timeout(max(1.0, min(READY_ATTEMPT_SECONDS, deadline - time.monotonic()))):
                argv = shell_argv(rootfs, start.ready_cmd)
                ended = await envd.run(
                    instance, argv, user=user, cwd=cwd, envs=envs, output=collect, access_token=access_token
                )
            if ended is not None and ended.exit_code == 0:
                return
            last = f"exit {ended.exit_code if ended else '?'}: {''.join(seen)[-500:]}"
        except TimeoutError:
            last = f"an attempt took over {READY_ATTEMPT_SECONDS:.0f} s"
        if time.monotonic() >= deadline:
            raise Failed(f"ready command {start.ready_cmd!r} did not pass within {limit:.0f} s ({last})")
        await asyncio.sleep(READY_INTERVAL_SECONDS)
