"""The template builder's pieces that need no sandbox: names and tags, paths, image names, upload
links, spec checks, publishing a build. (End to end through the SDK: tests/system/test_template_build.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.errors import Forbidden, Invalid
from agentenv.orchestrator import templates
from agentenv.orchestrator.builder import BuildSpec, BuildStep, RegistryAuth, TemplateBuilder, _resolve
from agentenv.orchestrator.runtimes import RuntimeSet
from agentenv.storage import templates as storage
from agentenv.storage.images import oci_reference
from tests.support.loopback import LoopbackRuntime


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path)


@pytest.fixture
def builder(settings: Settings) -> TemplateBuilder:
    return TemplateBuilder(settings, RuntimeSet(settings, LoopbackRuntime(settings)), None)


def test_names_and_tags() -> None:
    assert storage.split_name("my-tpl") == ("my-tpl", None)
    assert storage.split_name("my-tpl:v1.2") == ("my-tpl", "v1.2")
    for bad in ("", "a b", "x:", "x:a:b", "../x", "team/x"):
        with pytest.raises(Invalid):
            storage.split_name(bad)


def test_step_paths_resolve_against_the_work_dir() -> None:
    assert _resolve("/home/user", "work") == "/home/user/work"
    assert _resolve("/home/user", "/srv/app/") == "/srv/app"
    assert _resolve("/home/user", "../../etc/./x") == "/etc/x"
    assert _resolve("/", "..") == "/"


def test_image_names_as_docker_reads_them() -> None:
    assert oci_reference("python:3") == "docker://docker.io/library/python:3"
    assert oci_reference("e2bdev/base") == "docker://docker.io/e2bdev/base"
    assert oci_reference("127.0.0.1:5000/a/b:t") == "docker://127.0.0.1:5000/a/b:t"
    assert oci_reference("ghcr.io/x/y") == "docker://ghcr.io/x/y"
    assert oci_reference("localhost/img") == "docker://localhost/img"


def test_request_checks_names_tags_and_limits(builder: TemplateBuilder) -> None:
    build = builder.request("tpl:v1", ["stable", "v1"], 2, 1024)
    assert (build.template_id, build.tags, build.status) == ("tpl", ["v1", "stable"], "waiting")
    assert builder.request("tpl", [], None, None).tags == [storage.DEFAULT_TAG]
    with pytest.raises(Forbidden):
        builder.request("base", [], None, None)
    with pytest.raises(Invalid):
        builder.request("tpl", ["bad tag"], None, None)
    with pytest.raises(Invalid):
        builder.request("tpl", [], 0, None)
    with pytest.raises(Invalid):
        builder.request("tpl", [], None, 64)


def test_spec_checks(builder: TemplateBuilder) -> None:
    builder.check_spec(BuildSpec(from_template="base", steps=[BuildStep("RUN", ["true"])]))
    bad = [
        BuildSpec(),
        BuildSpec(from_template="base", from_image="debian"),
        BuildSpec(from_image="x", registry=RegistryAuth("aws")),
        BuildSpec(from_template="base", steps=[BuildStep("ADD", ["a"])]),
        BuildSpec(from_template="base", steps=[BuildStep("COPY", ["a", "/b"])]),
        BuildSpec(from_template="base", steps=[BuildStep("RUN", [])]),
    ]
    for spec in bad:
        with pytest.raises(Invalid):
            builder.check_spec(spec)


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_upload_links_are_signed_and_cached(builder: TemplateBuilder) -> None:
    files_hash = "ab" * 32
    present, url = builder.upload_link("tpl", files_hash, "http://127.0.0.1:3000/")
    assert present is False and url is not None
    query = dict(p.split("=") for p in url.split("?", 1)[1].split("&"))
    with pytest.raises(Forbidden):
        asyncio.run(builder.receive_upload(files_hash, int(query["expires"]), "0" * 64, _chunks(b"x")))
    with pytest.raises(Forbidden):  # the signature covers the expiry
        asyncio.run(builder.receive_upload(files_hash, 1, query["signature"], _chunks(b"x")))
    asyncio.run(
        builder.receive_upload(files_hash, int(query["expires"]), query["signature"], _chunks(b"a", b"b"))
    )
    assert (builder.files_dir / files_hash).read_bytes() == b"ab"
    assert builder.upload_link("tpl", files_hash, "http://127.0.0.1:3000") == (True, None)
    with pytest.raises(Invalid):
        builder.upload_link("tpl", "../../etc", "http://x")


def test_publish_tags_and_delete(settings: Settings, tmp_path: Path) -> None:
    def publish(build_id: str, tags: list[str]) -> None:
        staging = storage.build_staging("tpl", build_id, settings)
        (staging / "rootfs").mkdir()
        (staging / "rootfs" / "marker").write_text(build_id)
        meta = {
            "build_id": build_id,
            "start_cmd": "serve",
            "ready_cmd": "true",
            "user": "root",
            "new_tags": tags,
        }
        storage.publish_build("tpl", staging / "rootfs", meta, settings)

    publish("b1", ["v1"])
    info = templates.load("tpl:v1", settings)
    assert info.build_id == "b1" and info.pooled is False
    assert info.start is not None and (info.start.start_cmd, info.start.user) == ("serve", "root")
    publish("b2", ["v2"])
    assert (templates.load("tpl", settings).image.rootfs / "marker").read_text() == "b2"
    with pytest.raises(templates.TemplateNotFound):  # only the newest build is kept
        templates.load("tpl:v1", settings)
    storage.set_tags("tpl", settings, {"prod": "b2"}, ["v1"])
    assert set(storage.read_metadata("tpl", settings)["tags"]) == {"v2", "prod"}
    assert templates.load("tpl:prod", settings).build_id == "b2"
    assert json.loads((settings.templates_dir / "tpl" / "template.json").read_text())["build_id"] == "b2"
    storage.delete_template("tpl", settings)
    assert not storage.is_built("tpl", settings)
    with pytest.raises(templates.TemplateNotFound):
        templates.load("tpl", settings)
