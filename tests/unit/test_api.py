"""Control plane and proxy over real sockets, with a loopback test runtime (see
tests/support/loopback.py): schemas, auth, error shape, pagination, timeouts, streaming proxy."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import itertools
import json
import os
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import uvicorn
import websockets
from e2b import AsyncSandbox

from forkyard.api.app import create_app
from forkyard.config import Settings
from forkyard.orchestrator.ids import SANDBOX_ID_RE
from forkyard.types import ENVD_PORT
from tests.support import free_port
from tests.support.loopback import LoopbackRuntime, write_template

pytestmark = pytest.mark.asyncio(loop_scope="session")

API_KEY = "test-key-" + os.urandom(4).hex()
MAX_UPLOAD = 8 << 20


@dataclass
class Node:
    url: str
    runtime: LoopbackRuntime
    settings: Settings
    client: httpx.AsyncClient
    server: uvicorn.Server

    def sandbox_headers(self, sandbox_id: str, port: int = ENVD_PORT) -> dict[str, str]:
        return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}


async def start_node(
    tmp: Path, runtime: LoopbackRuntime
) -> tuple[uvicorn.Server, asyncio.Task[None], Settings]:
    write_template(tmp / "shared" / "templates")
    port = free_port()
    settings = Settings(
        data_dir=tmp / "data",
        templates_path=tmp / "shared" / "templates",
        api_keys=[API_KEY],
        port=port,
        max_upload_bytes=MAX_UPLOAD,
        template_snapshots=False,
    )
    app = create_app(settings, runtime=runtime)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), task.exception()
        await asyncio.sleep(0.01)
    return server, task, settings


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    tmp = tmp_path_factory.mktemp("api")
    runtime = LoopbackRuntime()
    server, task, settings = await start_node(tmp, runtime)
    url = f"http://127.0.0.1:{settings.port}"
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30) as client:
        yield Node(url, runtime, settings, client, server)
    server.should_exit = True
    await task
    await runtime.close()


async def create(node: Node, **body: object) -> dict[str, object]:
    resp = await node.client.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert resp.status_code == 201, resp.text
    data: dict[str, object] = resp.json()
    return data


def assert_e2b_error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) >= {"code", "message"} and "detail" not in body, body
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]
    return str(body["message"])


# -- auth and errors ---------------------------------------------------------------------------


async def test_auth_required_in_e2b_shape(node: Node) -> None:
    async with httpx.AsyncClient(base_url=node.url) as anon:
        assert_e2b_error(await anon.get("/v2/sandboxes"), 401)
        assert_e2b_error(await anon.get("/v2/sandboxes", headers={"X-API-Key": "wrong"}), 401)
        ok = await anon.get("/v2/sandboxes", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
        assert (await anon.get("/health")).status_code == 204


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"templateID": "base", "timeout": -1}', "timeout"),
        (b'{"templateID": "base", "timeout": "10"}', "timeout"),
        (b'{"templateID": 5}', "templateID"),
        (b'{"timeout": 10}', "templateID"),
        (b'{"templateID": "base", "metadata": {"a": 1}}', "metadata"),
        (b'{"templateID": "base", "timeout": 90000}', "24 hours"),
        (b"[]", ""),
    ],
)
async def test_bad_create_bodies_are_400(node: Node, content: bytes, fragment: str) -> None:
    before = set(node.runtime.servers)
    resp = await node.client.post(
        "/v2/sandboxes", content=content, headers={"content-type": "application/json"}
    )
    message = assert_e2b_error(resp, 400)
    assert fragment in message
    assert set(node.runtime.servers) == before  # nothing was started


async def test_unknown_template_is_404_and_leaks_nothing(node: Node) -> None:
    before = set(node.runtime.servers)
    resp = await node.client.post("/sandboxes", json={"templateID": "no-such-template"})
    assert "no-such-template" in assert_e2b_error(resp, 404)
    assert set(node.runtime.servers) == before


async def test_unknown_route_and_method_in_e2b_shape(node: Node) -> None:
    assert_e2b_error(await node.client.get("/no/such/route"), 404)
    assert_e2b_error(await node.client.put("/v2/sandboxes"), 405)


async def test_unknown_sandbox_everywhere(node: Node) -> None:
    sid = "a" * 20
    assert_e2b_error(await node.client.get(f"/sandboxes/{sid}"), 404)
    assert_e2b_error(await node.client.delete(f"/sandboxes/{sid}"), 404)
    assert_e2b_error(await node.client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 5}), 404)
    assert_e2b_error(await node.client.post(f"/sandboxes/{sid}/refreshes", json={"duration": 5}), 404)
    assert_e2b_error(await node.client.get(f"/sandboxes/{sid}/metrics"), 404)
    assert_e2b_error(await node.client.get(f"/sandboxes/{sid}/logs"), 404)
    assert_e2b_error(await node.client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 5}), 404)
    # ... and through the proxy: the message the SDKs map to SandboxNotRunningException.
    resp = await node.client.get("/health", headers=node.sandbox_headers(sid))
    assert assert_e2b_error(resp, 502) == "The sandbox was not found"  # E2B's proxy's words
    assert resp.json()["sandboxId"] == sid


# -- lifecycle ---------------------------------------------------------------------------------


async def test_create_get_kill(node: Node) -> None:
    data = await create(node, timeout=60, metadata={"user": "a b&c=d"}, envVars={"FOO": "bar"})
    sid = str(data["sandboxID"])
    assert SANDBOX_ID_RE.fullmatch(sid)
    assert data["templateID"] == "base" and data["alias"] == "base"
    assert data["envdVersion"] and data["clientID"]
    token = data["envdAccessToken"]
    assert isinstance(token, str) and len(token) > 20  # v2 create is always secured
    assert data["domain"] == f"localhost:{node.settings.port}"
    init = node.runtime.seen[sid].inits[0]
    assert init["envVars"] == {"FOO": "bar"} and init["accessToken"] == token
    assert init["defaultUser"] == "user"

    detail = (await node.client.get(f"/sandboxes/{sid}")).json()
    assert detail["state"] == "running" and detail["metadata"] == {"user": "a b&c=d"}
    assert {"startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB", "envdVersion"} <= set(detail)
    life = dt.datetime.fromisoformat(detail["endAt"]) - dt.datetime.fromisoformat(detail["startedAt"])
    assert 59 <= life.total_seconds() <= 61

    # envd's output file in the sandbox directory is collected into the sandbox's logs,
    # incrementally while it runs and once more when it is killed.
    envd_log = node.settings.data_dir / "sandboxes" / sid / "envd.log"
    envd_log.parent.mkdir(parents=True, exist_ok=True)
    envd_log.write_text("envd: listening\n")
    first = (await node.client.get(f"/v2/sandboxes/{sid}/logs", params={"search": "envd:"})).json()
    assert [e["message"] for e in first["logs"]] == ["envd: listening"]
    with envd_log.open("a") as f:
        f.write("envd: process started\npartial line without newline")
    assert (await node.client.delete(f"/sandboxes/{sid}")).status_code == 204
    after = (await node.client.get(f"/v2/sandboxes/{sid}/logs", params={"search": "envd:"})).json()
    assert [e["message"] for e in after["logs"]] == ["envd: listening", "envd: process started"]
    assert after["logs"][0]["fields"] == {"source": "envd"}
    assert sid not in node.runtime.servers
    assert_e2b_error(await node.client.get(f"/sandboxes/{sid}"), 404)
    assert_e2b_error(await node.client.delete(f"/sandboxes/{sid}"), 404)
    logs = (await node.client.get(f"/sandboxes/{sid}/logs")).json()
    assert any("created" in e["message"] for e in logs["logEntries"])
    # Each v1 line is a JSON record with level and logger, as E2B's CLI (`e2b sandbox logs`)
    # parses them (tests/system/test_e2b_cli.py runs the CLI itself).
    records = [json.loads(e["line"]) for e in logs["logs"]]
    assert all(r["level"] in ("debug", "info", "warn", "error") and r["sandboxID"] == sid for r in records)
    assert any("killed" in r["message"] and r["logger"] == "orchestrator" for r in records)
    assert {"logger": "envd", "message": "envd: listening"}.items() <= records[
        [r["message"] for r in records].index("envd: listening")
    ].items()
    v2 = (await node.client.get(f"/v2/sandboxes/{sid}/logs", params={"level": "info"})).json()
    assert v2["logs"] and all(e["level"] in ("info", "warn", "error") for e in v2["logs"])


async def test_v1_create_not_secure_by_default(node: Node) -> None:
    resp = await node.client.post("/sandboxes", json={"templateID": "base"})
    assert resp.status_code == 201
    data = resp.json()
    assert data.get("envdAccessToken") is None
    assert "accessToken" not in node.runtime.seen[data["sandboxID"]].inits[0]
    await node.client.delete(f"/sandboxes/{data['sandboxID']}")


async def test_failed_create_cleans_up(tmp_path: Path) -> None:
    runtime = LoopbackRuntime(fail_create=True)
    server, task, settings = await start_node(tmp_path, runtime)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{settings.port}", headers={"X-API-Key": API_KEY}
        ) as client:
            resp = await client.post("/v2/sandboxes", json={"templateID": "base"})
            assert "injected create failure" in assert_e2b_error(resp, 500)
            assert runtime.servers == {} and len(runtime.killed) == 1
            assert (await client.get("/v2/sandboxes")).json() == []
    finally:
        server.should_exit = True
        await task


async def test_timeout_kills_and_set_timeout_extends(node: Node) -> None:
    short = str((await create(node, timeout=1))["sandboxID"])
    kept = str((await create(node, timeout=1))["sandboxID"])
    resp = await node.client.post(f"/sandboxes/{kept}/timeout", json={"timeout": 30})
    assert resp.status_code == 204
    assert_e2b_error(await node.client.post(f"/sandboxes/{kept}/timeout", json={"timeout": -1}), 400)
    assert_e2b_error(await node.client.post(f"/sandboxes/{kept}/timeout", content=b"{"), 400)
    await asyncio.sleep(2.5)
    assert_e2b_error(await node.client.get(f"/sandboxes/{short}"), 404)
    assert short not in node.runtime.servers
    resp = await node.client.get("/health", headers=node.sandbox_headers(short))
    assert "was not found" in assert_e2b_error(resp, 502)
    assert (await node.client.get(f"/sandboxes/{kept}")).status_code == 200
    # refresh only extends; connect returns the sandbox (200: it was already running)
    assert (await node.client.post(f"/sandboxes/{kept}/refreshes", json={"duration": 5})).status_code == 204
    resp = await node.client.post(f"/v2/sandboxes/{kept}/connect", json={"timeout": 10})
    assert resp.status_code == 200 and resp.json()["sandboxID"] == kept
    await node.client.delete(f"/sandboxes/{kept}")


async def test_concurrent_kill_and_timeout_do_not_race(node: Node) -> None:
    sid = str((await create(node, timeout=60))["sandboxID"])
    results = await asyncio.gather(
        node.client.delete(f"/sandboxes/{sid}"),
        node.client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 0}),
        node.client.delete(f"/sandboxes/{sid}"),
    )
    codes = sorted(r.status_code for r in results)
    assert codes.count(204) >= 1 and set(codes) <= {204, 404}
    await asyncio.sleep(1)
    assert node.runtime.killed.count(sid) == 1


async def test_sixteen_concurrent_creates(node: Node) -> None:
    datas = await asyncio.gather(*(create(node, metadata={"batch": "16"}) for _ in range(16)))
    ids = {str(d["sandboxID"]) for d in datas}
    assert len(ids) == 16
    listed = (await node.client.get("/v2/sandboxes", params={"metadata": "batch=16"})).json()
    assert {s["sandboxID"] for s in listed} == ids
    await asyncio.gather(*(node.client.delete(f"/sandboxes/{sid}") for sid in ids))
    assert not ids & set(node.runtime.servers)


# -- listing -----------------------------------------------------------------------------------


async def test_list_metadata_filter_and_pagination(node: Node) -> None:
    tag = os.urandom(3).hex()
    made = []
    for i in range(5):
        data = await create(node, metadata={"tag": tag, "i": str(i), "odd": str(i % 2)})
        made.append(str(data["sandboxID"]))
    # Exactly how the Python SDK encodes SandboxQuery(metadata=...): urlencode of quoted pairs.
    q = urllib.parse.urlencode(
        {
            urllib.parse.quote("tag"): urllib.parse.quote(tag),
            urllib.parse.quote("odd"): urllib.parse.quote("1"),
        }
    )
    resp = await node.client.get("/v2/sandboxes", params={"metadata": q})
    assert {s["sandboxID"] for s in resp.json()} == {made[1], made[3]}
    assert resp.headers["x-total-running"] == "2"

    pages: list[list[str]] = []
    token: str | None = None
    while True:
        params: dict[str, str | int] = {"metadata": f"tag={tag}", "limit": 2}
        if token:
            params["nextToken"] = token
        resp = await node.client.get("/v2/sandboxes", params=params)
        assert resp.status_code == 200
        pages.append([s["sandboxID"] for s in resp.json()])
        token = resp.headers.get("x-next-token")
        if not token:
            break
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [sid for page in pages for sid in page] == list(reversed(made))  # newest first
    asc = (await node.client.get("/v2/sandboxes", params={"metadata": f"tag={tag}", "order": "asc"})).json()
    assert [s["sandboxID"] for s in asc] == made

    v1 = (await node.client.get("/sandboxes", params={"metadata": f"tag={tag}"})).json()
    assert len(v1) == 5 and all(s["state"] == "running" for s in v1)
    paused = await node.client.get("/v2/sandboxes", params={"state": "paused", "metadata": f"tag={tag}"})
    assert paused.json() == []
    assert_e2b_error(await node.client.get("/v2/sandboxes", params={"state": "bogus"}), 400)
    assert_e2b_error(await node.client.get("/v2/sandboxes", params={"limit": 0}), 400)
    assert_e2b_error(await node.client.get("/v2/sandboxes", params={"nextToken": "%%%"}), 400)

    metrics = await node.client.get("/sandboxes/metrics", params={"sandbox_ids": ",".join(made[:2])})
    body = metrics.json()["sandboxes"]
    assert set(body) == set(made[:2])
    assert {"cpuCount", "cpuUsedPct", "memUsed", "memTotal", "diskUsed", "diskTotal", "timestampUnix"} <= set(
        body[made[0]]
    )
    one = (await node.client.get(f"/sandboxes/{made[0]}/metrics")).json()
    assert one and one[-1]["memTotal"] == 512 << 20
    for sid in made:
        await node.client.delete(f"/sandboxes/{sid}")


async def test_templates(node: Node) -> None:
    listed = (await node.client.get("/templates")).json()
    assert [t["templateID"] for t in listed] == ["base"]
    t = listed[0]
    assert {
        "buildID",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
        "public",
        "aliases",
        "names",
        "createdAt",
        "updatedAt",
        "createdBy",
        "lastSpawnedAt",
        "spawnCount",
        "buildCount",
        "envdVersion",
        "buildStatus",
    } <= set(t)
    one = (await node.client.get("/templates/base")).json()
    assert one["templateID"] == "base" and one["builds"][0]["status"] == "ready"
    assert_e2b_error(await node.client.get("/templates/nope"), 404)


def _routes(routes: list[Any]) -> Iterator[Any]:
    for route in routes:  # FastAPI keeps an included router whole (``original_router``)
        inner = getattr(route, "original_router", None)
        yield from _routes(inner.routes) if inner is not None else [route]


async def test_delete_templates_has_one_route(tmp_path: Path) -> None:
    """Templates and snapshots share E2B's one ``DELETE /templates/{templateID}``: a second
    registration would be dead code (Starlette only ever reaches the first)."""
    app = create_app(Settings(data_dir=tmp_path), runtime=LoopbackRuntime())
    deletes = [
        r.path
        for r in _routes(app.routes)
        if "DELETE" in (getattr(r, "methods", None) or ()) and r.path.startswith("/templates/{")
    ]
    assert len(deletes) == 1, deletes


async def test_the_sdk_deletes_snapshots_by_id_and_by_namespaced_name(node: Node) -> None:
    """``Sandbox.delete_snapshot`` sends ``DELETE /templates/{id}`` with the id percent-encoded:
    E2B's names are ``team/name:tag`` (openapi.yml SnapshotInfo). True once, then False (404)."""
    sid = str((await create(node))["sandboxID"])
    opts = {"api_key": API_KEY, "api_url": node.url}
    try:
        named = await node.client.post(f"/sandboxes/{sid}/snapshots", json={"name": "keepsake"})
        plain = await node.client.post(f"/sandboxes/{sid}/snapshots", json={})
        assert named.status_code == plain.status_code == 201, named.text + plain.text
        assert await AsyncSandbox.delete_snapshot("my-team/keepsake:default", **opts) is True
        assert await AsyncSandbox.delete_snapshot("my-team/keepsake:default", **opts) is False
        assert await AsyncSandbox.delete_snapshot(plain.json()["snapshotID"], **opts) is True
        assert await AsyncSandbox.delete_snapshot(plain.json()["snapshotID"], **opts) is False
        assert (await node.client.get("/snapshots", params={"sandboxID": sid})).json() == []
        # The node's own template is not the API's to delete, whichever way it is named.
        assert_e2b_error(await node.client.delete("/templates/my-team%2Fbase"), 403)
    finally:
        await node.client.delete(f"/sandboxes/{sid}")


