"""Fork across nodes (docs/CLUSTER.md "Fork"): the children a parent's node has no room for go
to other nodes, restored from a stored snapshot of the parent.

A node forks from a checkpoint that never leaves it. When the parent's node has room (its
heartbeat's ``slots_free``, less what this gateway placed there since) for all the children, the
fork is forwarded unchanged. Otherwise the gateway:

1. takes a stored snapshot of the parent (``POST /sandboxes/{id}/snapshots``: usable on its node
   at once, uploaded to the snapshot store in the background);
2. forks on the parent's node as many children as it has room for, meanwhile waiting until the
   snapshot is durable (``GET /snapshots``' ``storage.durable``);
3. creates the other children from the snapshot on the nodes placement picks (ordinary creates
   from a snapshot, with the fork's timeout and the parent's metadata, as a node's fork child);
4. deletes the snapshot: the children stand on the layers their node fetched and named, and a
   restore has read the memory image (deleting a snapshot never breaks what was made from it).

The answer has a fork's shape: one ``{"sandbox": ...}`` or ``{"error": ...}`` per child, the
parent's node's children first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forkyard.gateway import placement
from forkyard.gateway.forward import NodeUnreachable, Reply
from forkyard.gateway.placement import Need, NodeInfo
from forkyard.orchestrator.lifecycle import MAX_FORK_COUNT

if TYPE_CHECKING:
    from forkyard.gateway.app import Gateway

log = logging.getLogger(__name__)

#: How long the spilled children wait for the parent's snapshot to reach the snapshot store.
DURABLE_WAIT_S = 300.0
_POLL_S = 0.2
_JSON = [("content-type", "application/json")]


@dataclass(frozen=True)
class ForkRequest:
    count: int
    timeout: int
    raw: dict[str, Any]

    @classmethod
    def parse(cls, body: bytes) -> ForkRequest | None:
        """None: not a well-formed fork (the node answers it with its own validation error)."""
        try:
            doc = json.loads(body) if body.strip() else {}
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        count, timeout = doc.get("count", 1), doc.get("timeout", 15)
        if type(count) is not int or type(timeout) is not int or not 1 <= count <= MAX_FORK_COUNT:
            return None
        return cls(count, timeout, doc)


def _error(code: int, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def _error_of(reply: Reply) -> dict[str, Any]:
    try:
        body = json.loads(reply.body)
        if isinstance(body, dict) and "message" in body:
            return {"error": {"code": body.get("code", reply.status), "message": body["message"]}}
    except ValueError:
        pass
    return _error(reply.status, reply.body.decode(errors="replace")[:500])


class Spill:
    """One fork that does not fit on the parent's node."""

    def __init__(self, gw: Gateway, parent_id: str, node: NodeInfo, req: ForkRequest) -> None:
        self.gw = gw
        self.parent_id = parent_id
        self.node = node
        self.req = req

    async def run(
        self, local: int, plan: Sequence[NodeInfo | None], create_body: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], Reply | None]:
        """The children's entries, or (nothing, the node's answer) when no snapshot was taken."""
        made = await self._call(self.node, "POST", f"/sandboxes/{self.parent_id}/snapshots", {})
        if made.status >= 300:
            return [], made
        snapshot_id = str(json.loads(made.body)["snapshotID"])
        try:
            here, there = await asyncio.gather(
                self._fork_here(local), self._restore_there(snapshot_id, plan, create_body)
            )
        finally:
            await self._delete(snapshot_id)
        return [*here, *there], None

    async def _call(self, node: NodeInfo, method: str, target: str, doc: dict[str, Any] | None) -> Reply:
        body = json.dumps(doc).encode() if doc is not None else b""
        return await self.gw.nodes_client.call(node, method, target, body, _JSON if body else [])

    async def _fork_here(self, local: int) -> list[dict[str, Any]]:
        if local == 0:
            return []
        doc = {**self.req.raw, "count": local}
        try:
            reply = await self._call(self.node, "POST", f"/sandboxes/{self.parent_id}/fork", doc)
        except NodeUnreachable as exc:
            return [_error(503, f"the parent's node is unreachable: {exc}")] * local
        if reply.status >= 300:
            return [_error_of(reply)] * local
        items = json.loads(reply.body)
        return [self._owned(item, self.node) for item in items]

    async def _restore_there(
        self, snapshot_id: str, plan: Sequence[NodeInfo | None], create_body: dict[str, Any]
    ) -> list[dict[str, Any]]:
        failure = await self._wait_durable(snapshot_id)
        if failure is not None:
            return [failure] * len(plan)
        body = {**create_body, "templateID": snapshot_id}
        return list(await asyncio.gather(*(self._create(node, body) for node in plan)))

    async def _create(self, node: NodeInfo | None, body: dict[str, Any]) -> dict[str, Any]:
        if node is None:
            return _error(429, "no node has room for this fork child (the parent's node is full too)")
        try:
            reply = await self._call(node, "POST", "/sandboxes", body)
        except NodeUnreachable as exc:
            return _error(503, f"node {node.node_id} is unreachable: {exc}")
        if reply.status >= 300:
            return _error_of(reply)
        return self._owned({"sandbox": json.loads(reply.body)}, node)

    def _owned(self, item: dict[str, Any], node: NodeInfo) -> dict[str, Any]:
        """A child's entry, its owner remembered and its ``domain`` the gateway's."""
        sandbox = item.get("sandbox")
        if isinstance(sandbox, dict) and isinstance(sandbox.get("sandboxID"), str):
            self.gw.remember_owner(sandbox["sandboxID"], node.node_id)
            if "domain" in sandbox:
                sandbox["domain"] = self.gw.domain
        return item

    async def _wait_durable(self, snapshot_id: str) -> dict[str, Any] | None:
        """None once the snapshot store holds it; else the children's error."""
        deadline = time.monotonic() + DURABLE_WAIT_S
        while True:
            reply = await self._call(self.node, "GET", f"/snapshots?name={snapshot_id}", None)
            if reply.status >= 300:
                return _error_of(reply)
            found = [s for s in json.loads(reply.body) if s.get("snapshotID") == snapshot_id]
            storage = found[0].get("storage") if found else None
            if not isinstance(storage, dict):
                return _error(
                    501, "the parent's node stores no snapshots durably (no S3): children cannot go elsewhere"
                )
            if storage.get("durable"):
                return None
            if storage.get("state") == "failed":
                return _error(500, f"uploading the parent's snapshot failed: {storage.get('error')}")
            if time.monotonic() > deadline:
                return _error(504, f"the parent's snapshot was not stored within {DURABLE_WAIT_S:.0f} s")
            await asyncio.sleep(_POLL_S)

    async def _delete(self, snapshot_id: str) -> None:
        try:
            reply = await self._call(self.node, "DELETE", f"/templates/{snapshot_id}", None)
        except NodeUnreachable as exc:
            log.warning("gateway: deleting fork snapshot %s failed: %s", snapshot_id, exc)
            return
        if reply.status >= 300 and reply.status != 404:
            log.warning("gateway: deleting fork snapshot %s answered %d", snapshot_id, reply.status)


