"""Template builds: E2B's build API (v3 create, v2 build start, status with logs) run on this node.

A build boots a *build sandbox* (a gVisor sandbox of the parent template, or of an OCI image
pulled with skopeo and unpacked with umoci) and runs the SDK's steps in it through envd, as E2B's
builder does: ``RUN`` (as the build's user or the step's), ``COPY`` (the archive the SDK uploaded
through :meth:`TemplateBuilder.upload_link`, unpacked inside the sandbox), ``ENV``, ``WORKDIR``,
``USER``. The finished root file system is copied out of the sandbox and published as the
template's new build (:func:`forkyard.storage.templates.publish_build`); its start command is
started and its ready command waited for in the build sandbox (a failure fails the build, the
previous build stays), then the template's snapshot is made with the start command running
(:meth:`TemplateSnapshots.make`), so the build is ``ready`` only when creates restore it.

Steps are numbered as the SDK numbers its stack traces: ``base`` for the ``from_*`` call, ``1``
... for the instructions, ``finalize`` for the start and ready commands. A failure's
``reason.step`` names the step and its message carries the step's last output.

Step cache (E2B's layers): every step has a key chained from the previous one's
(:func:`step_keys`); after each step but the last the build sandbox's root is kept as that key's
step layer (:func:`forkyard.storage.templates.seal_step_layer`; the build's own root is its last
step's). A build whose leading steps have a step layer, or a finished build that ended with them,
starts its build sandbox on that root and logs those steps ``CACHED``; all of them cached, the
root is a hard-linked copy (:func:`forkyard.storage.templates.share_layer`). ``force`` (the SDK's
``skip_cache``) runs its step and every later one.

Build state lives in memory (a restarted server knows the finished builds a template keeps,
from their ``template.json``). Uploaded archives are kept by their hash under
``{data_dir}/build-files/`` and reused by later builds (``present: true``).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import hmac
import json
import logging
import re
import secrets
import shlex
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from forkyard.config import Settings
from forkyard.errors import Conflict, Failed, Forbidden, ForkyardError, Invalid, NotFound
from forkyard.orchestrator import templates
from forkyard.orchestrator.background import Background
from forkyard.orchestrator.envd_exec import EnvdExec, OutputSink, shell_argv, start_and_wait_ready
from forkyard.orchestrator.ids import new_sandbox_id
from forkyard.orchestrator.rowless import RowlessSandboxes
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.orchestrator.template_snapshots import TemplateSnapshots
from forkyard.runtime.base import Capability, Runtime
from forkyard.storage import images
from forkyard.storage import templates as storage
from forkyard.storage.envd_bundle import MOUNT_POINT
from forkyard.types import SANDBOX_USER, SandboxInstance, SandboxSpec, TemplateImage

log = logging.getLogger(__name__)

BASE_STEP = "base"
FINALIZE_STEP = "finalize"
#: Log entries a failure's ``reason`` carries (the failing step's last ones).
REASON_LOG_ENTRIES = 20
#: Output characters a failure's message carries.
REASON_OUTPUT_CHARS = 2000
UPLOAD_LINK_SECONDS = 3600
#: Finished builds whose status and logs stay answerable (a template's current build always is).
BUILDS_KEPT = 200
FILES_HASH_RE = re.compile(r"[A-Za-z0-9]{8,128}")
DEFAULT_WORKDIR = f"/home/{SANDBOX_USER}"


@dataclass(frozen=True)
class BuildStep:
    type: str
    args: list[str]
    files_hash: str | None = None
    force: bool = False


@dataclass(frozen=True)
class RegistryAuth:
    """``fromImageRegistry``: ``registry`` (username, password), ``aws`` (ECR: an access key
    exchanged for a registry token) or ``gcp`` (a service account's JSON key). Used for the
    pull only: never logged, never written past the build."""

    type: str
    username: str | None = None
    password: str | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_region: str | None = None
    service_account_json: str | None = None

    def __repr__(self) -> str:  # a stray log of the spec shows no secret
        return f"RegistryAuth(type={self.type!r})"


@dataclass(frozen=True)
class BuildSpec:
    """``TemplateBuildStartV2``: where the build starts and what it runs."""

    from_template: str | None = None
    from_image: str | None = None
    registry: RegistryAuth | None = None
    steps: list[BuildStep] = field(default_factory=list)
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False


@dataclass(frozen=True)
class LogEntry:
    timestamp: dt.datetime
    level: str
    message: str
    step: str | None = None


@dataclass(frozen=True)
class Reason:
    message: str
    step: str | None
    log_entries: list[LogEntry]


@dataclass
class Build:
    template_id: str
    build_id: str
    tags: list[str]
    cpu_count: int
    memory_mb: int
    status: str = "waiting"
    logs: list[LogEntry] = field(default_factory=list)
    reason: Reason | None = None
    created_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    finished_at: dt.datetime | None = None
    started: bool = False
    #: Called with every entry as it is logged (the CLI prints them).
    listener: Callable[[LogEntry], None] | None = None

    def log(self, message: str, *, level: str = "info", step: str | None = None) -> None:
        entry = LogEntry(dt.datetime.now(dt.UTC), level, message, step)
        self.logs.append(entry)
        if self.listener is not None:
            self.listener(entry)


@dataclass
class _Context:
    """What later steps inherit: the user, work dir and env vars steps so far set."""

    user: str = SANDBOX_USER
    workdir: str = DEFAULT_WORKDIR
    envs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _CacheHit:
    """The first ``steps`` steps are cached: a finished build's root of that key, its context."""

    steps: int
    image: TemplateImage
    ctx: _Context


@dataclass(frozen=True)
class _Outcome:
    """What the steps left for finalizing: the context, the last step's cache key, the cached
    root when no step ran."""

    ctx: _Context
    layer_key: str | None
    layer: Path | None
    cached_steps: int


class StepFailed(Failed):
    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.step = step


class TemplateBuilder:
    def __init__(
        self,
        settings: Settings,
        runtimes: RuntimeSet,
        snapshots: TemplateSnapshots | None,
        background: Background | None = None,
        collect: Callable[[], Awaitable[None]] | None = None,
        rowless: RowlessSandboxes | None = None,
    ) -> None:
        self._settings = settings
        #: Makes and kills the build sandboxes (no database row; the server's one, shared with
        #: ``snapshots``; the CLI gets its own).
        self._rowless = rowless or RowlessSandboxes(runtimes)
        #: Frees the roots of builds a publish dropped once nothing stands on them (the
        #: orchestrator's collection); None (the CLI): the server's next collection does.
        self._collect = collect
        self._runtimes = runtimes
        self._snapshots = snapshots
        #: The server's background tasks (drained, then cancelled, on shut-down: a cancelled
        #: build kills its sandbox); without one (the CLI) the builder keeps its own.
        self._background = background
        self._builds: dict[str, Build] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._envd = EnvdExec()
        # Upload links are signed with a key of this process: they outlive no restart.
        self._key = secrets.token_bytes(32)
        self.files_dir = settings.data_dir / "build-files"

    # -- the build API -------------------------------------------------------------------------

    def request(self, name: str, tags: list[str], cpu_count: int | None, memory_mb: int | None) -> Build:
        """``POST /v3/templates``: a new build of template ``name`` (``name:tag`` tags it too)."""
        template_id, tag = storage.split_name(name)
        all_tags = list(dict.fromkeys([*([tag] if tag else []), *tags])) or [storage.DEFAULT_TAG]
        for t in all_tags:
            storage.split_name(f"{template_id}:{t}")
        if template_id in storage.RECIPES:
            raise Forbidden(f"template '{template_id}' is built from this node's recipe; pick another name")
        if cpu_count is not None and not 1 <= cpu_count <= 64:
            raise Invalid(f"cpuCount must be between 1 and 64, got {cpu_count}")
        if memory_mb is not None and not 128 <= memory_mb <= 65536:
            raise Invalid(f"memoryMB must be between 128 and 65536, got {memory_mb}")
        build = Build(template_id, str(uuid.uuid4()), all_tags, cpu_count or 2, memory_mb or 512)
        self._builds[build.build_id] = build
        finished = [b for b in self._builds.values() if b.status in ("ready", "error")]
        for old in finished[: max(0, len(finished) - BUILDS_KEPT)]:  # oldest first (dict order)
            del self._builds[old.build_id]
        return build

    def get(self, template_id: str, build_id: str) -> Build:
        build = self._builds.get(build_id)
        if build is not None and build.template_id == template_id:
            return build
        try:  # a build finished before this server started: the current one or a kept one
            meta = storage.build_metadata(template_id, build_id, self._settings)
        except storage.TemplateError:
            meta = None
        if meta is not None:
            vcpus, memory_mb = int(meta.get("vcpus", 2)), int(meta.get("memory_mb", 512))
            done = Build(template_id, build_id, [], vcpus, memory_mb, status="ready")
            created = meta.get("created_at")
            if isinstance(created, str) and created:
                done.created_at = dt.datetime.fromisoformat(created)
            done.finished_at = done.created_at
            return done
        raise NotFound(f"build '{build_id}' of template '{template_id}' not found")

    def builds_of(self, template_id: str) -> list[Build]:
        return [b for b in self._builds.values() if b.template_id == template_id]

    def forget(self, template_id: str) -> None:
        """Drop the finished builds of a deleted template."""
        for build in self.builds_of(template_id):
            if build.status in ("ready", "error") or not build.started:
                del self._builds[build.build_id]

    def building(self, template_id: str) -> bool:
        return any(b.status in ("waiting", "building") and b.started for b in self.builds_of(template_id))

    def start(self, template_id: str, build_id: str, spec: BuildSpec) -> None:
        """``POST /v2/templates/{id}/builds/{build}``: run the build in the background."""
        build = self.get(template_id, build_id)
        if build.started or build.status != "waiting":
            raise Conflict(f"build '{build_id}' was already started")
        self.check_spec(spec)
        build.started = True
        name = f"template-build-{template_id}-{build_id}"
        if self._background is not None:
            self._background.spawn(self.run(build, spec), name=name)
            return
        task = asyncio.ensure_future(self.run(build, spec))
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def check_spec(self, spec: BuildSpec) -> None:
        """Refuse a spec the builder cannot run (``Invalid``), before anything starts."""
        if bool(spec.from_template) == bool(spec.from_image):
            raise Invalid("a build starts from exactly one of fromTemplate and fromImage")
        if spec.registry is not None:
            _check_registry(spec.registry)
        for i, step in enumerate(spec.steps, 1):
            if step.type not in _STEP_TYPES:
                raise Invalid(f"step {i}: unknown type '{step.type}' (known: {', '.join(_STEP_TYPES)})")
            if step.type == "COPY" and (len(step.args) < 2 or not step.files_hash):
                raise Invalid(f"step {i}: COPY needs a source, a destination and filesHash")
            if step.type != "COPY" and not step.args:
                raise Invalid(f"step {i}: {step.type} needs arguments")

    # -- uploads -------------------------------------------------------------------------------

    def _signature(self, files_hash: str, expires: int) -> str:
        return hmac.new(self._key, f"{files_hash}:{expires}".encode(), hashlib.sha256).hexdigest()

    def upload_link(self, template_id: str, files_hash: str, base_url: str) -> tuple[bool, str | None]:
        """``GET /templates/{id}/files/{hash}``: cached already, else where to ``PUT`` the archive."""
        storage.template_dir(template_id, self._settings)
        self._check_hash(files_hash)
        if (self.files_dir / files_hash).is_file():
            return True, None
        expires = int(time.time()) + UPLOAD_LINK_SECONDS
        url = (
            f"{base_url.rstrip('/')}/templates/{template_id}/files/{files_hash}/upload"
            f"?expires={expires}&signature={self._signature(files_hash, expires)}"
        )
        return False, url

    @staticmethod
    def _check_hash(files_hash: str) -> None:
        if not FILES_HASH_RE.fullmatch(files_hash):
            raise Invalid(f"invalid files hash {files_hash!r}")

    async def receive_upload(
        self, files_hash: str, expires: int, signature: str, chunks: AsyncIterator[bytes]
    ) -> None:
        self._check_hash(files_hash)
        if not hmac.compare_digest(signature, self._signature(files_hash, expires)):
            raise Forbidden("invalid upload signature")
        if expires < time.time():
            raise Forbidden("upload link expired")
        await self.store_upload(files_hash, chunks)

    async def store_upload(self, files_hash: str, chunks: AsyncIterator[bytes]) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        partial = self.files_dir / f".{files_hash}.{secrets.token_hex(4)}.partial"
        try:
            with partial.open("wb") as f:
                async for chunk in chunks:
                    f.write(chunk)
            partial.rename(self.files_dir / files_hash)
        finally:
            partial.unlink(missing_ok=True)

    # -- running a build -----------------------------------------------------------------------

    async def run(self, build: Build, spec: BuildSpec) -> None:
        """The whole build; its outcome is the build's status (this never raises a build error)."""
        build.status = "building"
        build.log(f"Building template {build.template_id} (build {build.build_id})", step=BASE_STEP)
        started = time.monotonic()
        staging = storage.build_staging(build.template_id, build.build_id, self._settings)
        runtime: Runtime | None = None
        instance: SandboxInstance | None = None
        step = BASE_STEP
        try:
            keys = step_keys(self._base_key(spec), spec.steps)
            hit = self._cached(build, spec, keys)
            if hit is not None:
                base, parent, ctx = self._limits(build, hit.image), None, hit.ctx
            else:
                base, parent, ctx = await self._base(build, spec, staging)
            cached = hit.steps if hit is not None else 0
            runtime = self._runtimes.for_template(base)
            # A pulled image is provisioned in the build sandbox even when no step follows it.
            provision = bool(spec.from_image) and hit is None
            if provision or cached < len(spec.steps) or spec.start_cmd or spec.ready_cmd:
                instance = await self._build_sandbox(build, runtime, base, parent)
            if provision:
                assert instance is not None
                await self._provision(build, instance, base.rootfs)
            for i, item in enumerate(spec.steps[cached:], cached + 1):
                step = str(i)
                assert instance is not None
                await self._step(build, instance, base.rootfs, ctx, i, len(spec.steps), item)
                if i < len(spec.steps):  # the last step's root is the build's own
                    await self._seal_step(build, runtime, instance, base, ctx, keys[i - 1], step)
            step = FINALIZE_STEP
            layer = hit.image.rootfs if hit is not None and cached == len(spec.steps) else None
            if layer is None and instance is None:
                # Nothing ran (E2B's `from_template(x)` alone, cache skipped): the parent's root.
                layer = base.rootfs
            out = _Outcome(ctx, keys[-1] if keys else None, layer, cached)
            await self._finalize(build, spec, runtime, instance, base, out, staging)
        except Exception as exc:  # every failure ends the build, with its step and output
            failed_step = exc.step if isinstance(exc, StepFailed) else step
            message = exc.message if isinstance(exc, ForkyardError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ForkyardError):
                log.exception("template build %s/%s failed", build.template_id, build.build_id)
            self._fail(build, message, failed_step)
        finally:
            if runtime is not None and instance is not None:
                await self._rowless.kill(instance)
            await asyncio.to_thread(shutil.rmtree, staging, True)
        if build.status != "error":
            build.status = "ready"
            build.log(f"Build finished in {time.monotonic() - started:.1f} s", step=FINALIZE_STEP)
        build.finished_at = dt.datetime.now(dt.UTC)
        log.info("template build %s/%s: %s", build.template_id, build.build_id, build.status)

    async def _seal_step(
        self,
        build: Build,
        runtime: Runtime,
        instance: SandboxInstance,
        base: TemplateImage,
        ctx: _Context,
        key: str,
        step: str,
    ) -> None:
        """Keep the root after this step as its cache layer (E2B caches every step), unless the
        runtime cannot show its layers. A failure here costs a later build that cache hit only."""
        if Capability.ROOT_LAYERS not in runtime.capabilities:
            return
        layers = runtime.root_layers(instance)
        if (storage.step_layers_dir(self._settings) / key / storage.COMPLETE_MARKER).is_file():
            return
        started = time.monotonic()
        await self._exec(
            build, instance, base.rootfs, "sync", step=step, user="root", cwd="/", envs={}, what="flushing"
        )
        meta = {"user": ctx.user, "workdir": ctx.workdir, "envs": dict(ctx.envs), "disk_mb": base.disk_mb}
        try:
            await asyncio.to_thread(storage.seal_step_layer, self._settings, key, base.rootfs, layers, meta)
        except OSError as exc:
            log.warning("keeping step %s of build %s as a cache layer failed: %s", step, build.build_id, exc)
            return
        build.log(
            f"Step {step} kept as a cache layer in {time.monotonic() - started:.1f} s",
            level="debug",
            step=step,
        )

    def _fail(self, build: Build, message: str, step: str) -> None:
        build.log(f"Build failed: {message}", level="error", step=step)
        entries = [e for e in build.logs if e.step == step][-REASON_LOG_ENTRIES:]
        build.reason = Reason(message=message, step=step, log_entries=entries)
        build.status = "error"

    def final_layer_key(self, spec: BuildSpec) -> str | None:
        """The cache key of the spec's last step: a finished build of this very spec (on the
        parent's current build) records it as its ``layer_key``."""
        keys = step_keys(self._base_key(spec), spec.steps)
        return keys[-1] if keys else None

    def _base_key(self, spec: BuildSpec) -> str | None:
        """The step cache key of the build's start: the parent template's build, or the image
        name (and registry kind). None: nothing to key on (the base step then fails)."""
        if spec.from_template:
            try:
                parent = templates.load(spec.from_template, self._settings)
            except (templates.TemplateNotFound, storage.TemplateError):
                return None
            return _digest(["template", parent.image.template_id, parent.build_id])
        return _digest(["image", spec.from_image, *_registry_identity(spec.registry)])

    def _cached(self, build: Build, spec: BuildSpec, keys: list[str]) -> _CacheHit | None:
        """The longest run of leading steps a step layer or finished build has a root of (none with
        ``force``, and none from the first step with ``force`` on: the SDK's ``skip_cache``)."""
        if spec.force or not keys:
            return None
        usable = next((i for i, s in enumerate(spec.steps) if s.force), len(spec.steps))
        for count in range(usable, 0, -1):
            found = storage.find_layer(keys[count - 1], self._settings)
            if found is None:
                continue
            rootfs, meta = found
            build.log(f"CACHED FROM {spec.from_template or spec.from_image}", step=BASE_STEP)
            for i, item in enumerate(spec.steps[:count], 1):
                build.log(f"CACHED {_step_line(i, len(spec.steps), item)}", step=str(i))
            envs = meta.get("envs")
            ctx = _Context(
                str(meta.get("user") or SANDBOX_USER),
                str(meta.get("workdir") or DEFAULT_WORKDIR),
                {str(k): str(v) for k, v in envs.items()} if isinstance(envs, dict) else {},
            )
            image = TemplateImage(
                template_id=f"{build.template_id}-build",
                rootfs=rootfs,
                disk_mb=int(meta.get("disk_mb", 4096)),
            )
            return _CacheHit(count, image, ctx)
        return None

    async def _build_sandbox(
        self, build: Build, runtime: Runtime, base: TemplateImage, parent: templates.TemplateInfo | None
    ) -> SandboxInstance:
        sandbox = SandboxSpec(sandbox_id=new_sandbox_id(), template=base)
        # The parent's snapshot is a fraction of a boot, but it has the parent's start command
        # running: a build starts from the parent's files only (E2B's), so those boot.
        if parent is not None and parent.start is None and self._snapshots is not None:
            instance = await self._snapshots.sandbox_of(parent, runtime, sandbox)
        else:
            instance = await self._rowless.create(runtime, sandbox, "build")
        build.log(f"Build sandbox {instance.sandbox_id} started", step=BASE_STEP)
        return instance

    async def _base(
        self, build: Build, spec: BuildSpec, staging: Path
    ) -> tuple[TemplateImage, templates.TemplateInfo | None, _Context]:
        """The build sandbox's template (the parent template, or a pulled image's root), the
        parent template if there is one, and the context the steps start from."""
        if spec.from_template:
            build.log(f"FROM TEMPLATE {spec.from_template}", step=BASE_STEP)
            try:
                parent = templates.load(spec.from_template, self._settings)
            except (templates.TemplateNotFound, storage.TemplateError) as exc:
                raise StepFailed(
                    f"base template '{spec.from_template}' not found: {exc}", BASE_STEP
                ) from None
            ctx = _Context()
            if parent.start is not None:  # inherit the parent build's context, as E2B does
                ctx = _Context(parent.start.user, parent.start.workdir, dict(parent.start.envs))
            return self._limits(build, parent.image), parent, ctx
        assert spec.from_image is not None
        build.log(f"FROM {spec.from_image}", step=BASE_STEP)
        rootfs = staging / "image-rootfs"
        try:
            username, password = await asyncio.to_thread(registry_credentials, spec.registry)
            config = await asyncio.to_thread(
                images.pull_image_rootfs,
                spec.from_image,
                rootfs,
                staging / "pull",
                username=username,
                password=password,
                mirrors=self._settings.registry_mirrors,
            )
        except images.ImageError as exc:
            raise StepFailed(f"pulling image '{spec.from_image}' failed: {exc}", BASE_STEP) from None
        (rootfs / MOUNT_POINT.lstrip("/")).mkdir(exist_ok=True)  # the envd bundle's mount point
        build.log(f"Pulled and unpacked {spec.from_image}", step=BASE_STEP)
        image = TemplateImage(template_id=f"{build.template_id}-build", rootfs=rootfs)
        return self._limits(build, image), None, _Context(envs=config.env)

    @staticmethod
    def _limits(build: Build, image: TemplateImage) -> TemplateImage:
        return TemplateImage(
            template_id=image.template_id,
            rootfs=image.rootfs,
            vcpus=build.cpu_count,
            memory_mb=build.memory_mb,
            disk_mb=image.disk_mb,
            runtime=image.runtime,
        )

    async def _exec(
        self,
        build: Build,
        instance: SandboxInstance,
        rootfs: Path,
        command: str,
        *,
        step: str,
        user: str,
        cwd: str,
        envs: dict[str, str],
        what: str,
    ) -> None:
        """Run a shell command as a step; its output goes to the build's logs line by line."""
        tail: list[str] = []
        pending = {"stdout": "", "stderr": ""}

        async def sink(stream: str, text: str) -> None:
            lines = (pending[stream] + text).split("\n")
            pending[stream] = lines.pop()
            for line in lines:
                build.log(line, step=step)
                tail.append(line)

        output: OutputSink = sink
        ended = await self._envd.run(
            instance, shell_argv(rootfs, command), user=user, cwd=cwd, envs=envs, output=output
        )
        for rest in pending.values():
            if rest:
                build.log(rest, step=step)
                tail.append(rest)
        code = ended.exit_code if ended is not None else -1
        if code != 0:
            out = "\n".join(tail)[-REASON_OUTPUT_CHARS:]
            raise StepFailed(f"{what} failed: exit status {code}" + (f"\n{out}" if out else ""), step)

    async def _provision(self, build: Build, instance: SandboxInstance, rootfs: Path) -> None:
        """What E2B adds to an image: the ``user`` account (with passwordless sudo where sudo
        is installed), and a resolver and host name the sandbox's network works with."""
        build.log("Provisioning the image (user 'user', resolver)", step=BASE_STEP)
        await self._exec(
            build,
            instance,
            rootfs,
            _PROVISION,
            step=BASE_STEP,
            user="root",
            cwd="/",
            envs={},
            what="provisioning the image",
        )

    async def _step(
        self,
        build: Build,
        instance: SandboxInstance,
        rootfs: Path,
        ctx: _Context,
        index: int,
        count: int,
        item: BuildStep,
    ) -> None:
        step = str(index)
        build.log(_step_line(index, count, item), step=step)
        if item.type == "ENV":
            if len(item.args) % 2:
                raise StepFailed("ENV needs pairs of name and value", step)
            ctx.envs.update(zip(item.args[::2], item.args[1::2], strict=True))
        elif item.type == "WORKDIR":
            path = _resolve(ctx.workdir, item.args[0])
            q = shlex.quote(path)
            script = f"[ -d {q} ] || {{ mkdir -p {q} && chown {shlex.quote(_owner(ctx.user))} {q}; }}"
            await self._exec(
                build,
                instance,
                rootfs,
                script,
                step=step,
                user="root",
                cwd="/",
                envs=ctx.envs,
                what=f"creating work dir {path}",
            )
            ctx.workdir = path
        elif item.type == "USER":
            user = item.args[0]
            await self._exec(
                build,
                instance,
                rootfs,
                f"id -u {shlex.quote(user)}",
                step=step,
                user="root",
                cwd="/",
                envs=ctx.envs,
                what=f"looking up user {user!r}",
            )
            ctx.user = user
        elif item.type == "RUN":
            user = item.args[1] if len(item.args) > 1 and item.args[1] else ctx.user
            await self._exec(
                build,
                instance,
                rootfs,
                item.args[0],
                step=step,
                user=user,
                cwd=ctx.workdir,
                envs=ctx.envs,
                what=f"command '{item.args[0]}'",
            )
        elif item.type == "COPY":
            await self._copy(build, instance, rootfs, ctx, step, item)

    async def _copy(
        self, build: Build, instance: SandboxInstance, rootfs: Path, ctx: _Context, step: str, item: BuildStep
    ) -> None:
        """Unpack the step's uploaded archive inside the sandbox and copy its source there the
        way Docker's COPY does (a directory's contents, a file into a directory or to a name)."""
        assert item.files_hash is not None
        archive = self.files_dir / item.files_hash
        if not archive.is_file():
            raise StepFailed(
                f"the files of COPY {item.args[0]} (hash {item.files_hash}) were not uploaded", step
            )
        src, dest = item.args[0], item.args[1]
        owner = _owner(item.args[2] if len(item.args) > 2 and item.args[2] else ctx.user)
        mode = item.args[3] if len(item.args) > 3 and item.args[3] else ""
        if mode and not re.fullmatch(r"[0-7]{3,4}", mode):
            raise StepFailed(f"COPY mode {mode!r} is not octal", step)
        inside = f"/tmp/.forkyard-copy-{item.files_hash[:16]}-{secrets.token_hex(4)}.tar"
        await self._envd.upload(instance, archive, inside, user="root")
        target = _resolve(ctx.workdir, dest) + ("/" if dest.endswith("/") else "")
        pattern = str(PurePosixPath(src.strip("/") or ".")).removeprefix("./") or "."
        script = _COPY.format(
            archive=shlex.quote(inside),
            pattern=pattern.replace(" ", "?"),
            dest=shlex.quote(target),
            owner=shlex.quote(owner),
            mode=shlex.quote(mode),
        )
        await self._exec(
            build,
            instance,
            rootfs,
            script,
            step=step,
            user="root",
            cwd="/",
            envs={},
            what=f"copying {src} to {dest}",
        )

    async def _finalize(
        self,
        build: Build,
        spec: BuildSpec,
        runtime: Runtime,
        instance: SandboxInstance | None,
        base: TemplateImage,
        out: _Outcome,
        staging: Path,
    ) -> None:
        """Copy the root out (or share the cached one), check the start command, publish the
        build, make its snapshot."""
        build.log("Finalizing the template", step=FINALIZE_STEP)
        ctx = out.ctx
        rootfs = staging / "rootfs"
        rootfs.mkdir()
        if out.layer is not None:  # every step cached: the root is that build's, shared
            await asyncio.to_thread(storage.share_layer, out.layer, rootfs)
        else:
            assert instance is not None
            await self._exec(
                build,
                instance,
                base.rootfs,
                "sync",
                step=FINALIZE_STEP,
                user="root",
                cwd="/",
                envs={},
                what="flushing the file system",
            )
            await runtime.export_root(instance, rootfs)
        start = templates.StartCommand(spec.start_cmd, spec.ready_cmd, ctx.user, ctx.workdir, dict(ctx.envs))
        if spec.start_cmd or spec.ready_cmd:
            assert instance is not None
            build.log(
                f"Start command: {spec.start_cmd or '-'}; ready command: {spec.ready_cmd or '-'}",
                step=FINALIZE_STEP,
            )
            try:
                await start_and_wait_ready(self._envd, instance, base.rootfs, start)
            except Failed as exc:
                raise StepFailed(exc.message, FINALIZE_STEP) from None
            build.log("Ready command passed", step=FINALIZE_STEP)
        meta = {
            "build_id": build.build_id,
            "vcpus": build.cpu_count,
            "memory_mb": build.memory_mb,
            "disk_mb": base.disk_mb,
            "kind": "build",
            "from_template": spec.from_template,
            "from_image": spec.from_image,
            "start_cmd": spec.start_cmd,
            "ready_cmd": spec.ready_cmd,
            "user": ctx.user,
            "workdir": ctx.workdir,
            "envs": ctx.envs,
            "warm_pool": True,
            "layer_key": out.layer_key,
            "cached_steps": out.cached_steps,
            "new_tags": build.tags,
        }
        await asyncio.to_thread(storage.publish_build, build.template_id, rootfs, meta, self._settings)
        build.log(f"Published build {build.build_id} of {build.template_id}", step=FINALIZE_STEP)
        if self._snapshots is not None:
            info = templates.load(build.template_id, self._settings)
            made = time.monotonic()
            try:
                await self._snapshots.make(info, self._runtimes.for_template(info.image))
            except ForkyardError as exc:
                raise StepFailed(
                    f"making the template's snapshot failed: {exc.message}", FINALIZE_STEP
                ) from None
            build.log(f"Template snapshot made in {time.monotonic() - made:.1f} s", step=FINALIZE_STEP)
        if self._collect is not None:  # the previous build's snapshot is gone: its root may be free
            await self._collect()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        await self._envd.close()


def step_keys(base_key: str | None, steps: list[BuildStep]) -> list[str]:
    """Each step's cache key, E2B's layer keys: a hash of the previous key (the first step's is
    the base's), the step's type, arguments and files hash. The user, work dir and envs in effect
    at a step follow from the base and the steps before it, so the chain covers them. No base
    key (an unknown parent): no keys, nothing is cached."""
    if base_key is None:
        return []
    keys: list[str] = []
    previous = base_key
    for item in steps:
        previous = _digest([previous, item.type, *item.args, item.files_hash or ""])
        keys.append(previous)
    return keys


def _digest(parts: list[str | None]) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _step_line(index: int, count: int, item: BuildStep) -> str:
    return f"[builder {index}/{count}] {item.type} {' '.join(item.args)}".rstrip()


def _registry_identity(auth: RegistryAuth | None) -> list[str]:
    """Who pulled the image (never the secret): a root pulled with one account's credentials is
    not reused for a build that has none or another's."""
    if auth is None:
        return [""]
    if auth.type == "gcp":
        try:
            email = json.loads(auth.service_account_json or "{}").get("client_email", "")
        except (ValueError, AttributeError):
            email = ""
        return [auth.type, str(email)]
    return [auth.type, auth.aws_access_key_id or auth.username or ""]


def _check_registry(auth: RegistryAuth) -> None:
    needed = {
        "registry": ("username", "password"),
        "aws": ("aws_access_key_id", "aws_secret_access_key", "aws_region"),
        "gcp": ("service_account_json",),
    }.get(auth.type)
    if needed is None:
        raise Invalid(f"fromImageRegistry type '{auth.type}' is unknown (registry, aws or gcp)")
    missing = [name for name in needed if not getattr(auth, name)]
    if missing:
        raise Invalid(f"fromImageRegistry of type '{auth.type}' needs {', '.join(missing)}")
    if auth.type == "gcp":
        try:
            json.loads(auth.service_account_json or "")
        except ValueError:
            raise Invalid("fromImageRegistry serviceAccountJson is not JSON") from None


def registry_credentials(auth: RegistryAuth | None) -> tuple[str | None, str | None]:
    """skopeo's username and password for a registry: as given (``registry``), Google's
    ``_json_key`` with the service account's key (``gcp``), or the token ECR's
    ``GetAuthorizationToken`` returns for the access key (``aws``; boto3, which honours
    ``AWS_ENDPOINT_URL_ECR``)."""
    if auth is None:
        return None, None
    if auth.type == "gcp":
        return "_json_key", auth.service_account_json
    if auth.type == "aws":
        return _ecr_credentials(auth)
    return auth.username, auth.password


def _ecr_credentials(auth: RegistryAuth) -> tuple[str, str]:
    import boto3  # only builds from ECR need it
    import botocore.exceptions

    client = boto3.client(
        "ecr",
        region_name=auth.aws_region,
        aws_access_key_id=auth.aws_access_key_id,
        aws_secret_access_key=auth.aws_secret_access_key,
    )
    try:
        data = client.get_authorization_token()["authorizationData"][0]
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, LookupError) as exc:
        raise images.ImageError(f"ECR refused the access key: {type(exc).__name__}") from None
    username, _, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
    return username, password


