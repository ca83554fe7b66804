"""The template builder's pieces that need no sandbox: names and tags, paths, image names, upload
links, spec checks, publishing a build. (End to end through the SDK: tests/system/test_template_build.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from forkyard.config import Settings
from forkyard.errors import Forbidden, Invalid
from forkyard.orchestrator import templates
from forkyard.orchestrator.builder import (
    BuildSpec,
    BuildStep,
    RegistryAuth,
    TemplateBuilder,
    _resolve,
    step_keys,
)
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.storage import templates as storage
from forkyard.storage.images import oci_reference
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
    # The older build is kept while a tag names it: its tag resolves to its own root and start.
    old = templates.load("tpl:v1", settings)
    assert old.build_id == "b1" and (old.image.rootfs / "marker").read_text() == "b1"
    assert old.image.template_id == "tpl" and old.start is not None and old.start.start_cmd == "serve"
    assert [m["build_id"] for m in storage.kept_builds("tpl", settings)] == ["b1"]
    assert storage.build_metadata("tpl", "b1", settings) is not None
    storage.set_tags("tpl", settings, {"prod": "b2"}, ["v1"])
    assert set(storage.read_metadata("tpl", settings)["tags"]) == {"v2", "prod"}
    with pytest.raises(templates.TemplateNotFound):  # the tag is gone (the build stays a while)
        templates.load("tpl:v1", settings)
    # The template's rootfs is a link to the current build's, which never moves.
    current = templates.load("tpl", settings).image.rootfs
    assert (settings.templates_dir / "tpl" / "rootfs").resolve() == current
    assert templates.load("tpl:prod", settings).build_id == "b2"
    assert json.loads((settings.templates_dir / "tpl" / "template.json").read_text())["build_id"] == "b2"
    storage.delete_template("tpl", settings)
    assert not storage.is_built("tpl", settings)
    with pytest.raises(templates.TemplateNotFound):
        templates.load("tpl", settings)


def test_untagged_builds_stay_a_while_then_go(settings: Settings) -> None:
    roots = {}
    for build_id in ("b1", "b2", "b3", "b4"):
        staging = storage.build_staging("tpl", build_id, settings)
        (staging / "rootfs").mkdir()
        meta = {"build_id": build_id, "new_tags": ["default"]}
        roots[build_id] = storage.publish_build("tpl", staging / "rootfs", meta, settings).rootfs
    # "default" moved on each time: b1..b3 are named by nothing; the newest two of them stay.
    assert [m["build_id"] for m in storage.kept_builds("tpl", settings)] == ["b2", "b3"]
    assert templates.load("tpl:default", settings).build_id == "b4"
    assert storage.kept_build_dir("tpl", "b2", settings) / "rootfs" == roots["b2"]  # never moved
    # b1 is dropped (no lookup or cache finds it) but its root stays while a record names it.
    assert roots["b1"].is_dir() and roots["b2"].is_dir() and roots["b3"].is_dir()
    assert storage.build_metadata("tpl", "b1", settings) is None
    assert storage.collect_dropped(settings.templates_dir, {str(roots["b1"]), str(roots["b4"])}) == []
    assert roots["b1"].is_dir()
    assert storage.collect_dropped(settings.templates_dir, {str(roots["b4"])}) == [str(roots["b1"])]
    assert not roots["b1"].exists() and roots["b2"].is_dir()


def test_a_deleted_template_stays_on_disk_while_something_stands_on_it(settings: Settings) -> None:
    """E2B's delete: the name is gone at once, a sandbox or snapshot on a build keeps its root."""
    roots = {}
    for build_id in ("b1", "b2"):
        staging = storage.build_staging("tpl", build_id, settings)
        (staging / "rootfs").mkdir()
        (staging / "rootfs" / "marker").write_text(build_id)
        meta = {"build_id": build_id, "new_tags": [build_id]}
        roots[build_id] = storage.publish_build("tpl", staging / "rootfs", meta, settings).rootfs
    tdir = settings.templates_dir / "tpl"
    storage.delete_template("tpl", settings)
    with pytest.raises(templates.TemplateNotFound):
        templates.load("tpl:b1", settings)
    assert storage.list_templates(settings) == [] and storage.find_layer("x", settings) is None
    # A paused sandbox records b1's root (through the template's link: the same directory).
    assert storage.collect_dropped(settings.templates_dir, {str(roots["b1"])}) == [str(roots["b2"])]
    assert (roots["b1"] / "marker").read_text() == "b1"
    # A new template of the same name meanwhile is a template of its own.
    staging = storage.build_staging("tpl", "c1", settings)
    (staging / "rootfs").mkdir()
    storage.publish_build("tpl", staging / "rootfs", {"build_id": "c1"}, settings)
    assert [m["build_id"] for m in storage.kept_builds("tpl", settings)] == []
    storage.delete_template("tpl", settings)
    assert sorted(storage.collect_dropped(settings.templates_dir, set())) == sorted(
        [str(roots["b1"]), str(tdir / "builds" / "c1" / "rootfs")]
    )
    assert not tdir.exists()


