"""Bad input, limits, timeouts and crash recovery against a real ``forkyard serve`` with the real
runtime: every error in E2B's shape, and no sandbox, runsc process or netns left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from tests.support import base_template_missing
from tests.support.leaks import host_resources, wait_no_host_resources
from tests.support.server import ServerProcess, start_server


def e2b_error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == status and isinstance(body["message"], str) and "detail" not in body
    return str(body["message"])


def api(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=120)


def test_bad_requests_in_e2b_shape(forkyard_server: ServerProcess) -> None:
    with api(forkyard_server) as c:
        before = c.get("/v2/sandboxes").json()
        json_header = {"content-type": "application/json"}
        e2b_error(c.post("/v2/sandboxes", content=b"{oops", headers=json_header), 400)
        e2b_error(c.post("/v2/sandboxes", json={"templateID": "base", "timeout": -5}), 400)
        e2b_error(c.post("/v2/sandboxes", json={"templateID": ["base"]}), 400)
        assert "not found" in e2b_error(c.post("/v2/sandboxes", json={"templateID": "nope"}), 404)
        e2b_error(c.get("/sandboxes/" + "z" * 20), 404)
        e2b_error(httpx.get(forkyard_server.url + "/v2/sandboxes"), 401)
        resp = c.get("/health", headers={"E2b-Sandbox-Id": "z" * 20, "E2b-Sandbox-Port": "49983"})
        assert "was not found" in e2b_error(resp, 502)
        assert c.get("/v2/sandboxes").json() == before


def test_upload_limit_413_and_sandbox_survives(forkyard_server: ServerProcess) -> None:
    sbx = Sandbox.create(timeout=120)
    try:
        limit = 64 << 20  # FORKYARD_MAX_UPLOAD_BYTES of the e2e server
        headers = {
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sbx._envd_access_token or "",
        }
        big = os.urandom(limit + 1)
        resp = httpx.post(
            f"{forkyard_server.url}/files",
            params={"path": "/home/user/huge"},
            files={"file": ("huge", big)},
            headers=headers,
            timeout=120,
        )
        assert "exceeds" in e2b_error(resp, 413)
        assert not sbx.files.exists("/home/user/huge")
        assert sbx.commands.run("echo fine").stdout == "fine\n"
    finally:
        sbx.kill()
    assert wait_no_host_resources(sbx.sandbox_id) == []


@pytest.mark.slow
def test_kill_9_server_then_restart_leaks_nothing(tmp_path: Path) -> None:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    data = tmp_path / "data"
    server = start_server(data)
    try:
        with api(server) as c:
            kept = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300}).json()["sandboxID"]
            expiring = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 4}).json()["sandboxID"]
        assert host_resources(kept) and host_resources(expiring)
        server.kill_hard()
        time.sleep(5)  # `expiring` passes its end while no server runs
        server = start_server(data, api_key=server.api_key)
        with api(server) as c:
            # The survivor is re-attached and usable; the expired one is reaped.
            assert c.get(f"/sandboxes/{kept}").json()["state"] == "running"
            resp = c.get("/health", headers={"E2b-Sandbox-Id": kept, "E2b-Sandbox-Port": "49983"})
            assert resp.status_code == 204
            assert wait_no_host_resources(expiring) == []
            e2b_error(c.get(f"/sandboxes/{expiring}"), 404)
            assert c.delete(f"/sandboxes/{kept}").status_code == 204
        assert wait_no_host_resources(kept) == []
    finally:
        server.stop()
