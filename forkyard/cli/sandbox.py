"""``forkyard sandbox``: list, kill, logs, exec and connect, over the E2B API (see client.py).

Control-plane calls go over HTTP (``GET /v2/sandboxes``, ``DELETE /sandboxes/{id}``, ``GET
/v2/sandboxes/{id}/logs``); commands and terminals go to envd through the official SDK, the way a
trainer's code reaches them.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from forkyard.cli.client import Api, CliError, connection, delete_each, fail, parse_pairs, reported

app = typer.Typer(help="See and steer sandboxes (E2B API: E2B_API_URL or E2B_DOMAIN, E2B_API_KEY).")
STATES = ("running", "paused")
#: How often ``logs --follow`` and ``list --watch`` ask the API again.
POLL_SECONDS = 1.0


def _age(started: str | None, now: dt.datetime) -> str:
    if not started:
        return "-"
    seconds = int((now - dt.datetime.fromisoformat(started.replace("Z", "+00:00"))).total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def sandbox_table(sandboxes: list[dict[str, Any]]) -> Table:
    now = dt.datetime.now(dt.UTC)
    table = Table(box=None, header_style="bold")
    table.add_column("SANDBOX ID", no_wrap=True, min_width=20)  # ids are copied: never cut
    for col in ("TEMPLATE", "STATE", "AGE", "ENDS IN", "CPU", "MEMORY MB", "METADATA"):
        table.add_column(col)
    for s in sandboxes:
        ends = s.get("endAt")
        left = _age(now.isoformat(), dt.datetime.fromisoformat(ends.replace("Z", "+00:00"))) if ends else "-"
        meta = " ".join(f"{k}={v}" for k, v in sorted((s.get("metadata") or {}).items()))
        table.add_row(
            s["sandboxID"],
            s.get("alias") or s.get("templateID") or "",
            s.get("state", ""),
            _age(s.get("startedAt"), now),
            left,
            str(s.get("cpuCount", "")),
            str(s.get("memoryMB", "")),
            meta,
        )
    return table


def console() -> Console:
    """Rich's console; piped output gets a wide one, so rows stay one line for grep and awk."""
    return Console() if sys.stdout.isatty() else Console(width=240)


def _states(state: list[str] | None) -> list[str]:
    chosen = [s.strip() for item in state or [] for s in item.split(",") if s.strip()]
    bad = [s for s in chosen if s not in STATES]
    if bad:
        raise typer.BadParameter(f"{bad[0]!r} is not one of {', '.join(STATES)}", param_hint="--state")
    return chosen or list(STATES)


@app.command("list")
def list_(
    state: Annotated[
        list[str] | None, typer.Option("--state", "-s", help="running, paused (repeat or comma-join).")
    ] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="Only sandboxes with key=value.")
    ] = None,
    watch: bool = typer.Option(False, "--watch", "-w", help="Keep the table live until Ctrl-C."),
    as_json: bool = typer.Option(False, "--json", help="Print the API's JSON."),
) -> None:
    """List sandboxes (running and paused by default)."""
    states, meta = _states(state), parse_pairs(metadata)
    with reported(), Api() as api:
        if as_json:
            typer.echo(json.dumps(api.list_sandboxes(states, meta), indent=2))
            return
        if not watch:
            console().print(sandbox_table(api.list_sandboxes(states, meta)))
            return
        with Live(
            sandbox_table(api.list_sandboxes(states, meta)), console=console(), auto_refresh=False
        ) as live:
            while True:
                time.sleep(POLL_SECONDS)
                live.update(sandbox_table(api.list_sandboxes(states, meta)), refresh=True)


