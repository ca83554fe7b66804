"""``forkyard snapshot``: list and delete snapshots over the E2B API (``GET /snapshots``,
``DELETE /templates/{id}``: in E2B a snapshot is a template)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from forkyard.cli.client import Api, delete_templates, reported

app = typer.Typer(help="List and delete snapshots (E2B API).")


@app.command("list")
def list_(
    sandbox_id: str = typer.Option(None, "--sandbox", help="Only snapshots of this sandbox."),
    as_json: bool = typer.Option(False, "--json", help="Print the API's JSON."),
) -> None:
    """List the snapshots taken with ``sandbox.create_snapshot()`` (or the console)."""
    with reported(), Api() as api:
        params = {"sandboxID": sandbox_id} if sandbox_id else {}
        rows: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            resp = api.request(
                "GET", "/snapshots", params={**params, **({"nextToken": token} if token else {})}
            )
            rows += resp.json()
            token = resp.headers.get("x-next-token")
            if not token:
                break
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(box=None, header_style="bold")
    table.add_column("SNAPSHOT ID")
    table.add_column("NAMES")
    for row in rows:
        names = row.get("names") or []
        table.add_row(str(row["snapshotID"]), ", ".join(str(n) for n in names))
    Console().print(table)


@app.command("delete")
def delete(
    snapshot_ids: Annotated[list[str], typer.Argument(help="Snapshots (ids or names) to delete.")],
) -> None:
    """Delete snapshots; exit 1 if any could not be deleted."""
    delete_templates(snapshot_ids)
