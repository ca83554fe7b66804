"""E2B's template builder end to end: the official SDK's ``Template`` / ``AsyncTemplate`` against
a real ``forkyard serve`` (gVisor build sandboxes), including an OCI image served by a local
registry (Debian's ``docker-registry`` on loopback, seeded with an image of the base rootfs made
with umoci and pushed with skopeo).

One server with a templates directory of its own (``base`` linked in from the shared cache), so
the builds never land in the shared cache. Builds are slow here (a build sandbox, a copy of the
root, a template snapshot): one build is reused by several tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import AsyncTemplate, Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException
from e2b.template.logger import LogEntry
from e2b.template.types import BuildInfo, TemplateBuildStatus

from tests.support import SHARED_TEMPLATES, TESTS, base_template_missing, unique_id
from tests.support.base_image_registry import base_image_registry
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("template builds run gVisor build sandboxes")

JS_DIR = TESTS / "js"
#: A create from a built template restores its snapshot: well under a cold boot (~1-9 s here).
FAST_CREATE_SECONDS = 5.0


@pytest.fixture(scope="module")
def templates_dir() -> Iterator[Path]:
    """The build server's templates: ``base`` from the shared cache, and what the tests build."""
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    templates = Path(tempfile.mkdtemp(prefix="forkyard-tpl-", dir="/tmp"))
    (templates / "base").symlink_to(SHARED_TEMPLATES / "base")
    yield templates
    shutil.rmtree(templates, ignore_errors=True)


@pytest.fixture(scope="module")
def build_server(templates_dir: Path) -> Iterator[ServerProcess]:
    with (
        serve(prefix="forkyard-build-", extra_env={"FORKYARD_TEMPLATES_PATH": str(templates_dir)}) as server,
        pytest.MonkeyPatch.context() as env,
    ):
        for key, value in server.sdk_env.items():
            env.setenv(key, value)
        yield server


@pytest.fixture(scope="module")
def context_dir() -> Iterator[Path]:
    ctx = Path(tempfile.mkdtemp(prefix="forkyard-ctx-"))
    (ctx / "hello.txt").write_text("hello from the build context\n")
    (ctx / "app").mkdir()
    (ctx / "app" / "main.py").write_text("print('app')\n")
    yield ctx
    shutil.rmtree(ctx, ignore_errors=True)


@dataclass
class Built:
    info: BuildInfo
    seconds: float
    logs: list[LogEntry]


@pytest.fixture(scope="module")
def built(build_server: ServerProcess, context_dir: Path) -> Iterator[Built]:
    """One build of every step kind the SDK sends, from ``base``, with a start command."""
    name = unique_id("tb-")
    template = (
        Template(file_context_path=str(context_dir))
        .from_template("base")
        .set_envs({"GREETING": "hi-from-env"})
        .run_cmd('echo "$GREETING" > /home/user/env.txt && whoami > /home/user/whoami.txt')
        .copy("hello.txt", "/home/user/")
        .copy("app", "/opt/app", user="root", mode=0o755)
        .set_workdir("/home/user/work")
        .run_cmd("whoami > who.txt && pwd >> who.txt", user="root")
        .set_user("root")
        .run_cmd("id -u > /root/uid.txt")
        .make_symlink("/opt/app/main.py", "/usr/local/bin/app-main")
        .set_user("user")
        .set_start_cmd(
            "echo started-by-start-cmd > /home/user/work/started.txt && python3 -m http.server 8000",
            wait_for_port(8000),
        )
    )
    logs: list[LogEntry] = []
    started = time.monotonic()
    info = Template.build(template, f"{name}:v1", tags=["extra"], on_build_logs=logs.append)
    yield Built(info, time.monotonic() - started, logs)
    # Deleted by test_tags_exists_status_and_delete; again here in case it failed before.
    httpx.delete(f"{build_server.url}/templates/{name}", headers=build_server.headers, timeout=60)


