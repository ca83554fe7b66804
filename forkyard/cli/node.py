"""``forkyard node status``: what a node has and runs, from ``GET /node`` (our JSON extension; a
cluster gateway answers it with every node's row and totals, docs/CLUSTER.md "Operators");
against a server without it from ``GET /metrics`` (Prometheus text) alone. ``forkyard node serve``:
run this host as a cluster node (docs/CLUSTER.md; the only command here that starts a server)."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from forkyard.cli.client import Api, CliError, reported

app = typer.Typer(help="The node behind the API: capacity, sandboxes, runtime (our extension).")


def from_metrics(text: str) -> dict[str, Any]:
    """The sandbox counts of ``forkyard_sandboxes{state,tier}`` in ``/node``'s shape."""
    from prometheus_client.parser import text_string_to_metric_families  # only for old servers

    by_state: dict[str, int] = {}
    by_tier: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "forkyard_sandboxes":
            continue
        for sample in family.samples:
            state, tier, n = sample.labels.get("state", ""), sample.labels.get("tier", ""), int(sample.value)
            by_state[state] = by_state.get(state, 0) + n
            if state == "paused":
                by_tier[tier or "disk"] = by_tier.get(tier or "disk", 0) + n
    return {"sandboxes": {"total": sum(by_state.values()), "byState": by_state, "pausedByTier": by_tier}}


def _print_cluster(console: Console, status: dict[str, Any]) -> None:
    """A gateway's ``/node``: one row per node, then the totals over the nodes not lost."""
    table = Table(box=None, header_style="bold")
    for col in (
        "NODE",
        "STATE",
        "HEARTBEAT",
        "RUNTIME",
        "SANDBOXES",
        "SLOTS FREE",
        "MEMORY FREE MIB",
        "VCPU FREE",
    ):
        table.add_column(col)
    for node in status["nodes"]:
        cap = node["capacity"]
        table.add_row(
            node["nodeID"],
            node["state"],
            f"{node['heartbeatAgeSeconds']} s ago",
            node["runtime"],
            str(node["sandboxes"]["total"]),
            str(cap["slotsFree"]),
            f"{cap['memoryAvailableMiB']} / {cap['memoryTotalMiB']}",
            f"{cap['cpuFree']} / {cap['cpuCount']}",
        )
    console.print(table)
    t = status["totals"]
    console.print(
        f"[bold]cluster[/bold] {t['nodesUp']} of {t['nodes']} nodes up; {t['slotsFree']} slots, "
        f"{t['memoryAvailableMiB']} of {t['memoryTotalMiB']} MiB, {t['cpuFree']} of {t['cpuCount']} vCPU free"
    )


def _print(status: dict[str, Any]) -> None:
    console = Console()
    if "nodes" in status:  # a cluster gateway's answer
        _print_cluster(console, status)
    if "runtime" in status:
        console.print(f"[bold]runtime[/bold] {status['runtime']} (platform {status['platform']})")
    cap = status.get("capacity")
    if cap:
        console.print(
            f"[bold]cpu[/bold] {cap['cpuCount']} (load {cap['loadAverage1m']}), "
            f"{cap['allocatedCpuCount']} vCPU allotted to running sandboxes"
        )
        console.print(
            f"[bold]memory[/bold] {cap['memoryAvailableMiB']} of {cap['memoryTotalMiB']} MiB available, "
            f"{cap['allocatedMemoryMiB']} MiB allotted"
        )
        console.print(f"[bold]disk[/bold] {cap['diskFreeMiB']} of {cap['diskTotalMiB']} MiB free")
    sbx = status["sandboxes"]
    states = ", ".join(f"{k} {v}" for k, v in sorted(sbx["byState"].items())) or "none"
    tiers = ", ".join(f"{k} {v}" for k, v in sorted(sbx["pausedByTier"].items()))
    console.print(
        f"[bold]sandboxes[/bold] {sbx['total']}: {states}" + (f" (paused: {tiers})" if tiers else "")
    )
    lifecycle = status.get("lifecycle") or {}
    if lifecycle:
        table = Table(box=None, header_style="bold")
        for col in ("OPERATION", "COUNT", "MEAN MS", "P50 <= MS", "P95 <= MS"):
            table.add_column(col)
        for op, v in lifecycle.items():
            table.add_row(op, str(v["count"]), str(v["meanMs"]), str(v["p50UpperMs"]), str(v["p95UpperMs"]))
        console.print(table)


@app.command("status")
def status(as_json: bool = typer.Option(False, "--json", help="Print the JSON.")) -> None:
    """Capacity, sandboxes by state and pause tier, runtime and platform, lifecycle latencies."""
    with reported(), Api() as api:
        try:
            data = api.get_json("/node")
        except CliError as exc:
            if exc.code != 404:
                raise
            data = from_metrics(api.request("GET", "/metrics").text)  # a server without /node
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    _print(data)


@app.command("serve")
def serve(
    host: str = typer.Option(None, help="Address to listen on (default 127.0.0.1)."),
    port: int = typer.Option(None, help="Port to listen on (default 3000)."),
) -> None:
    """Run this host's sandboxes as a cluster node: the shared database (FORKYARD_DATABASE_URL),
    heartbeats, and only requests signed by a gateway (FORKYARD_NODE_SECRETS)."""
    from forkyard.api.server import run  # the web stack only when serving
    from forkyard.errors import Invalid

    try:
        run(host=host, port=port, role="node")
    except Invalid as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