@app.command("kill")
def kill(
    sandbox_ids: Annotated[list[str] | None, typer.Argument(help="Sandboxes to kill.")] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="Also kill every sandbox with key=value.")
    ] = None,
) -> None:
    """Kill sandboxes by id and/or by metadata; exit 1 if any could not be killed."""
    meta = parse_pairs(metadata)
    if not sandbox_ids and not meta:
        raise typer.BadParameter("name sandboxes to kill, or select them with --metadata k=v")
    with reported(), Api() as api:
        targets = list(dict.fromkeys(sandbox_ids or []))
        if meta:
            targets += [s["sandboxID"] for s in api.list_sandboxes(list(STATES), meta)]
            targets = list(dict.fromkeys(targets))
            if not targets:
                typer.echo("no sandboxes match", err=True)
        delete_each(api, "sandboxes", targets, "killed")


def _print_entry(entry: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(entry))
        return
    level = entry.get("level", "info").upper()
    typer.echo(f"{entry.get('timestamp', '')} {level:<5} {entry.get('message', '')}")


def _cursor(entry: dict[str, Any]) -> int:
    at = dt.datetime.fromisoformat(str(entry["timestamp"]).replace("Z", "+00:00"))
    return int(at.timestamp() * 1000)


@app.command("logs")
def logs(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox.")],
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until it is killed."),
    level: str = typer.Option(None, "--level", help="Lowest level: debug, info, warn, error."),
    as_json: bool = typer.Option(False, "--json", help="One JSON log entry per line."),
) -> None:
    """Print a sandbox's logs (lifecycle events and the runtime's own log)."""
    with reported(), Api() as api:
        path = f"/v2/sandboxes/{sandbox_id}/logs"
        params: dict[str, Any] = {"direction": "forward", **({"level": level} if level else {})}
        seen: set[tuple[str, str]] = set()  # the cursor is inclusive: lines at it come again
        cursor: int | None = None
        while True:
            page = api.get_json(path, params={**params, **({"cursor": cursor} if cursor else {})})
            for entry in page["logs"]:
                key = (str(entry.get("timestamp")), str(entry.get("message")))
                if key not in seen:
                    seen.add(key)
                    _print_entry(entry, as_json)
                cursor = _cursor(entry)
            if not follow or not _alive(api, sandbox_id):
                return
            time.sleep(POLL_SECONDS)


def _alive(api: Api, sandbox_id: str) -> bool:
    try:
        api.request("GET", f"/sandboxes/{sandbox_id}")
    except CliError as exc:
        if exc.code == 404:
            return False
        raise
    return True


def _sdk_sandbox(sandbox_id: str) -> Any:
    """The SDK's handle: ``Sandbox.connect`` (resumes a paused sandbox, as E2B's CLI does)."""
    from e2b import Sandbox

    config = connection()
    if not config.api_key:
        fail("no API key: set E2B_API_KEY")
    return Sandbox.connect(sandbox_id)


@app.command("exec")
def exec_(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox.")],
    command: Annotated[list[str], typer.Argument(help="The command (after --); one argument runs in bash.")],
    user: str = typer.Option(None, "--user", "-u", help="User to run as (default: the template's, user)."),
    cwd: str = typer.Option(None, "--cwd", help="Working directory."),
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE for the command.")] = None,
    timeout: float = typer.Option(0, "--timeout", help="Seconds before the command is killed (0: never)."),
) -> None:
    """Run a command in a sandbox; its output streams here and its exit code is this one's."""
    from e2b import CommandExitException

    envs = parse_pairs(env, "--env")
    script = command[0] if len(command) == 1 else shlex.join(command)
    code = 0
    with reported():
        sbx = _sdk_sandbox(sandbox_id)
        try:
            sbx.commands.run(
                script,
                envs=envs or None,
                user=user,
                cwd=cwd,
                timeout=timeout,
                on_stdout=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
                on_stderr=lambda s: (sys.stderr.write(s), sys.stderr.flush()),
            )
        except CommandExitException as exc:
            code = exc.exit_code
    raise typer.Exit(code)


@app.command("connect")
def connect(sandbox_id: Annotated[str, typer.Argument(help="The sandbox.")]) -> None:
    """An interactive shell in the sandbox on this terminal (exit the shell to leave)."""
    from forkyard.cli.console_terminal import attach

    with reported():
        code = attach(_sdk_sandbox(sandbox_id))
    raise typer.Exit(code)