def _origin_message(server: ServerProcess, sandbox_id: str) -> str:
    resp = httpx.get(f"{server.url}/v2/sandboxes/{sandbox_id}/logs", headers=server.headers, timeout=30)
    resp.raise_for_status()
    messages = [e["message"] for e in resp.json()["logs"]]
    return next(m for m in messages if m.startswith("sandbox "))


def test_build_from_base_every_step_and_start_command(build_server: ServerProcess, built: Built) -> None:
    print(f"\nbuild from base: {built.seconds:.1f} s")
    assert built.info.template_id == built.info.name.split(":")[0]
    assert set(built.info.tags) == {"v1", "extra"}
    messages = [e.message for e in built.logs]
    assert any(m.startswith("[builder 2/10] RUN") for m in messages), messages
    assert "Ready command passed" in messages
    started = time.monotonic()
    sbx = Sandbox.create(built.info.template_id)
    create_seconds = time.monotonic() - started
    try:
        print(f"create from the built template: {create_seconds:.2f} s")
        assert create_seconds < FAST_CREATE_SECONDS
        # It claimed the template's snapshot (made at the end of the build), it did not boot.
        assert "template's snapshot" in _origin_message(build_server, sbx.sandbox_id)
        out = sbx.commands.run(
            "cat /home/user/env.txt /home/user/whoami.txt /home/user/hello.txt /home/user/work/who.txt"
        ).stdout
        assert out.split("\n")[:5] == [
            "hi-from-env",
            "user",
            "hello from the build context",
            "root",
            "/home/user/work",
        ]
        assert sbx.commands.run("cat /root/uid.txt", user="root").stdout.strip() == "0"
        # COPY as root with a mode; make_symlink; the start command runs, from the last work dir.
        assert sbx.commands.run("stat -c '%U %a' /opt/app/main.py").stdout.strip() == "root 755"
        assert sbx.commands.run("readlink /usr/local/bin/app-main").stdout.strip() == "/opt/app/main.py"
        assert sbx.files.read("/home/user/work/started.txt") == "started-by-start-cmd\n"
        code = sbx.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/").stdout
        assert code == "200"
        assert sbx.commands.run("pgrep -f 'http.server 8000'").exit_code == 0
        # The base template's ``python`` command (E2B's base has one) is python3.
        assert sbx.commands.run("python --version").stdout.startswith("Python 3.")
    finally:
        sbx.kill()
    # A tagged name resolves too.
    tagged = Sandbox.create(f"{built.info.template_id}:v1")
    try:
        assert tagged.files.read("/home/user/hello.txt") == "hello from the build context\n"
    finally:
        tagged.kill()


def test_tags_exists_status_and_delete(build_server: ServerProcess, context_dir: Path, built: Built) -> None:
    name = built.info.template_id
    assert Template.exists(name) is True
    assert Template.exists(unique_id("missing-")) is False
    assert {t.tag for t in Template.get_tags(name)} == {"v1", "extra"}
    assigned = Template.assign_tags(f"{name}:v1", ["prod", "stable"])
    assert assigned.build_id == built.info.build_id and set(assigned.tags) == {"prod", "stable"}
    Template.remove_tags(name, "stable")
    tags = {t.tag: t.build_id for t in Template.get_tags(name)}
    assert tags == dict.fromkeys(["v1", "extra", "prod"], built.info.build_id)
    status = Template.get_build_status(built.info, logs_offset=0)
    assert status.status == TemplateBuildStatus.READY and status.log_entries
    # Delete (the last use of the build): the template, its snapshot, its tags are gone.
    resp = httpx.delete(f"{build_server.url}/templates/{name}", headers=build_server.headers, timeout=60)
    assert resp.status_code == 204
    assert Template.exists(name) is False
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(name)
    with pytest.raises(Exception, match="not found"):
        Template.get_tags(name)
    # The node's recipe template is not the build API's to delete.
    resp = httpx.delete(f"{build_server.url}/templates/base", headers=build_server.headers, timeout=60)
    assert resp.status_code == 403 and resp.json()["code"] == 403


