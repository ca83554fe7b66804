"""E2B's step cache and kept builds through the official SDK, against a real ``forkyard serve``.

Three builds of one template: the first runs its steps; the second adds a step, so its first
steps are ``CACHED`` (their files come from the first build's root, not from running them again)
and only the new one runs; the third is the second again, every step cached, so no build sandbox
runs a step and the root is shared with the second build's. A sandbox of the first build keeps
running through the later builds, and its tag still creates sandboxes of it; deleting the
template frees every build. Builds start from ``base``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException
from e2b.template.logger import LogEntry
from e2b.template.main import TemplateClass

from tests.support import SHARED_TEMPLATES, base_template_missing, unique_id
from tests.support.auth_registry import HELLO, PASSWORD, AuthRegistry, auth_registry
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("template builds run gVisor build sandboxes")

#: Unique per run: a step no earlier run of this test has a cached root for.
STAMP_CMD = "date +%s%N > /home/user/stamp.txt"


@pytest.fixture(scope="module")
def templates_dir() -> Iterator[Path]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    templates = Path(tempfile.mkdtemp(prefix="forkyard-tplcache-", dir="/tmp"))
    (templates / "base").symlink_to(SHARED_TEMPLATES / "base")
    yield templates
    shutil.rmtree(templates, ignore_errors=True)


@pytest.fixture(scope="module")
def cache_server(templates_dir: Path) -> Iterator[ServerProcess]:
    with (
        serve(
            prefix="forkyard-cache-",
            # A pause checkpoints to disk at once: its resume restores onto the root it recorded.
            extra_env={"FORKYARD_TEMPLATES_PATH": str(templates_dir), "FORKYARD_PAUSE_FREEZE": "false"},
        ) as server,
        pytest.MonkeyPatch.context() as env,
    ):
        for key, value in server.sdk_env.items():
            env.setenv(key, value)
        yield server


def _build(template: TemplateClass, name: str) -> tuple[list[str], float]:
    logs: list[LogEntry] = []
    started = time.monotonic()
    Template.build(template, name, on_build_logs=logs.append)
    return [e.message for e in logs], time.monotonic() - started


def test_steps_are_cached_and_older_builds_kept(cache_server: ServerProcess, templates_dir: Path) -> None:
    name = unique_id("tc-")
    marker = unique_id("run-")  # no earlier run's cache matches this test's steps
    first = (
        Template().from_template("base").run_cmd(f"echo {marker} > /home/user/marker.txt").run_cmd(STAMP_CMD)
    )
    logs1, seconds1 = _build(first, f"{name}:v1")
    assert not any(m.startswith("CACHED") for m in logs1), logs1
    old = Sandbox.create(f"{name}:v1")
    try:
        stamp1 = old.files.read("/home/user/stamp.txt")
        # A step more: the first two are cached (the stamp is the first build's), the third runs.
        second = first.run_cmd("echo third > /home/user/third.txt")
        logs2, seconds2 = _build(second, f"{name}:v2")
        assert "CACHED [builder 1/3] RUN echo " + marker + " > /home/user/marker.txt" in logs2, logs2
        assert f"CACHED [builder 2/3] RUN {STAMP_CMD}" in logs2
        assert "[builder 3/3] RUN echo third > /home/user/third.txt" in logs2
        # The same again: every step cached, no build sandbox, the root shared with v2's.
        logs3, seconds3 = _build(second, f"{name}:v3")
        assert sum(m.startswith("CACHED [builder") for m in logs3) == 3, logs3
        assert not any(m.startswith("Build sandbox") for m in logs3), logs3
        print(
            f"\nbuilds: first {seconds1:.1f} s, 2 of 3 cached {seconds2:.1f} s, all cached {seconds3:.1f} s"
        )
        tags = {t.tag: t.build_id for t in Template.get_tags(name)}
        assert len({tags["v1"], tags["v2"], tags["v3"]}) == 3
        builds = templates_dir / name / "builds"
        stamps = [builds / tags[v] / "rootfs/home/user/stamp.txt" for v in ("v2", "v3")]
        assert stamps[0].stat().st_ino == stamps[1].stat().st_ino  # v3's root shares v2's files

        new = Sandbox.create(name)
        try:
            assert new.files.read("/home/user/stamp.txt") == stamp1  # cached, not run again
            assert new.files.read("/home/user/third.txt") == "third\n"
        finally:
            new.kill()
        # The first build's sandbox still runs on its root; its tag still creates from it.
        assert old.commands.run("cat /home/user/marker.txt").stdout.strip() == marker
        again = Sandbox.create(f"{name}:v1")
        try:
            assert again.files.read("/home/user/stamp.txt") == stamp1
            assert again.files.exists("/home/user/third.txt") is False
        finally:
            again.kill()
    finally:
        old.kill()
    resp = httpx.delete(f"{cache_server.url}/templates/{name}", headers=cache_server.headers, timeout=60)
    assert resp.status_code == 204
    assert not (templates_dir / name / "builds").exists()
    assert Template.exists(name) is False


@pytest.fixture(scope="module")
def private_registry() -> Iterator[AuthRegistry]:
    with auth_registry() as reg:
        yield reg


def test_build_from_a_registry_that_wants_credentials(
    cache_server: ServerProcess, templates_dir: Path, private_registry: AuthRegistry
) -> None:
    """``from_image(image, username=, password=)``: the pull uses them, nothing keeps them."""
    name = unique_id("tcauth-")
    template = (
        Template()
        .from_image(private_registry.image, username="alice", password=PASSWORD)
        .run_cmd('cat /hello.txt > /copied.txt && echo "$PRIVATE_IMAGE" >> /copied.txt', user="root")
    )
    logs, seconds = _build(template, name)
    print(f"\nbuild from a private registry image: {seconds:.1f} s")
    try:
        sbx = Sandbox.create(name)
        try:
            assert sbx.files.read("/copied.txt") == HELLO + "yes\n"
            # Provisioned as E2B does (a busybox image has no bash for the SDK's commands).
            assert "user:x:1000:" in sbx.files.read("/etc/passwd")
        finally:
            sbx.kill()
        assert not any(PASSWORD in m for m in logs)
        stored = [p.read_text() for p in (templates_dir / name).rglob("template.json")]
        assert stored and not any(PASSWORD in text for text in stored)
        assert PASSWORD not in cache_server.log_tail(1_000_000)
    finally:
        httpx.delete(f"{cache_server.url}/templates/{name}", headers=cache_server.headers, timeout=60)
    # Without the credentials the same image is refused (and no cached root stands in for it).
    with pytest.raises(BuildException, match=r"(?i)unauthorized|authentication"):
        Template.build(Template().from_image(private_registry.image).run_cmd("true"), unique_id("tcnoauth-"))


def test_a_dropped_build_stays_while_a_sandbox_or_snapshot_stands_on_it(
    cache_server: ServerProcess, templates_dir: Path
) -> None:
    """Two rebuilds and a delete of the template (E2B's: its sandboxes keep running, snapshots
    of it keep restoring) leave build 1's root to a sandbox and a snapshot of it; it is freed
    when the sandbox is killed and the snapshot deleted."""
    name = unique_id("tdrop-")
    marker = unique_id("b1-")
    first = Template().from_template("base").run_cmd(f"echo {marker} > /home/user/marker.txt")
    _build(first, name)
    build1 = Template.get_tags(name)[0].build_id
    root1 = templates_dir / name / "builds" / build1 / "rootfs"
    old = Sandbox.create(name)
    snap = None
    try:
        old.files.write("/home/user/mine.txt", "written in the sandbox")
        snap = old.create_snapshot()
        second = first.run_cmd("echo two > /home/user/two.txt")
        _build(second, name)
        _build(second, name)  # every step cached: a third build of its own, no build sandbox
        # Paused (to disk) and resumed, the sandbox of build 1 is on build 1's root, not build 3's.
        old.pause()
        resumed = Sandbox.connect(old.sandbox_id)
        assert resumed.files.read("/home/user/mine.txt") == "written in the sandbox"
        assert resumed.files.exists("/home/user/two.txt") is False
        resp = httpx.delete(f"{cache_server.url}/templates/{name}", headers=cache_server.headers, timeout=60)
        assert resp.status_code == 204 and Template.exists(name) is False
        assert root1.is_dir()
        assert resumed.files.read("/home/user/marker.txt") == f"{marker}\n"  # it runs on
        child = Sandbox.create(snap.snapshot_id, timeout=60)
        try:
            assert child.files.read("/home/user/marker.txt") == f"{marker}\n"
            assert child.files.read("/home/user/mine.txt") == "written in the sandbox"
        finally:
            child.kill()
        resumed.kill()
        assert root1.is_dir()  # the snapshot still stands on it
    finally:
        old.kill()
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)
    assert not root1.exists()
    assert not (templates_dir / name).exists()


def test_every_step_is_cached_not_only_a_builds_last(cache_server: ServerProcess) -> None:
    """E2B caches every step: a build whose step 3 changed reuses steps 1 and 2 of an earlier
    build that went on past them (their files, not a rerun), and runs step 3 only."""
    name = unique_id("tstep-")
    marker = unique_id("steps-")

    def three_steps(last: str) -> TemplateClass:  # a fresh one: the SDK's builder methods mutate it
        return (
            Template()
            .from_template("base")
            .run_cmd(f"echo {marker} > /home/user/marker.txt")
            .run_cmd(STAMP_CMD)
            .run_cmd(last)
        )

    logs1, seconds1 = _build(three_steps("echo a > /home/user/three.txt"), f"{name}:a")
    assert not any(m.startswith("CACHED") for m in logs1), logs1
    logs2, seconds2 = _build(three_steps("echo b > /home/user/three.txt"), f"{name}:b")
    sealed = [m for m in logs1 if "kept as a cache layer" in m]
    print(
        f"\nthree steps: first build {seconds1:.1f} s ({'; '.join(sealed)}); step 3 changed: {seconds2:.1f} s"
    )
    assert f"CACHED [builder 2/3] RUN {STAMP_CMD}" in logs2, "\n".join(logs2)
    assert "[builder 3/3] RUN echo b > /home/user/three.txt" in logs2
    try:
        first, second = Sandbox.create(f"{name}:a"), Sandbox.create(f"{name}:b")
        try:
            assert second.files.read("/home/user/stamp.txt") == first.files.read("/home/user/stamp.txt")
            assert second.files.read("/home/user/three.txt") == "b\n"
            assert second.files.read("/home/user/marker.txt") == f"{marker}\n"
            # The base recipe's ``python`` command (E2B's base template has one).
            assert second.commands.run("python -c 'print(6 * 7)'").stdout.strip() == "42"
        finally:
            first.kill()
            second.kill()
    finally:
        httpx.delete(f"{cache_server.url}/templates/{name}", headers=cache_server.headers, timeout=60)