def test_step_keys_chain_every_earlier_step() -> None:
    steps = [BuildStep("ENV", ["A", "1"]), BuildStep("RUN", ["make"]), BuildStep("COPY", ["a", "/b"], "h1")]
    keys = step_keys("base-key", steps)
    assert len(set(keys)) == 3 and step_keys("base-key", steps) == keys
    # A change anywhere changes that step's key and every later one, never an earlier one.
    changed = step_keys("base-key", [steps[0], BuildStep("RUN", ["make all"]), steps[2]])
    assert changed[0] == keys[0] and changed[1] != keys[1] and changed[2] != keys[2]
    other_files = step_keys("base-key", [*steps[:2], BuildStep("COPY", ["a", "/b"], "h2")])
    assert other_files[:2] == keys[:2] and other_files[2] != keys[2]
    assert step_keys("another-base", steps)[0] != keys[0]
    assert step_keys(None, steps) == []


def _publish_layer(settings: Settings, template_id: str, build_id: str, layer_key: str) -> None:
    staging = storage.build_staging(template_id, build_id, settings)
    (staging / "rootfs").mkdir()
    (staging / "rootfs" / "built-by").write_text(build_id)
    meta = {
        "build_id": build_id,
        "layer_key": layer_key,
        "user": "root",
        "workdir": "/srv",
        "envs": {"A": "1"},
        "new_tags": ["default"],
    }
    storage.publish_build(template_id, staging / "rootfs", meta, settings)


def test_cache_takes_the_longest_cached_run_of_steps(settings: Settings, builder: TemplateBuilder) -> None:
    steps = [BuildStep("RUN", ["one"]), BuildStep("RUN", ["two"]), BuildStep("RUN", ["three"])]
    keys = step_keys("k0", steps)
    _publish_layer(settings, "first", "b1", keys[1])  # a build of the first two steps
    build = builder.request("second", [], None, None)
    hit = builder._cached(build, BuildSpec(from_template="base", steps=steps), keys)
    assert hit is not None and hit.steps == 2
    assert (hit.image.rootfs / "built-by").read_text() == "b1"
    assert (hit.ctx.user, hit.ctx.workdir, hit.ctx.envs) == ("root", "/srv", {"A": "1"})
    assert [e.message for e in build.logs] == [
        "CACHED FROM base",
        "CACHED [builder 1/3] RUN one",
        "CACHED [builder 2/3] RUN two",
    ]
    # skip_cache() before step 2 (the SDK sets force from there on), or force on the whole build.
    forced = [steps[0], BuildStep("RUN", ["two"], force=True), BuildStep("RUN", ["three"], force=True)]
    assert builder._cached(build, BuildSpec(from_template="base", steps=forced), keys) is None
    assert builder._cached(build, BuildSpec(from_template="base", steps=steps, force=True), keys) is None
    # The whole build cached: its root is shared (hard links), not copied.
    _publish_layer(settings, "first", "b2", keys[2])
    full = builder._cached(build, BuildSpec(from_template="base", steps=steps), keys)
    assert full is not None and full.steps == 3
    dest = settings.templates_dir / "shared"
    dest.mkdir()
    storage.share_layer(full.image.rootfs, dest)
    assert (dest / "built-by").stat().st_ino == (full.image.rootfs / "built-by").stat().st_ino


def test_skip_cache_from_the_sdk_forces_its_step_and_the_rest(
    settings: Settings, builder: TemplateBuilder
) -> None:
    from e2b import Template

    from forkyard.api.routes_templates import build_spec
    from forkyard.api.schemas import TemplateBuildStartV2

    def spec_of(template: Any) -> BuildSpec:
        return build_spec(TemplateBuildStartV2.model_validate_json(Template.to_json(template)))

    plain = spec_of(Template().from_template("base").run_cmd("one").run_cmd("two").run_cmd("three"))
    keys = step_keys("k0", plain.steps)
    _publish_layer(settings, "first", "b1", keys[2])
    build = builder.request("second", [], None, None)
    hit = builder._cached(build, plain, keys)
    assert hit is not None and hit.steps == 3
    skipped = spec_of(
        Template().from_template("base").run_cmd("one").skip_cache().run_cmd("two").run_cmd("three")
    )
    assert step_keys("k0", skipped.steps) == keys  # force is no part of the key...
    assert builder._cached(build, skipped, keys) is None  # ...but nothing from step 2 is reused
    _publish_layer(settings, "first", "b2", keys[0])
    again = builder._cached(build, skipped, keys)
    assert again is not None and again.steps == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and trusted.overlay xattrs need root")
