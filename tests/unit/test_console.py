"""The console's pages and /node over real sockets with the loopback runtime (no root, no runsc),
and the CLI's control-plane commands through the real ``forkyard`` entry point against that
server. The browser, the PTY and gVisor are in tests/system/test_cli.py and test_console.py."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tests.support.loopback import LoopbackRuntime
from tests.unit.test_api import API_KEY, start_node

pytestmark = pytest.mark.asyncio(loop_scope="session")
FORKYARD = str(Path(sys.executable).with_name("forkyard"))


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def url(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    runtime = LoopbackRuntime()
    server, task, settings = await start_node(tmp_path_factory.mktemp("console"), runtime)
    yield f"http://127.0.0.1:{settings.port}"
    server.should_exit = True
    await task
    await runtime.close()


async def cli(url: str, *args: str, key: str = API_KEY) -> tuple[int, str, str]:
    env = {**os.environ, "E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key}
    proc = await asyncio.create_subprocess_exec(
        FORKYARD, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def logged_in(url: str) -> httpx.AsyncClient:
    client = httpx.AsyncClient(base_url=url, timeout=30)
    bad = await client.post("/console/login", data={"api_key": "nope"})
    assert bad.status_code == 401 and "invalid API key" in bad.text
    ok = await client.post("/console/login", data={"api_key": API_KEY})
    assert ok.status_code == 303 and ok.headers["location"] == "/console/sandboxes"
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    return client


async def test_pages_need_the_key(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        page = await client.get("/console/node", headers={"Accept": "text/html"})
        assert page.status_code == 303 and page.headers["location"] == "/console/login"
        action = await client.post("/console/sandboxes/x/kill")
        assert action.status_code == 401 and action.json() == {
            "code": 401,
            "message": "log in with an API key",
        }
        assert (await client.get("/console/login")).status_code == 200
        assert (await client.get("/console/static/terminal.js")).status_code == 200
        missing = await client.get("/console/static/nothing.js")
        assert missing.status_code == 404 and missing.json()["code"] == 404
        # The cookie is the console's only: the E2B API still wants the header.
        client.cookies.set("forkyard_console_key", API_KEY)
        assert (await client.get("/v2/sandboxes")).status_code == 401


async def test_every_page_renders_and_actions_report(url: str) -> None:
    client = await logged_in(url)
    try:
        api = {"X-API-Key": API_KEY}
        created = await client.post(
            "/v2/sandboxes", json={"templateID": "base", "metadata": {"k": "v"}}, headers=api
        )
        sid = created.json()["sandboxID"]
        listing = await client.get("/console/sandboxes")
        assert listing.status_code == 200 and f'id="sb-{sid}"' in listing.text and "k=v" in listing.text
        for path in (
            f"/console/sandboxes/{sid}",
            "/console/snapshots",
            "/console/templates",
            "/console/node",
        ):
            page = await client.get(path)
            assert page.status_code == 200, (path, page.text[-500:])
        assert "<svg" in (await client.get("/console/node")).text
        terminal = await client.get(f"/console/sandboxes/{sid}/terminal")
        assert f'data-sandbox="{sid}"' in terminal.text
        unknown = await client.post(
            f"/console/sandboxes/{sid}/explode", data={"back": "https://evil.example/"}
        )
        assert unknown.status_code == 303 and unknown.headers["location"].startswith(
            "/console/sandboxes?error="
        )
        killed = await client.post(
            f"/console/sandboxes/{sid}/kill", data={"back": f"/console/sandboxes/{sid}"}
        )
        assert killed.headers["location"] == f"/console/sandboxes?notice=killed+{sid}"
        again = await client.post(f"/console/sandboxes/{sid}/kill")
        assert "error=" in again.headers["location"] and "not+found" in again.headers["location"]
        gone = await client.get(f"/console/sandboxes/{sid}")
        assert gone.status_code == 404 and gone.json()["code"] == 404
        status = (await client.get("/node", headers=api)).json()
        assert status["runtime"] == "loopback" and status["lifecycle"]["kill"]["count"] >= 1
        assert (await client.get("/node/history", headers=api)).json()["samples"]
    finally:
        await client.aclose()


async def test_cli_against_the_server(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}) as client:
        ids = [
            (
                await client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"grp": "cli"}})
            ).json()["sandboxID"]
            for _ in range(2)
        ]
    code, out, err = await cli(url, "sandbox", "list", "--json", "-m", "grp=cli")
    assert code == 0, err
    assert sorted(s["sandboxID"] for s in json.loads(out)) == sorted(ids)
    code, out, err = await cli(url, "sandbox", "kill", ids[0], "inoexist0000000000000")
    assert code == 1 and f"killed {ids[0]}" in out and "not found" in err and "Traceback" not in err
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}) as client:
        assert (await client.delete(f"/sandboxes/{ids[1]}")).status_code == 204
    code, _, err = await cli(url, "sandbox", "list", key="wrong")
    assert code == 1 and err.strip() == "error: invalid API key"