# -- the proxy ---------------------------------------------------------------------------------


async def test_proxy_routes_by_header_and_host(node: Node) -> None:
    sid = str((await create(node))["sandboxID"])
    # envd's /health must reach the sandbox, not the control plane's /health.
    resp = await node.client.get("/health", headers=node.sandbox_headers(sid))
    assert resp.status_code == 204
    resp = await node.client.post(
        "/some/path%2Fx?a=1&b=%20",
        content=b"hello",
        headers={**node.sandbox_headers(sid), "X-Custom": "v", "X-API-Key": "k"},
    )
    echo = resp.json()
    assert echo["raw_path"] == "/some/path%2Fx" and echo["query"] == "a=1&b=%20" and echo["body"] == "hello"
    seen = node.runtime.seen[sid].headers[-1]
    assert seen["x-custom"] == "v" and "e2b-sandbox-id" not in seen
    await node.client.get(
        "/x", headers={**node.sandbox_headers(sid), "Connection": "keep-alive, X-Hop", "X-Hop": "1"}
    )
    assert "x-hop" not in node.runtime.seen[sid].headers[-1]
    # Idempotency-Key: a retried create returns the same sandbox.
    key = "retry-" + os.urandom(4).hex()
    idem = {"Idempotency-Key": key}
    first = await node.client.post("/v2/sandboxes", json={"templateID": "base"}, headers=idem)
    again = await node.client.post("/v2/sandboxes", json={"templateID": "base"}, headers=idem)
    assert first.json()["sandboxID"] == again.json()["sandboxID"]
    await node.client.delete(f"/sandboxes/{first.json()['sandboxID']}")
    async with httpx.AsyncClient(base_url=node.url) as anon:
        host = f"8080-{sid}.localhost:{node.settings.port}"
        # Port 8080 of the dummy sandbox is closed: the SDK's "port is not open" answer.
        resp = await anon.get("/", headers={"Host": host})
        assert assert_e2b_error(resp, 502) == "The sandbox is running but port is not open"
        assert resp.json()["sandboxId"] == sid and resp.json()["port"] == 8080
        resp = await anon.get("/hello", headers={"Host": f"{ENVD_PORT}-{sid}.localhost"})
        assert resp.json()["path"] == "/hello"
    # envd's internal operations are not reachable from outside.
    resp = await node.client.post("/init", json={"accessToken": "x"}, headers=node.sandbox_headers(sid))
    assert_e2b_error(resp, 403)
    assert len(node.runtime.seen[sid].inits) == 1
    await node.client.delete(f"/sandboxes/{sid}")