async def plan_spill(
    gw: Gateway, parent_id: str, node: NodeInfo, req: ForkRequest
) -> tuple[int, list[NodeInfo | None], dict[str, Any]] | None:
    """(children on the parent's node, where each other one goes, their create body); None: the
    fork goes to the parent's node unchanged (it has room for all, or nothing else does)."""
    nodes = await gw.nodes(refresh=True)
    here = next((n for n in nodes if n.node_id == node.node_id), node)
    local = min(req.count, placement.room(here, gw.placed))
    if local >= req.count:
        return None
    parent = await gw.store.get_any(parent_id)
    if parent is None or parent.network.egress is not None:
        return None  # outbound rules are not carried by a create: the node answers what it can
    if parent.instance is not None and parent.instance.volume_mounts:
        return None  # its volumes are directories of its node: children elsewhere could not mount them
    others = [n for n in nodes if n.node_id != node.node_id]
    plan = placement.spread(others, req.count - local, Need(), gw.heartbeats_now, gw.fresh_within, gw.placed)
    if not any(plan):
        return None
    network: dict[str, Any] = {"allowPublicTraffic": parent.traffic_access_token is None}
    if parent.network.mask_request_host:
        network["maskRequestHost"] = parent.network.mask_request_host
    body: dict[str, Any] = {
        "timeout": req.timeout,
        "metadata": dict(parent.metadata),
        "secure": parent.envd_access_token is not None,
        "network": network,
    }
    if parent.network.allow_internet_access is not None:
        body["allow_internet_access"] = parent.network.allow_internet_access
    for _ in range(local):
        placement.note_placed(gw.placed, node.node_id, placement.DEFAULT_MEMORY_MIB, time.time())
    return local, plan, body
