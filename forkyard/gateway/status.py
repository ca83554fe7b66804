"""What a gateway answers at ``GET /node`` and ``GET /metrics`` (docs/CLUSTER.md "Operators").

``/node``: the cluster as the database has it: each node's row (state, heartbeat age, capacity)
and its sandboxes by state, plus totals over the nodes not lost. ``forkyard node status`` prints
it (it tells a gateway's answer by its ``nodes`` key).

``/metrics``: every live node's Prometheus text, each sample with a ``node`` label, one family at
a time (a family's HELP/TYPE once, its samples from all nodes under it), plus the gateway's own
``forkyard_gateway_nodes{state}``. A node that does not answer is left out (logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from forkyard.gateway.forward import NodeUnreachable
from forkyard.gateway.placement import NodeInfo

if TYPE_CHECKING:
    from forkyard.gateway.app import Gateway

log = logging.getLogger(__name__)

_CAPACITY = {
    "cpuCount": "vcpus_total",
    "cpuFree": "vcpus_free",
    "memoryTotalMiB": "memory_total_mib",
    "memoryAvailableMiB": "memory_free_mib",
    "diskFreeMiB": "disk_free_mib",
    "slotsFree": "slots_free",
}


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) else 0


async def cluster_status(gw: Gateway) -> dict[str, Any]:
    rows = await gw.db.node_rows()
    counts = await gw.db.sandbox_counts()
    now = time.time()
    by_node: dict[str, dict[str, int]] = {}
    by_state: dict[str, int] = {}
    by_tier: dict[str, int] = {}
    for node_id, state, tier, n in counts:
        states = by_node.setdefault(node_id, {})
        states[state] = states.get(state, 0) + n
        by_state[state] = by_state.get(state, 0) + n
        if state == "paused":
            by_tier[tier or "disk"] = by_tier.get(tier or "disk", 0) + n
    nodes = []
    totals = dict.fromkeys(_CAPACITY, 0)
    for row in rows:
        capacity = {key: _int(row.get(column)) for key, column in _CAPACITY.items()}
        if row.get("state") != "lost":
            for key, value in capacity.items():
                totals[key] += value
        states = by_node.get(str(row["node_id"]), {})
        nodes.append(
            {
                "nodeID": row["node_id"],
                "url": row["url"],
                "state": row["state"],
                "heartbeatAgeSeconds": round(now - float(row["heartbeat_at"] or 0), 1),  # type: ignore[arg-type]
                "runtime": row.get("runtime") or "",
                "version": row.get("version") or "",
                "capacity": capacity,
                "sandboxes": {"total": sum(states.values()), "byState": states},
            }
        )
    return {
        "role": "gateway",
        "gatewayID": gw.gateway_id,
        "nodes": nodes,
        "totals": {"nodes": len(nodes), "nodesUp": sum(n["state"] == "up" for n in nodes), **totals},
        "sandboxes": {"total": sum(by_state.values()), "byState": by_state, "pausedByTier": by_tier},
    }


async def cluster_metrics(gw: Gateway) -> str:
    nodes = await gw.live_nodes()

    async def scrape(node: NodeInfo) -> str:
        try:
            reply = await gw.nodes_client.call(node, "GET", "/metrics")
        except NodeUnreachable as exc:
            log.warning("gateway: /metrics of %s: %s", node.node_id, exc)
            return ""
        if reply.status != 200:
            log.warning("gateway: /metrics of %s answered %d", node.node_id, reply.status)
            return ""
        return reply.body.decode(errors="replace")

    texts = await asyncio.gather(*(scrape(n) for n in nodes))
    families: dict[str, tuple[str, str, list[str]]] = {}
    for node, text in zip(nodes, texts, strict=True):
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {"node": node.node_id, **sample.labels}
                lines.append(f"{sample.name}{{{_labels(labels)}}} {floatToGoString(sample.value)}")
    out: list[str] = []
    states: dict[str, int] = {}
    for node in await gw.nodes():
        states[node.state] = states.get(node.state, 0) + 1
    out += [
        "# HELP forkyard_gateway_nodes Nodes in the database, by state.",
        "# TYPE forkyard_gateway_nodes gauge",
    ]
    out += [f'forkyard_gateway_nodes{{state="{state}"}} {n}' for state, n in sorted(states.items())]
    for name, (doc, kind, lines) in families.items():
        out += [f"# HELP {name} {_escape_help(doc)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _labels(labels: dict[str, str]) -> str:
    def value(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return ",".join(f'{k}="{value(v)}"' for k, v in labels.items())


def _escape_help(doc: str) -> str:
    return doc.replace("\\", "\\\\").replace("\n", "\\n")