async def test_proxy_streams_large_bodies(node: Node) -> None:
    sid = str((await create(node))["sandboxID"])
    size = 7 << 20
    payload = os.urandom(size)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, size, 1 << 20):
            yield payload[i : i + (1 << 20)]

    resp = await node.client.post("/upload", content=chunks(), headers=node.sandbox_headers(sid))
    assert resp.json() == {"size": size, "sha256": hashlib.sha256(payload).hexdigest()}
    resp = await node.client.post("/upload", content=payload, headers=node.sandbox_headers(sid))
    assert resp.json()["size"] == size

    down = hashlib.sha256()
    got = 0
    async with node.client.stream(
        "GET", "/download", params={"size": 50 << 20}, headers=node.sandbox_headers(sid)
    ) as stream:
        assert stream.headers["content-length"] == str(50 << 20)
        async for chunk in stream.aiter_raw():
            down.update(chunk)
            got += len(chunk)
    assert got == 50 << 20
    await node.client.delete(f"/sandboxes/{sid}")


async def test_bad_input_is_4xx_never_5xx(node: Node) -> None:
    """Issue 15 item 6: what used to be 500s, and bodies and metadata beyond E2B's limits."""
    for port in (b"\xb2", "\u0664\u0669".encode(), b"-1", b"99999"):  # "\xb2" is latin-1 for "²"
        headers = {"E2b-Sandbox-Id": b"abc", "E2b-Sandbox-Port": port}
        assert_e2b_error(await node.client.get("/health", headers=headers), 400)
    huge_metadata = {"templateID": "base", "metadata": {"k": "v" * (10 << 20)}}
    assert "metadata" in assert_e2b_error(await node.client.post("/v2/sandboxes", json=huge_metadata), 400)
    over = b'{"templateID": "base", "x": "' + b"y" * (16 << 20) + b'"}'
    assert_e2b_error(await node.client.post("/v2/sandboxes", content=over), 413)

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(over), 1 << 20):
            yield over[i : i + (1 << 20)]

    assert_e2b_error(await node.client.post("/v2/sandboxes", content=chunked()), 413)
    assert_e2b_error(await node.client.get("/sandboxes/abc/logs", params={"start": 10**20}), 400)
    # A nextToken of Unicode digits ("²") is no position: the first page, not a 500.
    assert (await node.client.get("/snapshots", params={"nextToken": "\u00b2"})).status_code == 200
    rec = await create(node, metadata={"k": "v" * 1000})  # within the limits
    await node.client.delete(f"/sandboxes/{rec['sandboxID']}")


