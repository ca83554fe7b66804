"""End to end with the official ``e2b`` SDK's AsyncSandbox against a real ``forkyard serve``."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
from e2b import AsyncSandbox, CommandExitException, NotFoundException, SandboxQuery
from e2b.sandbox.commands.command_handle import PtySize

from tests.support.leaks import wait_no_host_resources
from tests.support.server import ServerProcess

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_async_sandbox_end_to_end(forkyard_server: ServerProcess) -> None:
    sbx = await AsyncSandbox.create(timeout=120, metadata={"suite": "sdk-async"}, envs={"X": "1"})
    try:
        r = await sbx.commands.run("echo hi && echo err >&2 && echo $X")
        assert (r.stdout, r.stderr, r.exit_code) == ("hi\n1\n", "err\n", 0)
        with pytest.raises(CommandExitException):
            await sbx.commands.run("exit 4")

        chunks: list[str] = []
        await sbx.commands.run("for i in 1 2; do echo s$i; sleep 0.2; done", on_stdout=chunks.append)
        assert "".join(chunks) == "s1\ns2\n"

        h = await sbx.commands.run("sleep 300", background=True)
        assert await h.kill()
        cat = await sbx.commands.run("cat", background=True, stdin=True)
        await sbx.commands.send_stdin(cat.pid, "abc\n")
        await sbx.commands.close_stdin(cat.pid)
        assert (await cat.wait()).stdout == "abc\n"

        out = bytearray()
        pty = await sbx.pty.create(PtySize(rows=20, cols=70), on_data=out.extend)
        await sbx.pty.resize(pty.pid, PtySize(rows=30, cols=100))
        await sbx.pty.send_stdin(pty.pid, b"stty size; exit\n")
        await pty.wait()
        assert b"30 100" in bytes(out)

        payload = os.urandom(50 << 20)
        await sbx.files.write("/home/user/big-async.bin", payload)
        back = await sbx.files.read("/home/user/big-async.bin", format="bytes")
        assert hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()
        await sbx.files.make_dir("/home/user/ad")
        await sbx.files.write("/home/user/ad/f", "x")
        await sbx.files.rename("/home/user/ad/f", "/home/user/ad/g")
        assert [e.name for e in await sbx.files.list("/home/user/ad")] == ["g"]
        assert await sbx.files.exists("/home/user/ad/g")
        await sbx.files.remove("/home/user/ad/g")
        with pytest.raises(NotFoundException):
            await sbx.files.read("/home/user/ad/g")

        info = await sbx.get_info()
        assert info.metadata == {"suite": "sdk-async"}
        await sbx.set_timeout(60)
        page = await AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "sdk-async"})).next_items()
        assert [s.sandbox_id for s in page] == [sbx.sandbox_id]
    finally:
        await sbx.kill()
    assert not await sbx.is_running()
    assert await asyncio.to_thread(wait_no_host_resources, sbx.sandbox_id) == []


async def test_async_parallel_creates(forkyard_server: ServerProcess) -> None:
    sandboxes = await asyncio.gather(*(AsyncSandbox.create(timeout=60) for _ in range(4)))
    try:
        outs = await asyncio.gather(*(s.commands.run(f"echo {i}") for i, s in enumerate(sandboxes)))
        assert [o.stdout for o in outs] == [f"{i}\n" for i in range(4)]
    finally:
        await asyncio.gather(*(s.kill() for s in sandboxes))
