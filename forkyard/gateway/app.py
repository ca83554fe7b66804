"""The gateway: one port serving the whole E2B API and envd traffic for a cluster of nodes.

Stateless: everything it knows comes from the shared database (nodes, sandbox owners, snapshot
copies) or from the nodes; several run side by side, a restart loses nothing. It checks API keys
(forkyard/api/auth.py) and forwards every control-plane call, signed, to a node:

- by sandbox id (``/sandboxes/{id}/...``, ``/v2/sandboxes/{id}/...``: get, kill, timeout,
  refreshes, connect/resume, pause, snapshots, fork, rollback, network, metrics, logs) to the
  node that owns it (``sandboxes.node_id``, cached, dropped when the node answers 404);
- creates (``POST /sandboxes``, ``/v2/sandboxes``, from a template or a snapshot) to the node
  :mod:`~forkyard.gateway.placement` picks, once more to the next one on a node error;
- lists (``GET /sandboxes``, ``/v2/sandboxes``, ``/snapshots``, ``/templates``, ``/v2/templates``,
  ``/sandboxes/metrics``) to every live node, merged (duplicates dropped), paginated here;
- template routes by id (builds, their files, status, logs, tags, delete) to the first node that
  knows the id; a new template build (``POST /v3/templates``) to the roomiest node.

envd traffic (``E2B-Sandbox-Id`` header or ``{port}-{id}.{domain}`` Host) is relayed to the owning
node's sandbox proxy (:class:`~forkyard.gateway.forward.EnvdRelay`).

A background loop marks nodes whose heartbeat is older than ``node_lost_after_seconds`` lost and
their sandboxes killed (:meth:`NodeDirectory.mark_lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from forkyard.api.auth import check_key, presented_key
from forkyard.api.e2b_wire import (
    LIST_LIMIT_MAX,
    decode_cursor,
    encode_cursor,
    http_domain,
    listed_body,
    parse_metadata_query,
    parse_states,
)
from forkyard.api.errors import error_response
from forkyard.api.limits import BodyLimit
from forkyard.api.relay import SANDBOX_NOT_FOUND, SignedFilesUrl, Target, find_target, send_error
from forkyard.config import Settings
from forkyard.errors import ForkyardError, Invalid, Unavailable, http_status
from forkyard.gateway import placement
from forkyard.gateway.fork import ForkRequest, Spill, plan_spill
from forkyard.gateway.forward import EnvdRelay, NodeClient, NodeUnreachable, Reply
from forkyard.gateway.node_directory import NodeDirectory
from forkyard.gateway.placement import Need, NodeInfo, Placed
from forkyard.gateway.status import cluster_metrics, cluster_status
from forkyard.orchestrator.ids import normalise_sandbox_id
from forkyard.orchestrator.store import ListQuery, SandboxStore
from forkyard.storage.db.outage import UNAVAILABLE_MESSAGE
from forkyard.types import ENVD_PORT, SandboxState

log = logging.getLogger(__name__)

_BY_SANDBOX = re.compile(r"^/(?:v2/)?sandboxes/(?P<id>[^/]+)(?:/.*)?$")
_TEMPLATE_BY_ID = re.compile(r"^/(?:v2/|v3/)?templates/(?P<id>[^/]+)(?:/.*)?$")
_SANDBOX_LISTS = frozenset({"/sandboxes", "/v2/sandboxes"})
_LISTS = {
    "/snapshots": "snapshotID",
    "/templates": "templateID",
    "/v2/templates": "templateID",
}
_CREATES = frozenset({"/sandboxes", "/v2/sandboxes"})
#: A volume's routes go to the node whose disk holds it (``/volumecontent`` with its own token).
_VOLUME_BY_ID = re.compile(r"^/(?:volumes|volumecontent)/(?P<id>[^/]+)(?:/.*)?$")
#: Answers that mean "no such thing here": try another node, drop a cached owner.
_MISSING = frozenset({404, 410})
#: How long the nodes table is reused between reads (placement and owner lookups).
_NODES_TTL_S = 1.0


class Gateway:
    """The state of one gateway process: its node directory, node clients, caches."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.gateway_id = f"{socket.gethostname()}:{settings.port}:{uuid.uuid4().hex[:8]}"
        self.api_keys = settings.effective_api_keys()
        self.domain = http_domain(settings)
        self.nodes_client = NodeClient(settings.node_secrets, self.gateway_id)
        self.relay = EnvdRelay(settings.node_secrets, self.gateway_id, settings.max_upload_bytes)
        self._store: SandboxStore | None = None
        self._db: NodeDirectory | None = None
        self._nodes: list[NodeInfo] = []
        self._nodes_read = 0.0
        self._owners: dict[str, str] = {}
        self._placed: dict[str, Placed] = {}
        self._clock = placement.HeartbeatClock(settings.node_lost_after_seconds)
        self._watch: asyncio.Task[None] | None = None

    @property
    def db(self) -> NodeDirectory:
        if self._db is None:
            raise RuntimeError("the gateway is not started")
        return self._db

    @property
    def store(self) -> SandboxStore:
        if self._store is None:
            raise RuntimeError("the gateway is not started")
        return self._store

    async def start(self) -> None:
        # Every node's sandbox rows, read across nodes (``query_all``) for the lists.
        settings = self.settings
        self._store = SandboxStore(
            settings.db_path, database_url=settings.database_url, node_id=self.gateway_id
        )
        await self._store.open()
        self._db = NodeDirectory(self._store.db.engine)
        self._watch = asyncio.create_task(self._watch_liveness(), name="gateway-liveness")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        self.relay.close()
        await self.nodes_client.aclose()
        if self._store is not None:
            await self._store.close()

    # -- nodes ---------------------------------------------------------------------------------

    @property
    def fresh_within(self) -> float:
        return self.settings.node_lost_after_seconds

    async def nodes(self, *, refresh: bool = False) -> list[NodeInfo]:
        if refresh or time.monotonic() - self._nodes_read > _NODES_TTL_S:
            try:
                self._nodes = await self.db.nodes()
            except Unavailable:
                self._clock.failed(time.time())
                if not self._nodes:
                    raise
                # The registry restarting moves no node: sandbox traffic goes on to the last known.
                log.warning("gateway: the registry is out of reach; using the node list read before")
                return self._nodes
            self._nodes_read = time.monotonic()
            self._clock.answered(time.time())
            placement.forget_seen(self._placed, self._nodes, placement.DEFAULT_MEMORY_MIB)
        return self._nodes

    @property
    def heartbeats_now(self) -> float:
        """The time nodes' heartbeat ages are judged at (a registry outage does not age them)."""
        return self._clock.now(time.time())

    async def live_nodes(self) -> list[NodeInfo]:
        now = self.heartbeats_now
        return [
            n for n in await self.nodes() if n.state != "lost" and now - n.heartbeat_at <= self.fresh_within
        ]

    async def node(self, node_id: str) -> NodeInfo | None:
        for _ in range(2):
            for n in await self.nodes():
                if n.node_id == node_id:
                    return n if n.state != "lost" else None
            await self.nodes(refresh=True)  # a node that joined since the last read
        return None

    async def owner(self, sandbox_id: str) -> NodeInfo | None:
        node_id = self._owners.get(sandbox_id)
        if node_id is None:
            node_id = await self.db.owner(sandbox_id)
            if node_id is None:
                return None
            self._owners[sandbox_id] = node_id
        found = await self.node(node_id)
        if found is None:
            self._owners.pop(sandbox_id, None)
        return found

    def forget(self, sandbox_id: str) -> None:
        self._owners.pop(sandbox_id, None)

    def remember_owner(self, sandbox_id: str, node_id: str) -> None:
        self._owners[normalise_sandbox_id(sandbox_id)] = node_id

    @property
    def placed(self) -> dict[str, Placed]:
        """What this gateway placed on each node since its heartbeat (placement counts it)."""
        return self._placed

    async def _watch_liveness(self) -> None:
        interval = max(
            0.2, min(self.settings.node_heartbeat_seconds, self.settings.node_lost_after_seconds / 3)
        )
        lost_after = self.settings.node_lost_after_seconds
        # While the registry was out of reach no node could write its heartbeat either: a node
        # is judged by its heartbeats only once the registry has answered for ``lost_after``
        # again (else a PostgreSQL restart longer than that would make every node lost).
        judged_from = time.monotonic()
        while True:
            try:
                if time.monotonic() - judged_from < lost_after:
                    await self.db.nodes()  # the registry answers: the wait counts from here on
                    self._clock.answered(time.time())
                    await asyncio.sleep(interval)
                    continue
                lost_nodes = await self.db.mark_lost(lost_after)
                self._clock.answered(time.time())
                for lost in lost_nodes:
                    log.warning(
                        "node %s lost (no heartbeat for %.0f s): its sandboxes %s reported killed",
                        lost.node_id,
                        lost_after,
                        ", ".join(lost.sandbox_ids) or "(none)",
                    )
                    for sid in lost.sandbox_ids:
                        self.forget(sid)
                    await self.nodes(refresh=True)
            except Exception:  # the database may be briefly unreachable: try again next round
                log.exception("gateway: checking node liveness failed")
                self._clock.failed(time.time())
                judged_from = time.monotonic()
            await asyncio.sleep(interval)

    # -- ASGI ----------------------------------------------------------------------------------

    async def envd(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Relay sandbox traffic; False: the request is for the control plane."""
        target = find_target(scope, (self.settings.domain, self.settings.sandbox_domain))
        try:
            if target is None and scope["type"] == "http" and scope.get("path") == "/files":
                target = await self._signed_target(scope)
            if target is None:
                return False
            node = await self.owner(target.sandbox_id)
        except ForkyardError as exc:  # the registry out of reach: 503, never a bare 500
            await _refuse(scope, receive, send, http_status(exc), exc.message, target)
            return True
        if node is None:
            await _refuse(scope, receive, send, 502, SANDBOX_NOT_FOUND, target)
            return True
        if scope["type"] == "websocket":
            await self.relay.websocket(scope, receive, send, target, node)
            return True
        status = await self.relay.http(scope, receive, send, target, node)
        if status in (0, 502):
            self.forget(target.sandbox_id)  # re-read the owner next time (killed, moved, node lost)
        return True

    async def _signed_target(self, scope: Scope) -> Target | None:
        """envd of the sandbox whose token signs this ``/files`` URL (the SDKs' ``download_url``
        and ``upload_url`` carry no routing header), as the node's proxy finds it, from the
        database's running sandboxes. None: not signed (envd checks signature and expiry again)."""
        signed = SignedFilesUrl.of(scope)
        if signed is None:
            return None
        for sandbox_id, token in await self.db.envd_tokens():
            if signed.signed_with(token):
                return Target(sandbox_id=sandbox_id, port=ENVD_PORT)
        return None

    # -- control plane -------------------------------------------------------------------------

    async def control(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if path == "/health":
            return Response(status_code=204)
        if path.startswith("/volumecontent/"):  # the volume's token, checked by its node
            return await self._on_volume_node(request, path)
        key = presented_key(request)  # type: ignore[arg-type]
        if key is None:
            return error_response(401, "missing API key: send it in the X-API-Key header")
        if not check_key(key, self.api_keys):
            return error_response(401, "invalid API key")
        body = await request.body()
        target = path + (f"?{request.url.query}" if request.url.query else "")
        headers = list(request.headers.items())
        try:
            if method == "POST" and path in _CREATES:
                return await self._create(target, body, headers)
            if method == "GET" and path in _SANDBOX_LISTS:
                return await self._list_sandboxes(request)
            if method == "GET" and path in _LISTS:
                return await self._list(target, headers, _LISTS[path])
            if method == "GET" and path == "/sandboxes/metrics":
                return await self._merged_metrics(target, headers)
            if method == "GET" and path == "/node":
                return JSONResponse(await cluster_status(self))
            if method == "GET" and path == "/metrics":
                return Response(await cluster_metrics(self), media_type="text/plain; version=0.0.4")
            m = _BY_SANDBOX.match(path)
            if m:
                return await self._by_sandbox(
                    normalise_sandbox_id(m.group("id")), method, target, body, headers
                )
            if path == "/volumes":  # rows shared by all nodes; a new volume on the roomiest node
                if method == "POST":
                    return await self._on_roomiest(method, target, body, headers)
                return await self._first_that_knows(method, target, body, headers)
            if _VOLUME_BY_ID.match(path):
                return await self._on_volume_node(request, path)
            if method == "POST" and path == "/v3/templates":
                return await self._on_roomiest(method, target, body, headers)
            if _TEMPLATE_BY_ID.match(path):
                return await self._first_that_knows(method, target, body, headers)
        except ForkyardError as exc:
            return error_response(http_status(exc), exc.message)
        except NodeUnreachable as exc:
            log.warning("gateway: %s", exc)
            return error_response(503, "the node holding this is unreachable; try again")
        return error_response(404, f"{method} {path} is not served by the gateway")

    def _response(self, reply: Reply, *, rewrite_domain: bool = False) -> Response:
        body = reply.body
        if rewrite_domain and reply.status < 300 and body:
            with contextlib.suppress(ValueError):
                doc = json.loads(body)
                # sandbox.get_host(port) must name the gateway; a fork answers one entry per child.
                entries = (
                    [e.get("sandbox") for e in doc if isinstance(e, dict)] if isinstance(doc, list) else [doc]
                )
                named = [item for item in entries if isinstance(item, dict) and "domain" in item]
                for item in named:
                    item["domain"] = self.domain
                if named:
                    body = json.dumps(doc).encode()
        return Response(body, status_code=reply.status, headers=dict(reply.headers))

    async def _by_sandbox(
        self, sandbox_id: str, method: str, target: str, body: bytes, headers: list[tuple[str, str]]
    ) -> Response:
        node = await self.owner(sandbox_id)
        if node is None:
            return error_response(404, f"sandbox {sandbox_id!r} not found")
        if method == "POST" and target.split("?", 1)[0].endswith("/fork"):
            spilled = await self._fork(sandbox_id, node, body)
            if spilled is not None:
                return spilled
        reply = await self.nodes_client.call(node, method, target, body, headers)
        if reply.status in _MISSING:
            self.forget(sandbox_id)
        elif target.endswith("/fork") and reply.status < 300:
            for _ in range(self._learn_owners(reply.body, node.node_id)):  # until its next heartbeat
                placement.note_placed(self._placed, node.node_id, placement.DEFAULT_MEMORY_MIB, time.time())
        return self._response(reply, rewrite_domain=True)

    async def _fork(self, sandbox_id: str, node: NodeInfo, body: bytes) -> Response | None:
        """A fork with more children than the parent's node has room for (forkyard/gateway/fork.py);
        None: forward it unchanged."""
        req = ForkRequest.parse(body)
        if req is None:
            return None
        planned = await plan_spill(self, sandbox_id, node, req)
        if planned is None:
            return None
        local, plan, create_body = planned
        log.info(
            "gateway: fork of %s: %d child(ren) on %s, %d elsewhere (%s)",
            sandbox_id,
            local,
            node.node_id,
            len(plan),
            ", ".join(n.node_id if n else "none" for n in plan),
        )
        children, failed = await Spill(self, sandbox_id, node, req).run(local, plan, create_body)
        if failed is not None:
            return self._response(failed)
        return JSONResponse(children, status_code=201)

    def _learn_owners(self, body: bytes, node_id: str) -> int:
        """Sandboxes a node just made are its own (saves a database read on their first call);
        returns how many."""
        learned = 0
        with contextlib.suppress(ValueError):
            doc = json.loads(body)
            docs = (
                doc if isinstance(doc, list) else doc.get("sandboxes", [doc]) if isinstance(doc, dict) else []
            )
            for entry in docs:
                # A fork's answer: one {"sandbox": ...} or {"error": ...} per child.
                item = entry.get("sandbox", entry) if isinstance(entry, dict) else entry
                if isinstance(item, dict) and isinstance(item.get("sandboxID"), str):
                    self._owners[normalise_sandbox_id(item["sandboxID"])] = node_id
                    learned += 1
        return learned

    async def _on_volume_node(self, request: Request, path: str) -> Response:
        """A volume's route on the node holding it; an unknown volume's on any node (its 404/401)."""
        m = _VOLUME_BY_ID.match(path)
        volume_id = m.group("id") if m else ""
        target = path + (f"?{request.url.query}" if request.url.query else "")
        body, headers = await request.body(), list(request.headers.items())
        try:
            node_id = (await self.db.volume_nodes(ids=[volume_id])).get(volume_id)
            node = await self.node(node_id) if node_id else None
            if node_id and node is None:
                return error_response(503, f"node {node_id}, which holds volume {volume_id}, is not up")
            if node is None:
                return await self._first_that_knows(request.method, target, body, headers)
            content = path.startswith("/volumecontent/")
            reply = await self.nodes_client.call(
                node, request.method, target, body, headers, keep_authorization=content
            )
            return self._response(reply)
        except NodeUnreachable as exc:
            log.warning("gateway: %s", exc)
            return error_response(503, "the node holding this volume is unreachable; try again")

    async def _volume_node(self, body: bytes) -> str | None:
        """The node a create must go to: the one holding its ``volumeMounts``' volumes (a
        volume is a directory of one node); None when it mounts none (or only unknown ones,
        which any node refuses)."""
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            mounts = json.loads(body).get("volumeMounts") or []
            names = [str(m["name"]) for m in mounts]
            if names:
                found = await self.db.volume_nodes(names=names)
                nodes = {found[n] for n in names if n in found}
                if len(nodes) > 1:
                    raise Invalid(
                        "volumeMounts name volumes of different nodes: a sandbox can mount one node's"
                    )
                return nodes.pop() if nodes else None
        return None

    async def _create(self, target: str, body: bytes, headers: list[tuple[str, str]]) -> Response:
        reference = None
        pinned = await self._volume_node(body)
        with contextlib.suppress(ValueError, AttributeError):
            reference = json.loads(body).get("templateID")
        need = Need(
            template=reference,
            cached_on=await self.db.holders(reference) if isinstance(reference, str) else frozenset(),
        )
        nodes = await self.nodes(refresh=True)
        now = self.heartbeats_now  # after the read: it tells the clock whether the database answered
        ranked = placement.candidates(nodes, need, now, self.fresh_within, self._placed)
        if pinned is not None:
            # The volume's node is the only place: the node decides (429 when full), not this
            # gateway's estimate, which counts its creates since the heartbeat but not its kills.
            ranked = [n for n in nodes if n.node_id == pinned and placement.fresh(n, now, self.fresh_within)]
            if not ranked:
                return error_response(503, f"node {pinned}, which holds the mounted volumes, is down")
        if not ranked and self._clock.failing:
            # The node list is from before the outage; the node could not record a sandbox anyway.
            return error_response(503, UNAVAILABLE_MESSAGE)
        if not ranked:
            return error_response(503, "no node has room for a sandbox now (or none is up)")
        last: Reply | None = None
        for node in ranked[:2]:  # on a node error, once more elsewhere
            try:
                reply = await self.nodes_client.call(node, "POST", target, body, headers)
            except NodeUnreachable as exc:
                log.warning("gateway: create on %s failed: %s", node.node_id, exc)
                continue
            if reply.status >= 500 or reply.status == 429:  # 429: full (its max_sandboxes)
                log.warning("gateway: create on %s answered %d", node.node_id, reply.status)
                last = reply
                continue
            if reply.status < 300:
                # Counted from the answer on: a heartbeat after it shows the sandbox running.
                placement.note_placed(self._placed, node.node_id, need.memory_mib, time.time())
                self._learn_owners(reply.body, node.node_id)
            return self._response(reply, rewrite_domain=True)
        if last is not None:
            return self._response(last)
        return error_response(503, "no node could take the sandbox")

    async def _fan_out(self, target: str, headers: list[tuple[str, str]]) -> list[Reply]:
        nodes = await self.live_nodes()

        async def ask(node: NodeInfo) -> Reply | None:
            try:
                return await self.nodes_client.call(node, "GET", target, b"", headers)
            except NodeUnreachable as exc:
                log.warning("gateway: list on %s failed: %s", node.node_id, exc)
                return None

        replies = await asyncio.gather(*(ask(n) for n in nodes))
        return [r for r in replies if r is not None]

    async def _list(self, target: str, headers: list[tuple[str, str]], key: str) -> Response:
        replies = await self._fan_out(target, headers)
        failed = [r for r in replies if r.status >= 300]
        if failed:
            return self._response(failed[0])
        return JSONResponse(_merge([json.loads(r.body) for r in replies], key))

    async def _list_sandboxes(self, request: Request) -> Response:
        """``GET /sandboxes`` and ``/v2/sandboxes`` from the database, across nodes (the nodes'
        routes with ``query_all`` for ``query``): same filters, order, cursor and headers."""
        params = request.query_params
        metadata = parse_metadata_query(params.get("metadata"))
        if request.url.path == "/sandboxes":
            recs = await self.store.query_all(ListQuery(states=(SandboxState.RUNNING,), metadata=metadata))
            return JSONResponse([listed_body(r) for r in recs])
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise Invalid(f"invalid order {order!r}: expected 'asc' or 'desc'")
        raw_limit = params.get("limit") or str(LIST_LIMIT_MAX)
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= LIST_LIMIT_MAX:
            raise Invalid(f"invalid limit {raw_limit!r}: expected 1 to {LIST_LIMIT_MAX}")
        limit = int(raw_limit)
        started_after = params.get("startedAfter")
        query = ListQuery(
            states=parse_states(params.getlist("state") or None),
            metadata=metadata,
            template=params.get("template"),
            started_after=_parse_time(started_after) if started_after else None,
            ascending=order == "asc",
            after=decode_cursor(params["nextToken"]) if params.get("nextToken") else None,
            limit=limit,
        )
        recs = await self.store.query_all(query)
        headers = {}
        if len(recs) > limit:
            recs = recs[:limit]
            headers["X-Next-Token"] = encode_cursor(recs[-1])
        if SandboxState.RUNNING in query.states:
            running = await self.store.query_all(
                ListQuery(
                    states=(SandboxState.RUNNING,),
                    metadata=metadata,
                    template=query.template,
                    started_after=query.started_after,
                )
            )
            headers["X-Total-Running"] = str(len(running))
        return JSONResponse([listed_body(r) for r in recs], headers=headers)

    async def _merged_metrics(self, target: str, headers: list[tuple[str, str]]) -> Response:
        replies = await self._fan_out(target, headers)
        failed = [r for r in replies if r.status >= 300]
        if failed:
            return self._response(failed[0])
        merged: dict[str, Any] = {}
        for reply in replies:
            merged.update(json.loads(reply.body).get("sandboxes", {}))
        return JSONResponse({"sandboxes": merged})

    async def _on_roomiest(
        self, method: str, target: str, body: bytes, headers: list[tuple[str, str]]
    ) -> Response:
        ranked = placement.candidates(
            await self.nodes(refresh=True), Need(memory_mib=0), self.heartbeats_now, self.fresh_within
        )
        if not ranked:
            return error_response(503, "no node is up")
        return self._response(await self.nodes_client.call(ranked[0], method, target, body, headers))

    async def _first_that_knows(
        self, method: str, target: str, body: bytes, headers: list[tuple[str, str]]
    ) -> Response:
        last: Reply | None = None
        for node in await self.live_nodes():
            reply = await self.nodes_client.call(node, method, target, body, headers)
            if reply.status not in _MISSING:
                return self._response(reply)
            last = reply
        if last is None:
            return error_response(503, "no node is up")
        return self._response(last)


def _merge(lists: list[Any], key: str) -> list[Any]:
    """The items of several nodes' lists, each once (nodes of one database list shared rows,
    e.g. snapshots, too): of two copies the one saying more wins (a snapshot's ``storage``
    comes from a node holding it), a node's own copy (``cached``) over that."""
    found: dict[str, Any] = {}
    for items in lists:
        for item in items if isinstance(items, list) else []:
            ident = str(item.get(key)) if isinstance(item, dict) else json.dumps(item)
            if ident not in found or _detail(item) > _detail(found[ident]):
                found[ident] = item
    return list(found.values())


async def _refuse(
    scope: Scope, receive: Receive, send: Send, code: int, message: str, target: Target | None
) -> None:
    """Answer sandbox traffic the gateway cannot route: an E2B-shaped error, or a WebSocket close."""
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.close", "code": 1011, "reason": message})
    else:
        await send_error(send, code, message, target.sandbox_id if target else None)


def _detail(item: Any) -> tuple[int, int]:
    if not isinstance(item, dict):
        return (0, 0)
    storage = item.get("storage")
    return (1 if isinstance(storage, dict) and storage.get("cached") else 0, len(item))


def _parse_time(raw: str) -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise Invalid(f"invalid startedAfter {raw!r}: expected an RFC 3339 time") from None


def create_gateway_app(settings: Settings) -> Any:
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def control(request: Request) -> Response:
        return await gateway.control(request)

    from starlette.routing import Route

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
    inner = Starlette(routes=[Route("/{path:path}", control, methods=methods)], lifespan=lifespan)
    inner.state.gateway = gateway
    # Control-plane bodies are capped as on a node (E2B's 16 MiB); sandbox traffic has its own cap.
    return _EnvdFirst(BodyLimit(inner), inner.state, gateway.envd)


class _EnvdFirst:
    """Sandbox traffic never reaches the router (envd's ``/health``, ``/files`` would collide)."""

    def __init__(self, app: Any, state: Any, envd: Callable[[Scope, Receive, Send], Awaitable[bool]]) -> None:
        self.app = app
        self.envd = envd
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and await self.envd(scope, receive, send):
            return
        await self.app(scope, receive, send)
