"""``agentenv template``: build and list template root file systems."""

from __future__ import annotations

import json
import time

import typer

from agentenv.config import Settings
from agentenv.storage.templates import TemplateError, build_template, is_built, list_templates

app = typer.Typer(help="Build and list sandbox templates.", no_args_is_help=True)


@app.command("build")
def build(
    template_id: str = typer.Argument("base", help="Template to build (recipes: base)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if already built."),
) -> None:
    """Build a template (instant when it is already built)."""
    settings = Settings()
    already = is_built(template_id, settings) and not force
    started = time.monotonic()
    try:
        image = build_template(template_id, settings, force=force)
    except TemplateError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    what = "already built" if already else f"built in {time.monotonic() - started:.1f}s"
    typer.echo(f"template {template_id}: {what}: {image.rootfs}")


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List completely built templates."""
    templates = list_templates(Settings())
    if as_json:
        typer.echo(json.dumps(templates, indent=2))
        return
    if not templates:
        typer.echo("no templates built (run: agentenv template build base)")
    for meta in templates:
        typer.echo(
            f"{meta['template_id']}\tvcpus={meta['vcpus']}\tmemory_mb={meta['memory_mb']}"
            f"\tdisk_mb={meta['disk_mb']}\tcreated_at={meta['created_at']}"
        )