async def test_proxy_upload_limit_413(node: Node) -> None:
    sid = str((await create(node))["sandboxID"])
    too_big = os.urandom(MAX_UPLOAD + 1)
    resp = await node.client.post("/upload", content=too_big, headers=node.sandbox_headers(sid))
    assert "exceeds" in assert_e2b_error(resp, 413)

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(MAX_UPLOAD // (1 << 20) + 2):
            yield os.urandom(1 << 20)

    resp = await node.client.post("/upload", content=chunked(), headers=node.sandbox_headers(sid))
    assert_e2b_error(resp, 413)
    # The sandbox is fine afterwards.
    assert (await node.client.get("/health", headers=node.sandbox_headers(sid))).status_code == 204
    await node.client.delete(f"/sandboxes/{sid}")


async def test_proxy_streams_without_buffering(node: Node) -> None:
    sid = str((await create(node))["sandboxID"])
    loop = asyncio.get_running_loop()
    arrivals = []
    async with node.client.stream(
        "GET", "/stream", params={"count": 4, "delay": 0.3}, headers=node.sandbox_headers(sid)
    ) as stream:
        async for line in stream.aiter_lines():
            arrivals.append((line, loop.time()))
    assert [a[0] for a in arrivals] == [f"event {i}" for i in range(4)]
    # Each event arrives when it is produced, not all at the end.
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(arrivals)]
    assert all(g > 0.15 for g in gaps), gaps
    await node.client.delete(f"/sandboxes/{sid}")


