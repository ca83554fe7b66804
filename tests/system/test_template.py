"""Template builds: the shared base cache is reused, builds are atomic and serialised, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from forkyard.config import Settings
from forkyard.errors import Invalid, NotFound
from forkyard.storage.templates import (
    COMPLETE_MARKER,
    TemplateError,
    build_template,
    collect_dropped,
    is_built,
    list_templates,
    load_template,
    template_dir,
)
from forkyard.types import TemplateImage

pytestmark = pytest.mark.requires_root("template builds (debootstrap, chroot)")


def test_base_template_cache_is_reused(forkyard_settings: Settings, base_template: TemplateImage) -> None:
    meta_before = (base_template.rootfs.parent / "template.json").read_text()
    started = time.monotonic()
    again = build_template("base", forkyard_settings)
    assert time.monotonic() - started < 1.0
    assert again == base_template
    assert (base_template.rootfs.parent / "template.json").read_text() == meta_before
    assert (base_template.rootfs / "usr/bin/python3").exists()
    assert (base_template.rootfs / ".forkyard").is_dir()
    assert "user:x:1000:1000" in (base_template.rootfs / "etc/passwd").read_text()
    assert "base" in [t["template_id"] for t in list_templates(forkyard_settings)]


def test_cli_build_is_instant_when_built_and_lists(
    forkyard_settings: Settings, base_template: TemplateImage
) -> None:
    env = {
        **os.environ,
        "FORKYARD_DATA_DIR": str(forkyard_settings.data_dir),
        "FORKYARD_TEMPLATES_PATH": str(forkyard_settings.templates_dir),
    }
    cli = [sys.executable, "-m", "forkyard.cli.main", "template"]
    started = time.monotonic()
    out = subprocess.run([*cli, "build", "base"], env=env, capture_output=True, text=True, check=True).stdout
    assert "already built" in out and str(base_template.rootfs) in out
    assert time.monotonic() - started < 15  # interpreter start-up; no build work
    listing = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, check=True).stdout
    assert listing.startswith("base\t") or "\nbase\t" in listing


def isolated(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", templates_path=tmp_path / "templates")


def test_busybox_template_build_atomic_and_concurrent(tmp_path: Path) -> None:
    settings = isolated(tmp_path)
    tdir = template_dir("busybox", settings)
    # A leftover of an interrupted build must be redone, never used.
    (tdir / ".rootfs.partial" / "junk").mkdir(parents=True)
    assert not is_built("busybox", settings)
    with pytest.raises(TemplateError, match="not built"):
        load_template("busybox", settings)

    results: list[TemplateImage] = []
    threads = [
        threading.Thread(target=lambda: results.append(build_template("busybox", settings))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len({r.rootfs for r in results}) == 1
    image = results[0]
    assert (tdir / COMPLETE_MARKER).is_file() and not (tdir / ".rootfs.partial").exists()
    assert (image.rootfs / "bin/busybox").is_file() and (image.rootfs / "bin/sh").is_symlink()
    assert not (image.rootfs / "usr/bin/python3").exists() and not (image.rootfs / "lib").exists()
    assert (image.vcpus, image.memory_mb) == (1, 256)

    # --force builds a new tree and retires the old one (live sandboxes may still use it).
    marker = image.rootfs / "etc/old-tree"
    marker.write_text("x")
    rebuilt = build_template("busybox", settings, force=True)
    assert not (rebuilt.rootfs / "etc/old-tree").exists()
    retired = list(tdir.glob(".rootfs.retired-*"))
    assert len(retired) == 1 and (retired[0] / "etc/old-tree").exists()
    build_template("busybox", settings, force=True)
    assert len(list(tdir.glob(".rootfs.retired-*"))) == 2
    # Freed by the orchestrator's collection once no sandbox or snapshot records the root.
    collect_dropped(settings.templates_dir, {str(tdir / "rootfs")})
    assert len(list(tdir.glob(".rootfs.retired-*"))) == 2
    collect_dropped(settings.templates_dir, set())
    assert not list(tdir.glob(".rootfs.retired-*")) and is_built("busybox", settings)


def test_unknown_and_invalid_templates(tmp_path: Path) -> None:
    settings = isolated(tmp_path)
    with pytest.raises(NotFound, match="no build recipe"):
        build_template("nosuch", settings)
    with pytest.raises(Invalid, match="invalid template id"):
        build_template("../etc", settings)
