"""The urpc client for runsc's control socket (``runtime/gvisor/control.py``), against a unix
socket speaking urpc's framing: one JSON object each way, no length prefix. The real sentry
answers it in ``tests/system/test_gvisor.py`` (every snapshot of a running sandbox pauses and
resumes through it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from forkyard.errors import Failed
from forkyard.runtime.gvisor import control


async def _serve(path: Path, answer: bytes, calls: list[dict[str, object]]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        calls.append(json.loads(await reader.read(65536)))
        half = len(answer) // 2
        writer.write(answer[:half])  # an answer may arrive in pieces
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(answer[half:])
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(handle, path=str(path))


async def test_a_call_sends_method_and_arg_and_reads_a_split_answer(tmp_path: Path) -> None:
    calls: list[dict[str, object]] = []
    server = await _serve(tmp_path / "s.sock", b'{"success":true,"err":"","result":{"x":1}}', calls)
    async with server:
        assert await control.call(tmp_path / "s.sock", control.PAUSE) == {"x": 1}
    assert calls == [{"method": "containerManager.Pause", "arg": None}]


async def test_a_refused_call_and_a_dead_socket_raise_failed(tmp_path: Path) -> None:
    server = await _serve(tmp_path / "s.sock", b'{"success":false,"err":"container is not running"}', [])
    async with server:
        with pytest.raises(Failed, match="container is not running"):
            await control.call(tmp_path / "s.sock", control.RESUME)
    with pytest.raises(Failed, match="failed"):
        await control.call(tmp_path / "gone.sock", control.RESUME)


def test_the_socket_is_read_from_runsc_state_file(tmp_path: Path) -> None:
    state = tmp_path / "c_sandbox:c.state"
    state.write_text(json.dumps({"sandbox": {"controlSocketPath": "/run/runsc-c.sock"}}))
    assert control.socket_path(state) == Path("/run/runsc-c.sock")
    assert control.socket_path(tmp_path / "missing.state") is None