def test_a_step_layer_is_the_base_with_the_overlay_layers_applied(settings: Settings, tmp_path: Path) -> None:
    base = tmp_path / "base"
    for rel, text in {
        "etc/keep": "base",
        "etc/changed": "base",
        "etc/gone": "base",
        "opt/x/old": "base",
    }.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(text)
    older, upper = tmp_path / "older", tmp_path / "upper"  # a restored snapshot's layer, the upper
    (older / "etc").mkdir(parents=True)
    (older / "etc/changed").write_text("older")
    (older / "etc/from-older").write_text("older")
    (upper / "etc").mkdir(parents=True)
    (upper / "etc/changed").write_text("upper")
    os.mknod(upper / "etc/gone", stat.S_IFCHR | 0o600, 0)  # a whiteout
    (upper / "opt/x").mkdir(parents=True)
    os.setxattr(upper / "opt/x", "trusted.overlay.opaque", b"y")
    (upper / "opt/x/new").write_text("upper")
    (upper / "link").symlink_to("etc/keep")
    assert storage.seal_step_layer(settings, "k1", base, [upper, older], {"user": "root"})
    assert not storage.seal_step_layer(settings, "k1", base, [upper, older], {})  # kept already
    found = storage.find_layer("k1", settings)
    assert found is not None and found[1]["user"] == "root"
    root = found[0]
    assert (root / "etc/keep").stat().st_ino == (base / "etc/keep").stat().st_ino  # shared
    assert (root / "etc/changed").read_text() == "upper" and (base / "etc/changed").read_text() == "base"
    assert (root / "etc/from-older").read_text() == "older"
    assert not (root / "etc/gone").exists() and (base / "etc/gone").exists()
    assert sorted(p.name for p in (root / "opt/x").iterdir()) == ["new"]  # the opaque dir hid "old"
    assert os.listxattr(root / "opt/x") == [] and os.readlink(root / "link") == "etc/keep"


def test_a_build_id_names_its_build_like_a_tag(settings: Settings) -> None:
    """``name:<build id>`` (what Harbor creates after a build, E2B's) names that build, current
    or kept; an unknown one is still refused."""
    ids = ["5f0c4d2e-0000-4000-8000-000000000001", "5f0c4d2e-0000-4000-8000-000000000002"]
    for build_id in ids:
        staging = storage.build_staging("tpl", build_id, settings)
        (staging / "rootfs").mkdir()
        (staging / "rootfs" / "marker").write_text(build_id)
        storage.publish_build("tpl", staging / "rootfs", {"build_id": build_id, "new_tags": []}, settings)
    for build_id in ids:
        info = templates.load(f"tpl:{build_id}", settings)
        assert info.build_id == build_id and (info.image.rootfs / "marker").read_text() == build_id
    with pytest.raises(templates.TemplateNotFound, match="no build tagged"):
        templates.load("tpl:5f0c4d2e-0000-4000-8000-00000000ffff", settings)


def _recipe_template(settings: Settings, template_id: str, meta: dict[str, Any]) -> None:
    """A template as ``forkyard template build`` leaves it (no builds/, no tags), without debootstrap."""
    tdir = settings.templates_dir / template_id
    (tdir / "rootfs").mkdir(parents=True)
    (tdir / storage.METADATA_FILE).write_text(json.dumps({"template_id": template_id, **meta}))
    (tdir / storage.COMPLETE_MARKER).write_text("2026-12-06T00:00:00+00:00\n")


def test_a_recipe_template_answers_default_and_its_build_id(settings: Settings) -> None:
    _recipe_template(settings, "base", {"recipe": storage.recipe_digest(storage.RECIPES["base"])})
    current = templates.load("base", settings)
    assert templates.load("base:default", settings).image.rootfs == current.image.rootfs
    assert templates.load(f"base:{current.build_id}", settings).build_id == current.build_id
    with pytest.raises(templates.TemplateNotFound, match="no build tagged 'v9'"):
        templates.load("base:v9", settings)


def test_a_recipe_template_of_an_older_recipe_is_not_current(settings: Settings) -> None:
    """``forkyard template build base`` (``make run``, ``make test``) rebuilds a base built from
    another recipe: the recipe's digest is in its template.json."""
    base = storage.RECIPES["base"]
    _recipe_template(settings, "base", {})  # built before recipes had digests
    assert storage.is_built("base", settings) and not storage.is_current("base", settings)
    (settings.templates_dir / "base" / storage.METADATA_FILE).write_text(
        json.dumps({"template_id": "base", "recipe": storage.recipe_digest(base)})
    )
    assert storage.is_current("base", settings)
    # What the recipe installs is in the digest; E2B's base has Node.js, npm and compilers.
    assert {"nodejs", "npm", "build-essential", "python3-pip"} <= set(base.apt_packages)
    changed = storage.TemplateRecipe(packages=base.packages, apt_packages=(*base.apt_packages, "jq"))
    assert storage.recipe_digest(changed) != storage.recipe_digest(base)