async def test_proxy_websocket(node: Node) -> None:
    sid = str((await create(node))["sandboxID"])
    uri = f"ws://127.0.0.1:{node.settings.port}/ws"
    async with websockets.connect(uri, additional_headers=node.sandbox_headers(sid), proxy=None) as ws:
        await ws.send("hi")
        assert await ws.recv() == "echo:hi"
        await ws.send(b"\x01\x02\x03")
        assert await ws.recv() == b"\x03\x02\x01"
    await node.client.delete(f"/sandboxes/{sid}")
    with pytest.raises(websockets.InvalidStatus):
        async with websockets.connect(uri, additional_headers=node.sandbox_headers(sid), proxy=None):
            pass


async def test_restart_reattaches_and_cleans(tmp_path: Path) -> None:
    """A server restart keeps live sandboxes and marks dead ones killed."""
    runtime = LoopbackRuntime()
    server, task, settings = await start_node(tmp_path, runtime)
    base = f"http://127.0.0.1:{settings.port}"
    async with httpx.AsyncClient(base_url=base, headers={"X-API-Key": API_KEY}) as client:
        alive = (await client.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        dead = (await client.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
    server.should_exit = True
    await task
    # The machine of `dead` disappears while the server is down.
    srv, t = runtime.servers.pop(dead)
    srv.should_exit = True
    await t
    server, task, settings2 = await start_node(tmp_path, runtime)
    base = f"http://127.0.0.1:{settings2.port}"
    try:
        async with httpx.AsyncClient(base_url=base, headers={"X-API-Key": API_KEY}) as client:
            assert (await client.get(f"/sandboxes/{alive}")).status_code == 200
            headers = {"E2b-Sandbox-Id": alive, "E2b-Sandbox-Port": str(ENVD_PORT)}
            assert (await client.get("/health", headers=headers)).status_code == 204
            assert_e2b_error(await client.get(f"/sandboxes/{dead}"), 404)
            await client.delete(f"/sandboxes/{alive}")
    finally:
        server.should_exit = True
        await task
    assert runtime.servers == {}