def test_failing_step_returns_its_logs_in_the_exception(build_server: ServerProcess) -> None:
    template = (
        Template()
        .from_template("base")
        .run_cmd("echo fine")
        .run_cmd("echo about-to-fail-output && echo on-stderr >&2 && exit 3")
        .run_cmd("echo never-runs")
    )
    name = unique_id("tbfail-")
    info = Template.build_in_background(template, name)
    deadline = time.monotonic() + 120
    while (status := Template.get_build_status(info)).status in (
        TemplateBuildStatus.BUILDING,
        TemplateBuildStatus.WAITING,
    ):
        assert time.monotonic() < deadline, "the failing build did not end"
        time.sleep(0.5)
    assert status.status == TemplateBuildStatus.ERROR
    assert status.reason is not None and status.reason.step == "2"
    assert "exit status 3" in status.reason.message and "about-to-fail-output" in status.reason.message
    assert any("on-stderr" in e.message for e in status.reason.log_entries)
    # Through Template.build the same failure is the SDK's BuildException.
    with pytest.raises(BuildException, match="about-to-fail-output") as raised:
        Template.build(template, name)
    assert "exit status 3" in str(raised.value)
    assert Template.exists(name) is False


def test_a_template_that_is_only_its_base(build_server: ServerProcess) -> None:
    """E2B's suite builds `Template().from_template("base")` with nothing after it and the cache
    skipped: nothing runs, and the build is its parent's root (it failed an assertion before)."""
    name = unique_id("tbonly-")
    Template.build(Template().from_template("base"), name, skip_cache=True)
    sbx = Sandbox.create(name)
    try:
        assert sbx.commands.run("test -x /usr/bin/python3 && whoami").stdout.strip() == "user"
    finally:
        sbx.kill()
        httpx.delete(f"{build_server.url}/templates/{name}", headers=build_server.headers, timeout=60)


def test_bad_input_gets_e2b_errors(build_server: ServerProcess) -> None:
    url, headers = build_server.url, build_server.headers
    bad = httpx.post(f"{url}/v3/templates", json={"name": "no spaces allowed"}, headers=headers)
    assert bad.status_code == 400 and bad.json()["code"] == 400
    made = httpx.post(f"{url}/v3/templates", json={"name": unique_id("tbbad-")}, headers=headers).json()
    start = f"{url}/v2/templates/{made['templateID']}/builds/{made['buildID']}"
    both = httpx.post(start, json={"fromTemplate": "base", "fromImage": "x"}, headers=headers)
    assert both.status_code == 400 and "exactly one" in both.json()["message"]
    step = httpx.post(start, json={"fromTemplate": "base", "steps": [{"type": "NOPE"}]}, headers=headers)
    assert step.status_code == 400 and "unknown type" in step.json()["message"]
    missing = httpx.get(f"{url}/templates/{made['templateID']}/builds/not-a-build/status", headers=headers)
    assert missing.status_code == 404 and missing.json()["code"] == 404
    link = httpx.get(f"{url}/templates/{made['templateID']}/files/{'ab' * 32}", headers=headers).json()
    assert link["present"] is False
    forged = link["url"].replace("signature=", "signature=00")
    assert httpx.put(forged, content=b"x").status_code == 403


# -- an OCI image from a local registry ----------------------------------------------------------


@pytest.fixture(scope="module")
def registry_image() -> Iterator[str]:
    """``docker-registry`` on loopback holding ``forkyard/base:latest``, an image made from the
    base rootfs (tests/support/base_image_registry.py)."""
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with base_image_registry() as registry:
        print(f"\nseeding the registry: {registry.seconds:.1f} s")
        yield registry.image()


