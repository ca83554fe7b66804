"""``forkyard template``: build and list templates.

``forkyard template build base`` builds a recipe template (debootstrap). Any other build runs the
template builder the build API runs (:mod:`forkyard.orchestrator.builder`, a gVisor build
sandbox) from a spec: the JSON the SDKs' ``Template.to_json`` / ``Template.toJSON`` print
(``TemplateBuildStartV2``), or the ``--from-template`` / ``--from-image`` / ``--run`` / ``--copy``
/ ``--start-cmd`` / ``--ready-cmd`` options. ``COPY`` sources are read from ``--context``.
A running server makes the new template's snapshot on its first create.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from forkyard.api.routes_templates import build_spec
from forkyard.api.schemas import TemplateBuildStartV2
from forkyard.config import Settings
from forkyard.errors import ForkyardError
from forkyard.orchestrator import code_interpreter
from forkyard.orchestrator.builder import (
    BASE_STEP,
    FINALIZE_STEP,
    BuildSpec,
    BuildStep,
    LogEntry,
    TemplateBuilder,
)
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.runtime.kinds import select_runtime
from forkyard.storage.templates import RECIPES, TemplateError, build_template, is_current, list_templates

CWD = Path(".")
app = typer.Typer(help="Build and list sandbox templates.", no_args_is_help=True)


@app.command("build")
def build(
    template_id: str = typer.Argument("base", help="Template name (recipes: base, busybox), or name:tag."),
    force: bool = typer.Option(False, "--force", help="Rebuild a recipe template even if already built."),
    spec: Annotated[Path | None, typer.Option("--spec", help="Build spec JSON (Template.to_json).")] = None,
    from_template: str | None = typer.Option(None, "--from-template", help="Parent template."),
    from_image: str | None = typer.Option(None, "--from-image", help="OCI image (any registry)."),
    run: Annotated[list[str] | None, typer.Option("--run", help="RUN step (repeatable).")] = None,
    copy: Annotated[list[str] | None, typer.Option("--copy", help="COPY step SRC:DEST.")] = None,
    context: Annotated[Path, typer.Option("--context", help="Directory COPY sources are read from.")] = CWD,
    start_cmd: str | None = typer.Option(None, "--start-cmd", help="Start command of the template."),
    ready_cmd: str | None = typer.Option(None, "--ready-cmd", help="Ready command of the template."),
    cpu_count: int | None = typer.Option(None, "--cpu-count"),
    memory_mb: int | None = typer.Option(None, "--memory-mb"),
) -> None:
    """Build a template: a recipe (instant when already built), or a build spec in a build sandbox."""
    settings = Settings()
    run, copy = run or [], copy or []
    custom = spec or from_template or from_image or run or copy or start_cmd or ready_cmd
    if template_id in RECIPES and not custom:
        _build_recipe(template_id, settings, force)
        return
    if template_id == code_interpreter.TEMPLATE_ID and not custom:
        if not asyncio.run(_build_code_interpreter(settings, force)):
            raise typer.Exit(1)
        return
    if spec is not None:
        body = TemplateBuildStartV2.model_validate(json.loads(spec.read_text()), strict=False)
        the_spec = build_spec(body)
    else:
        steps = [_copy_step(item) for item in copy] + [BuildStep("RUN", [cmd]) for cmd in run]
        the_spec = BuildSpec(
            from_template=from_template,
            from_image=from_image,
            steps=steps,
            start_cmd=start_cmd,
            ready_cmd=ready_cmd,
        )
    ok = asyncio.run(_build_custom(settings, template_id, the_spec, context, cpu_count, memory_mb))
    if not ok:
        raise typer.Exit(1)


def _build_recipe(template_id: str, settings: Settings, force: bool) -> None:
    already = is_current(template_id, settings) and not force
    started = time.monotonic()
    try:
        image = build_template(template_id, settings, force=force)
    except TemplateError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    what = "already built" if already else f"built in {time.monotonic() - started:.1f}s"
    typer.echo(f"template {template_id}: {what}: {image.rootfs}")


def _copy_step(item: str) -> BuildStep:
    src, sep, dest = item.partition(":")
    if not sep or not src or not dest:
        raise typer.BadParameter(f"--copy wants SRC:DEST, got {item!r}")
    return BuildStep("COPY", [src, dest, "", ""])


def _archive(context: Path, src: str) -> Path:
    """The archive the SDK would upload for a COPY of ``src``: its matches, context-relative."""
    matches = sorted(context.glob(src.strip("/") or ".")) if src.strip("/") not in ("", ".") else [context]
    if not matches:
        raise typer.BadParameter(f"COPY source {src!r} matches nothing in {context}")
    fd, name = tempfile.mkstemp(suffix=".tar.gz")
    with open(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
        for path in matches:
            tar.add(path, arcname=str(path.relative_to(context)) if path != context else ".")
    return Path(name)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _stage_copies(builder: TemplateBuilder, spec: BuildSpec, context: Path) -> BuildSpec:
    """Put each COPY step's archive where the builder reads uploads, under its hash."""
    steps = []
    for step in spec.steps:
        if step.type == "COPY":
            archive = _archive(context, step.args[0])
            files_hash = step.files_hash or hashlib.sha256(archive.read_bytes()).hexdigest()
            data = archive.read_bytes()
            archive.unlink()
            await builder.store_upload(files_hash, _once(data))
            step = BuildStep(step.type, step.args, files_hash, step.force)
        steps.append(step)
    return BuildSpec(
        spec.from_template, spec.from_image, spec.registry, steps, spec.start_cmd, spec.ready_cmd, spec.force
    )


