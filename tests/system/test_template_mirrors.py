"""Template builds through a registry mirror, and the names a build answers to, with the official
SDK against a real ``forkyard serve``:

* ``from_image("ubuntu:22.04")`` with no step after it builds (the image is provisioned in a build
  sandbox like any other), pulled through ``FORKYARD_REGISTRY_MIRRORS`` (Docker Hub is out of reach
  here: tests/support/mirror_registry.py serves images we made, under Docker Hub's names, behind
  credentials); ``FROM docker.io/library/busybox`` in a Dockerfile too;
* ``Sandbox.create("name:<build id>")`` (what Harbor creates after a build) and ``base:default``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template

from tests.support import SHARED_TEMPLATES, base_template_missing, unique_id
from tests.support.mirror_registry import (
    MARKER,
    MIRROR_PASSWORD,
    MIRROR_USER,
    MirrorRegistry,
    mirror_registry,
)
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("template builds run gVisor build sandboxes")


@pytest.fixture(scope="module")
def mirror() -> Iterator[MirrorRegistry]:
    with mirror_registry() as reg:
        yield reg


@pytest.fixture(scope="module")
def server(mirror: MirrorRegistry) -> Iterator[ServerProcess]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    templates = Path(tempfile.mkdtemp(prefix="forkyard-tpl-", dir="/tmp"))
    (templates / "base").symlink_to(SHARED_TEMPLATES / "base")
    env = {"FORKYARD_TEMPLATES_PATH": str(templates), "FORKYARD_REGISTRY_MIRRORS": mirror.settings_json()}
    try:
        with serve(prefix="forkyard-mirror-", extra_env=env) as srv, pytest.MonkeyPatch.context() as mp:
            for key, value in srv.sdk_env.items():
                mp.setenv(key, value)
            yield srv
    finally:
        shutil.rmtree(templates, ignore_errors=True)


def _delete(server: ServerProcess, name: str) -> None:
    httpx.delete(f"{server.url}/templates/{name}", headers=server.headers, timeout=60)


def test_from_image_alone_through_the_mirror_then_create_by_build_id(server: ServerProcess) -> None:
    name = unique_id("tbmirror-")
    info = Template.build(Template().from_image("ubuntu:22.04"), name)
    try:
        sbx = Sandbox.create(f"{name}:{info.build_id}")
        try:
            assert sbx.files.read("/mirror.txt") == MARKER
            # Provisioned as any image is (a busybox image has no bash for the SDK's commands).
            assert "user:x:1000:" in sbx.files.read("/etc/passwd")
        finally:
            sbx.kill()
        plain = Sandbox.create(name)
        plain.kill()
        with pytest.raises(Exception, match="no build tagged"):
            Sandbox.create(f"{name}:00000000-0000-4000-8000-000000000000")
    finally:
        _delete(server, name)


def test_from_image_alone_from_a_registry_named_directly(
    server: ServerProcess, mirror: MirrorRegistry
) -> None:
    """No mirror involved: an image with no step after it is provisioned and published (it
    failed every build with an AssertionError: no build sandbox, yet provisioning in one)."""
    name = unique_id("tbalone-")
    template = Template().from_image(
        f"{mirror.host}/library/busybox:latest", username=MIRROR_USER, password=MIRROR_PASSWORD
    )
    Template.build(template, name)
    try:
        sbx = Sandbox.create(name)
        try:
            assert sbx.files.read("/mirror.txt") == MARKER
            assert "user:x:1000:" in sbx.files.read("/etc/passwd")
        finally:
            sbx.kill()
    finally:
        _delete(server, name)


def test_dockerfile_from_docker_hub_through_the_mirror(server: ServerProcess) -> None:
    name = unique_id("tbhub-")
    dockerfile = (
        "FROM docker.io/library/busybox:latest\n"
        'RUN cp /mirror.txt /copied.txt && echo "$MIRRORED" >> /copied.txt\n'
    )
    Template.build(Template().from_dockerfile(dockerfile), name)
    try:
        sbx = Sandbox.create(name)
        try:
            assert sbx.files.read("/copied.txt") == MARKER + "yes\n"  # the image's Env too
        finally:
            sbx.kill()
    finally:
        _delete(server, name)


def test_the_recipe_base_has_a_default_tag(server: ServerProcess) -> None:
    sbx = Sandbox.create("base:default")
    try:
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        sbx.kill()
