"""``forkyard image``: build the microVM guest artifacts (kernel, initramfs, drives) of a template."""

from __future__ import annotations

import json
import time

import typer

from forkyard.config import Settings
from forkyard.storage.images import ImageError, build_guest_images
from forkyard.storage.templates import TemplateError, load_template

app = typer.Typer(help="Build microVM guest images (QEMU, Firecracker).", no_args_is_help=True)


@app.command("build")
def build(
    template: str = typer.Option("base", "--template", help="Template whose root file system to image."),
    as_json: bool = typer.Option(False, "--json", help="Print the artifact paths as JSON."),
) -> None:
    """Build (or reuse, when cached) vmlinux, initramfs, base/envd drives and the upper template."""
    settings = Settings()
    started = time.monotonic()
    try:
        image = load_template(template, settings)
        artifacts = build_guest_images(settings, template, image.rootfs)
    except (ImageError, TemplateError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    paths = artifacts.to_json()
    if as_json:
        typer.echo(json.dumps(paths, indent=2))
        return
    typer.echo(f"guest images for template {template} ready in {time.monotonic() - started:.1f}s:")
    for name, path in paths.items():
        typer.echo(f"  {name:15} {path}")