def test_dockerfile_from_an_image_in_a_local_registry(
    build_server: ServerProcess, registry_image: str, context_dir: Path
) -> None:
    """``from_dockerfile`` (the SDK parses it into steps; its FROM is the registry's image),
    built with ``AsyncTemplate``."""
    dockerfile = (
        f"FROM {registry_image}\n"
        "ENV BUILT_WITH=dockerfile\n"
        'RUN echo "$BUILT_WITH $FROM_IMAGE_ENV" > /built.txt\n'
        "WORKDIR /srv/app\n"
        "COPY hello.txt .\n"
        "RUN pwd > /srv/pwd.txt\n"
    )
    template = AsyncTemplate(file_context_path=str(context_dir)).from_dockerfile(dockerfile)
    name = unique_id("tbimg-")
    started = time.monotonic()
    asyncio.run(AsyncTemplate.build(template, name))
    print(f"\nbuild from a registry image (Dockerfile): {time.monotonic() - started:.1f} s")
    try:
        sbx = Sandbox.create(name)
        try:
            assert sbx.files.read("/built.txt") == "dockerfile yes\n"
            assert sbx.files.read("/srv/app/hello.txt") == "hello from the build context\n"
            assert sbx.files.read("/srv/pwd.txt") == "/srv/app\n"
            # The SDK's Dockerfile conversion ends as user ``user`` in /home/user.
            assert sbx.commands.run("whoami").stdout.strip() == "user"
        finally:
            sbx.kill()
    finally:
        httpx.delete(f"{build_server.url}/templates/{name}", headers=build_server.headers, timeout=60)


def test_js_sdk_template_build(build_server: ServerProcess, context_dir: Path) -> None:
    if shutil.which("node") is None:
        pytest.fail("node is not installed (scripts/bootstrap.sh --test installs it)")
    if not (JS_DIR / "node_modules" / "e2b").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=JS_DIR, check=True)
    name = unique_id("tbjs-")
    try:
        proc = subprocess.run(
            ["node", "template_build.mjs", name, str(context_dir)],
            cwd=JS_DIR,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **build_server.sdk_env},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"\nJS SDK build: {out['buildMs'] / 1000:.1f} s")
        assert out["existsBefore"] is False and out["existsAfter"] is True
        assert out["read"] == "js-build hello from the build context\n"
        assert out["failed"] and "exit status 7" in out["failed"]
    finally:
        httpx.delete(f"{build_server.url}/templates/{name}", headers=build_server.headers, timeout=60)


def test_cli_builds_with_the_same_builder(
    build_server: ServerProcess, templates_dir: Path, context_dir: Path
) -> None:
    """``forkyard template build`` on the server's data dir; the server then creates from it
    (by a boot: the CLI makes no snapshot) with the start command running."""
    name = unique_id("tbcli-")
    env = {
        **os.environ,
        "FORKYARD_DATA_DIR": str(build_server.data_dir),
        "FORKYARD_TEMPLATES_PATH": str(templates_dir),
    }
    cmd = [
        sys.executable, "-m", "forkyard.cli.main", "template", "build", name,
        "--from-template", "base", "--context", str(context_dir),
        "--copy", "hello.txt:/home/user/", "--run", "echo cli-step > /home/user/cli.txt",
        "--start-cmd", "echo up > /home/user/up.txt && sleep infinity",
        "--ready-cmd", "test -f /home/user/up.txt",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=TESTS.parent)
    print(f"\nCLI build: {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[1] [builder 1/2] COPY hello.txt /home/user/" in proc.stdout and "ready" in proc.stdout
    try:
        sbx = Sandbox.create(name)
        try:
            assert sbx.files.read("/home/user/cli.txt") == "cli-step\n"
            assert sbx.files.read("/home/user/hello.txt") == "hello from the build context\n"
            assert sbx.files.read("/home/user/up.txt") == "up\n"
        finally:
            sbx.kill()
    finally:
        httpx.delete(f"{build_server.url}/templates/{name}", headers=build_server.headers, timeout=60)
    no_base = [*cmd[:5], unique_id("tbcli-"), "--run", "true"]
    bad = subprocess.run(no_base, capture_output=True, text=True, timeout=60, env=env, cwd=TESTS.parent)
    assert bad.returncode == 1 and "exactly one of fromTemplate and fromImage" in bad.stderr
