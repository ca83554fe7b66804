"""The ``forkyard`` command line: ``serve``, and the ``template`` and ``image`` groups."""

from __future__ import annotations

import typer

from forkyard.cli import image, node, sandbox, snapshot, template

app = typer.Typer(help="forkyard: self-hosted, E2B-compatible sandboxes.", no_args_is_help=True)
app.add_typer(template.app, name="template")  # template build/list (storage)
app.add_typer(image.app, name="image")  # microVM guest artifacts (runtime/qemu, runtime/firecracker)
app.add_typer(sandbox.app, name="sandbox")  # operators' commands over the E2B API (cli/client.py)
app.add_typer(snapshot.app, name="snapshot")
app.add_typer(node.app, name="node")


@app.command()
def serve(
    host: str = typer.Option(None, help="Address to listen on (default 127.0.0.1)."),
    port: int = typer.Option(None, help="Port to listen on (default 3000)."),
) -> None:
    """Serve the E2B-compatible API and the envd proxy."""
    # Imported here: `forkyard template build` must not pay for the web stack's import.
    from forkyard.api.server import run

    run(host=host, port=port)


@app.command()
def gateway(
    host: str = typer.Option(None, help="Address to listen on (default 127.0.0.1)."),
    port: int = typer.Option(None, help="Port to listen on (default 3000)."),
) -> None:
    """Serve a cluster's E2B API and envd traffic, forwarding to its nodes (docs/CLUSTER.md)."""
    from forkyard.errors import Invalid
    from forkyard.gateway.server import run

    try:
        run(host=host, port=port)
    except Invalid as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
