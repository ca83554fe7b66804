"""The ``agentenv`` command line. Each area registers its own sub-command group."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="agentenv: self-hosted, E2B-compatible sandboxes.", no_args_is_help=True)

# Sub-command groups live next to the code they drive; a group whose module is missing
# (mid-development) must not break the others.
_GROUPS = {
    "template": "agentenv.cli.template",  # template build/list (storage)
    "image": "agentenv.cli.image",  # microVM guest artifacts (runtime/qemu, runtime/firecracker)
}
for _name, _module in _GROUPS.items():
    try:
        app.add_typer(importlib.import_module(_module).app, name=_name)
    except ModuleNotFoundError as exc:  # pragma: no cover - only while a group is being written
        if exc.name != _module:
            raise


@app.command()
def serve(
    host: str = typer.Option(None, help="Address to listen on (default 127.0.0.1)."),
    port: int = typer.Option(None, help="Port to listen on (default 3000)."),
) -> None:
    """Serve the E2B-compatible API and the envd proxy."""
    from agentenv.api.server import run

    run(host=host, port=port)


if __name__ == "__main__":
    app()