def _owner(user: str) -> str:
    """``chown``'s argument: ``user`` alone means the user and its login group."""
    return user if ":" in user else f"{user}:"


def _resolve(cwd: str, path: str) -> str:
    """An absolute path for a step's path argument (relative ones are against the work dir)."""
    joined = PurePosixPath(cwd) / path
    parts: list[str] = []
    for part in joined.parts[1:]:
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


_STEP_TYPES = ("RUN", "COPY", "ENV", "WORKDIR", "USER")

_PROVISION = r"""
set -e
if ! id user >/dev/null 2>&1; then
  if command -v useradd >/dev/null 2>&1; then
    useradd --create-home --uid 1000 --shell "$(command -v bash || echo /bin/sh)" user
  elif command -v adduser >/dev/null 2>&1; then
    adduser -D -u 1000 user
  else
    echo 'user:x:1000:1000::/home/user:/bin/sh' >> /etc/passwd
    echo 'user:x:1000:' >> /etc/group
    mkdir -p /home/user && chown 1000:1000 /home/user
  fi
fi
if [ -d /etc/sudoers.d ]; then
  echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/user && chmod 440 /etc/sudoers.d/user
fi
[ -s /etc/resolv.conf ] || printf 'nameserver 1.1.1.1\nnameserver 8.8.8.8\n' > /etc/resolv.conf
[ -s /etc/hostname ] || echo sandbox > /etc/hostname
grep -qs sandbox /etc/hosts || printf '127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n' >> /etc/hosts
"""

