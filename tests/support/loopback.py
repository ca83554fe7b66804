"""A loopback "runtime" for the API-layer unit tests (tests/unit/test_api.py): its sandboxes are
real HTTP servers (a dummy upstream) on their own 127.x.y.z address, port 49983 like envd.

It exercises the control plane and the proxy with real sockets, as any user; it is not an
isolation runtime and lives only under tests/. The end-to-end tests (tests/system/test_sdk*.py)
use the real gVisor runtime.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from forkyard.config import Settings
from forkyard.errors import Failed, NotSupported
from forkyard.runtime.base import Capability, Runtime
from forkyard.types import ENVD_PORT, SandboxInstance, SandboxMetrics, SandboxSpec, SnapshotRef


@dataclass
class Upstream:
    """What a dummy sandbox saw: /init bodies and request headers, for assertions."""

    inits: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    #: ``process.Process/Start`` requests (Connect JSON), each with whether it had a user.
    starts: list[dict[str, Any]] = field(default_factory=list)


def upstream_app(seen: Upstream) -> Starlette:
    async def health(_: Request) -> Response:
        return Response(status_code=204)

    async def init(request: Request) -> Response:
        seen.inits.append(await request.json())
        return Response(status_code=204)

    async def start(request: Request) -> Response:
        """envd's Connect JSON ``Start``: the request is kept; the process starts as pid 1000
        and ends with exit code 0 at once."""
        body = await request.body()
        message = json.loads(body[5:])  # one envelope: flags, length, JSON
        message["authorization"] = request.headers.get("authorization")
        seen.starts.append(message)
        events = [{"event": {"start": {"pid": 1000}}}, {"event": {"end": {"exitCode": 0, "exited": True}}}]
        frames = [(0, json.dumps(e).encode()) for e in events] + [(2, b"{}")]
        data = b"".join(bytes([flags]) + len(d).to_bytes(4, "big") + d for flags, d in frames)
        return Response(data, media_type="application/connect+json")

    async def upload(request: Request) -> JSONResponse:
        digest = hashlib.sha256()
        size = 0
        async for chunk in request.stream():
            digest.update(chunk)
            size += len(chunk)
        return JSONResponse({"size": size, "sha256": digest.hexdigest()})

    async def download(request: Request) -> StreamingResponse:
        size = int(request.query_params.get("size", "0"))
        seed = request.query_params.get("seed", "x").encode()

        async def body() -> Any:
            block = hashlib.sha256(seed).digest() * 2048  # 64 KiB
            sent = 0
            while sent < size:
                part = block[: min(len(block), size - sent)]
                sent += len(part)
                yield part

        return StreamingResponse(
            body(), media_type="application/octet-stream", headers={"content-length": str(size)}
        )

    async def stream(request: Request) -> StreamingResponse:
        count = int(request.query_params.get("count", "3"))
        delay = float(request.query_params.get("delay", "0.2"))

        async def body() -> Any:
            for i in range(count):
                yield f"event {i}\n".encode()
                await asyncio.sleep(delay)

        return StreamingResponse(body(), media_type="text/plain")

    async def echo(request: Request) -> JSONResponse:
        seen.headers.append(dict(request.headers))
        return JSONResponse(
            {
                "method": request.method,
                "path": request.url.path,
                "raw_path": request.scope.get("raw_path", b"").decode(),
                "query": request.url.query,
                "body": (await request.body()).decode(errors="replace"),
            }
        )

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        while True:
            msg = await websocket.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("text") is not None:
                await websocket.send_text("echo:" + msg["text"])
            elif msg.get("bytes") is not None:
                await websocket.send_bytes(msg["bytes"][::-1])

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/init", init, methods=["POST"]),
            Route("/process.Process/Start", start, methods=["POST"]),
            Route("/upload", upload, methods=["POST", "PUT"]),
            Route("/download", download),
            Route("/stream", stream),
            WebSocketRoute("/ws", ws),
            Route("/{path:path}", echo, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ]
    )


class LoopbackRuntime(Runtime):
    """Each sandbox is a uvicorn server on 127.213.x.y:49983 (unique per sandbox)."""

    name = "loopback"  # type: ignore[assignment]  # a test runtime, not one of RUNTIME_NAMES

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        fail_create: bool = False,
        snapshots: bool = True,
        freezes: bool = False,
        restore_stagger: float = 0.0,
    ) -> None:
        super().__init__(settings or Settings())
        self.servers: dict[str, tuple[uvicorn.Server, asyncio.Task[None]]] = {}
        self.seen: dict[str, Upstream] = {}
        self.killed: list[str] = []
        self.fail_create = fail_create
        self.snapshots_supported = snapshots
        self.freezes = freezes
        #: The n-th restore takes n times this long (seconds): children that come up one by one.
        self.restore_stagger = restore_stagger
        #: Sandboxes frozen now (a frozen upstream stops answering, like a frozen sandbox).
        self.frozen: set[str] = set()
        #: (sandbox id, where, stop) of every snapshot, and (sandbox id, source) of every restore.
        self.snapshots: list[tuple[str, SnapshotRef, bool]] = []
        self.restores: list[tuple[str, SnapshotRef]] = []
        self._next = secrets.randbelow(200) * 250

    def probe(self) -> str | None:
        return None

    def platform(self) -> str:
        return "loopback"

    def _address(self) -> str:
        self._next += 1
        return f"127.213.{(self._next // 250) % 250 + 1}.{self._next % 250 + 1}"

    async def create(self, spec: SandboxSpec) -> SandboxInstance:
        address = self._address()
        seen = Upstream()
        server = uvicorn.Server(
            uvicorn.Config(
                upstream_app(seen), host=address, port=ENVD_PORT, log_level="warning", lifespan="off"
            )
        )
        task = asyncio.ensure_future(server.serve())
        self.servers[spec.sandbox_id] = (server, task)
        self.seen[spec.sandbox_id] = seen
        while not server.started:
            if task.done():
                raise Failed(f"dummy upstream did not start: {task.exception()}")
            await asyncio.sleep(0.01)
        if self.fail_create:
            raise Failed("injected create failure")
        return SandboxInstance(
            sandbox_id=spec.sandbox_id,
            runtime=self.name,
            envd_url=f"http://{address}:{ENVD_PORT}",
            address=address,
            state={"address": address},
            template_rootfs=str(spec.template.rootfs),
        )

    async def kill(self, instance: SandboxInstance) -> None:
        entry = self.servers.pop(instance.sandbox_id, None)
        self.killed.append(instance.sandbox_id)
        if entry:
            server, task = entry
            server.should_exit = True
            await task

    async def metrics(self, instance: SandboxInstance) -> SandboxMetrics:
        return SandboxMetrics(
            cpu_count=2,
            cpu_used_pct=1.5,
            mem_used=10 << 20,
            mem_total=512 << 20,
            disk_used=1 << 20,
            disk_total=4 << 30,
        )

    async def is_alive(self, instance: SandboxInstance) -> bool:
        return instance.sandbox_id in self.servers

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        gone = [sid for sid in self.servers if sid not in keep]
        for sid in gone:
            await self.kill(SandboxInstance(sid, self.name, "", "", {}))
        return gone

    async def snapshot(self, instance: SandboxInstance, dest: SnapshotRef, *, stop: bool) -> None:
        """Records what it was asked (the orchestrator's side of snapshots is what is tested):
        a marker file in ``dest`` and the request in :attr:`snapshots`; ``stop`` stops the upstream."""
        if not self.snapshots_supported:
            raise NotSupported("this loopback test runtime has no snapshots")
        dest.path.mkdir(parents=True, exist_ok=True)
        (dest.path / "loopback.json").write_text(json.dumps({"source": instance.sandbox_id}))
        self.snapshots.append((instance.sandbox_id, dest, stop))
        assert instance.sandbox_id not in self.frozen, "a frozen sandbox is thawed before its checkpoint"
        if stop:
            await self.kill(instance)

    @property
    def capabilities(self) -> frozenset[Capability]:  # type: ignore[override]
        return frozenset({Capability.FREEZE}) if self.freezes else frozenset()

    async def freeze(self, instance: SandboxInstance) -> None:
        if not self.freezes:
            raise NotSupported("this loopback test runtime cannot freeze")
        self.frozen.add(instance.sandbox_id)

    async def thaw(self, instance: SandboxInstance) -> None:
        if not self.freezes:
            raise NotSupported("this loopback test runtime cannot freeze")
        self.frozen.discard(instance.sandbox_id)

    async def restore(self, spec: SandboxSpec, source: SnapshotRef) -> SandboxInstance:
        if not (source.path / "loopback.json").is_file():
            raise NotSupported(f"{source.snapshot_id} is not a loopback snapshot")
        self.restores.append((spec.sandbox_id, source))
        await asyncio.sleep(self.restore_stagger * len(self.restores))
        return await self.create(spec)

    async def close(self) -> None:
        for sid in list(self.servers):
            await self.kill(SandboxInstance(sid, self.name, "", "", {}))


def write_template(templates_dir: Path, template_id: str = "base") -> None:
    """A template directory in the layout storage.templates builds (an empty rootfs is enough
    for the loopback runtime)."""
    tdir = templates_dir / template_id
    (tdir / "rootfs").mkdir(parents=True, exist_ok=True)
    (tdir / "template.json").write_text(
        json.dumps(
            {
                "template_id": template_id,
                "vcpus": 2,
                "memory_mb": 512,
                "disk_mb": 4096,
                "created_at": "2026-01-01T00:00:00+00:00",
            }
        )
    )
    (tdir / ".complete").write_text("2026-01-01T00:00:00+00:00\n")