async def _build_custom(
    settings: Settings,
    name: str,
    spec: BuildSpec,
    context: Path,
    cpu_count: int | None,
    memory_mb: int | None,
) -> bool:
    runtime, _ = select_runtime(settings)
    builder = TemplateBuilder(settings, RuntimeSet(settings, runtime), None)
    # The build's logs stream above a progress bar of its steps (base, each step, finalize).
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as progress:
        bar = progress.add_task(f"building {name}", total=len(spec.steps) + 2)

        def show(entry: LogEntry) -> None:
            progress.console.print(_log_line(entry), markup=False, highlight=False, soft_wrap=True)
            progress.update(bar, completed=_steps_done(entry.step, len(spec.steps)))

        try:
            build = builder.request(name, [], cpu_count, memory_mb)
            build.listener = show
            staged = await _stage_copies(builder, spec, context)
            builder.check_spec(staged)
            await builder.run(build, staged)
        except ForkyardError as exc:
            progress.stop()
            typer.echo(f"error: {exc.message}", err=True)
            return False
        finally:
            await builder.close()
        if build.status == "ready":
            progress.update(bar, completed=len(spec.steps) + 2)
    if build.status != "ready":
        typer.echo(f"error: {build.reason.message if build.reason else 'build failed'}", err=True)
        return False
    typer.echo(f"template {build.template_id}: build {build.build_id} ready (tags: {', '.join(build.tags)})")
    return True


async def _build_code_interpreter(settings: Settings, force: bool) -> bool:
    """The built-in ``code-interpreter-v1`` (its spec: :mod:`forkyard.orchestrator.code_interpreter`),
    unless it is built from the current spec already."""
    runtime, _ = select_runtime(settings)
    builder = TemplateBuilder(settings, RuntimeSet(settings, runtime), None)
    if not force and code_interpreter.is_current(builder, settings):
        typer.echo(f"template {code_interpreter.TEMPLATE_ID}: already built from the current spec")
        await builder.close()
        return True
    try:
        build, spec = await code_interpreter.prepare(builder)
        build.listener = lambda entry: typer.echo(_log_line(entry))
        await builder.run(build, spec)
    except ForkyardError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        return False
    finally:
        await builder.close()
    if build.status != "ready":
        typer.echo(f"error: {build.reason.message if build.reason else 'build failed'}", err=True)
        return False
    typer.echo(f"template {build.template_id}: build {build.build_id} ready")
    return True


def _log_line(entry: LogEntry) -> str:
    return f"{entry.timestamp:%H:%M:%S} [{entry.step or '-'}] {entry.message}"


def _steps_done(step: str | None, steps: int) -> int:
    """Steps finished when a log line of ``step`` arrives: none during the base, all but the
    finalize during it, the ones before step ``n``."""
    if step is None or step == BASE_STEP:
        return 0
    if step == FINALIZE_STEP:
        return steps + 1
    return int(step) if step.isdecimal() else 0


@app.command("delete")
def delete(
    template_ids: Annotated[list[str], typer.Argument(help="Templates (ids or aliases) to delete.")],
) -> None:
    """Delete templates through the API (``DELETE /templates/{id}``: the template, its snapshot and
    warm pool; ``base`` is refused); exit 1 if any could not be deleted."""
    from forkyard.cli.client import delete_templates  # the SDK, loaded only for API commands

    delete_templates(template_ids)


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List completely built templates."""
    settings = Settings()
    templates = list_templates(settings)
    building = code_interpreter.build_progress(settings)
    if as_json:
        typer.echo(
            json.dumps(templates + ([{**building, "status": "building"}] if building else []), indent=2)
        )
        return
    if building:
        typer.echo(
            f"{code_interpreter.TEMPLATE_ID}\tbuilding (build {building['build_id']},"
            f" step {building['step']}): {building['message']}"
        )
    elif not templates:
        typer.echo("no templates built (run: forkyard template build base)")
    for meta in templates:
        typer.echo(
            f"{meta['template_id']}\tvcpus={meta['vcpus']}\tmemory_mb={meta['memory_mb']}"
            f"\tdisk_mb={meta['disk_mb']}\tcreated_at={meta['created_at']}"
        )