#: Docker's COPY: a lone directory is copied by its entries; a lone file to ``dest`` (into it
#: when it ends in / or is a directory); several matches into the directory ``dest``.
_COPY = r"""
set -e
t=$(mktemp -d /tmp/.forkyard-copy.XXXXXX)
tar -xf {archive} -C "$t"
rm -f {archive}
chown -R {owner} "$t"
if [ -n {mode} ]; then find "$t" -type f -exec chmod {mode} {{}} +; fi
cd "$t"
dest={dest}
set -- {pattern}
[ -e "$1" ] || [ -L "$1" ] || {{ echo "COPY: nothing matches {pattern}" >&2; exit 1; }}
copy_entries() {{ for e in "$1"/* "$1"/.[!.]* "$1"/..?*; do
  if [ -e "$e" ] || [ -L "$e" ]; then cp -a "$e" "$2"/; fi; done; }}
if [ $# -eq 1 ] && [ -d "$1" ] && [ ! -L "$1" ]; then
  mkdir -p "$dest" && copy_entries "$1" "$dest"
elif [ $# -eq 1 ] && [ "${{dest%/}}" = "$dest" ] && [ ! -d "$dest" ]; then
  mkdir -p "$(dirname "$dest")" && cp -a "$1" "$dest"
else
  mkdir -p "$dest"
  for f in "$@"; do
    if [ -d "$f" ] && [ ! -L "$f" ]; then copy_entries "$f" "$dest"; else cp -a "$f" "$dest"/; fi
  done
fi
cd / && rm -rf "$t"
"""
