"""Template root file systems, built once with debootstrap and shared read-only by sandboxes.

Layout under ``settings.templates_dir`` (``{data_dir}/templates`` unless set), per template::

    rootfs/         the finished tree (never modified after the build)
    template.json   id and default limits (vcpus, memory, disk), build time
    .complete       written last: a template without it is a half-built leftover

A build happens in ``.rootfs.partial`` next to ``rootfs`` and is renamed into place, so a reader
never sees a half-built tree; an interrupted build is removed and redone by the next build. An
exclusive ``flock`` on ``.lock`` serialises concurrent builds (also across processes).

A template built through the build API keeps each build under ``builds/<build id>/`` (``rootfs``
and that build's ``template.json``; the template's ``rootfs`` is a link to the current one's):
the current build, every build a tag names, and the newest few untagged ones. ``name:tag``
resolves to the build its tag points at; a build's root never moves while it is kept, so
sandboxes of an older build keep running (and resume) on it.
A build's ``template.json`` names its *layer key* (the step cache key of its last step, see
:mod:`forkyard.orchestrator.builder`): :func:`find_layer` finds a finished root of that key in
any template, which a later build takes as its starting point (hard-linked, read-only shared).
Every earlier step's root is kept too, as a *step layer* under ``{data_dir}/build-steps/<key>/``
(:func:`seal_step_layer`), so a build with step *k* changed starts from step *k - 1*'s.

A build that is dropped (an untagged one past the newest few, every build of a deleted template)
loses its ``.complete`` marker and gets ``.dropped`` instead, but its root stays where it is:
running and paused sandboxes and snapshots record that path (a resume, a restore or a fork
mounts it again). A recipe template's root replaced by ``--force`` is renamed aside
(``.rootfs.retired-*``). :func:`collect_dropped` frees both once no record names them (the
orchestrator passes the roots its sandbox and snapshot rows name, see
:meth:`forkyard.orchestrator.catalog.SnapshotCatalog.collect_garbage`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkyard.config import Settings
from forkyard.errors import Failed, ForkyardError, Invalid, NotFound
from forkyard.storage.atomic import write_atomic, write_json_atomic
from forkyard.types import SANDBOX_USER, TemplateImage

DEFAULT_MIRROR = "http://deb.debian.org/debian"
SANDBOX_UID = 1000
COMPLETE_MARKER = ".complete"
#: A build no longer listed, kept until nothing names its root (then :func:`collect_dropped`).
DROPPED_MARKER = ".dropped"
RETIRED_PREFIX = ".rootfs.retired-"
METADATA_FILE = "template.json"
#: Builds of the build API, one directory per build id (the current one, tagged ones, a few more).
BUILDS_DIR = "builds"
#: Older builds no tag names that stay listed (tags and the step cache find them).
UNTAGGED_BUILDS_KEPT = 2
#: Per-step cache layers (under ``data_dir``), and how many stay (least recently used go).
STEP_LAYERS_DIR = "build-steps"
STEP_LAYERS_KEPT = 64


class TemplateError(ForkyardError):
    """A template is unknown, missing or failed to build: catch this for any of them; each one
    raised is also the error kind that says which."""


class InvalidTemplateId(TemplateError, Invalid):
    pass


class TemplateNotBuilt(TemplateError, NotFound):
    """Not (completely) built, or no recipe to build it from."""


class TemplateBuildFailed(TemplateError, Failed):
    pass


@dataclass(frozen=True)
class TemplateRecipe:
    #: "debootstrap" (a Debian suite plus packages) or "busybox" (static busybox only, no
    #: python, no libc: proves envd runs from its own bundle in any root file system).
    kind: str = "debootstrap"
    suite: str = "bookworm"
    packages: tuple[str, ...] = ()
    #: Installed with apt-get in the finished root (debootstrap's own resolver cannot install
    #: packages with alternatives in their dependencies, npm's among them).
    apt_packages: tuple[str, ...] = ()
    vcpus: int = 2
    memory_mb: int = 512
    disk_mb: int = 4096


RECIPES: dict[str, TemplateRecipe] = {
    # What E2B's base template (python:3.11 on Debian bookworm, plus Node.js, npm and yarn)
    # offers agent code, from Debian's own archive: compilers, Node.js, pip and venv, git, curl.
    "base": TemplateRecipe(
        kind="debootstrap",
        suite="bookworm",
        packages=(
            "bash",
            "coreutils",
            "python3",
            # E2B's base template has a ``python`` command: Debian's python -> python3 link.
            "python-is-python3",
            "git",
            "curl",
            "ca-certificates",
            "procps",
            "iproute2",
            "sudo",
            "less",
            "findutils",
        ),
        apt_packages=(
            "build-essential",
            "python3-pip",
            "python3-venv",
            "python3-dev",
            "nodejs",
            "npm",
            # Debian names yarn's command ``yarnpkg``; the recipe links ``yarn`` to it.
            "yarnpkg",
            "gh",
            "wget",
            "gnupg",
            "openssh-client",
            "unzip",
            "xz-utils",
        ),
    ),
    "busybox": TemplateRecipe(kind="busybox", suite="", vcpus=1, memory_mb=256, disk_mb=1024),
}
#: Bump when what a recipe build does changes in a way :class:`TemplateRecipe` does not show
#: (``_configure_rootfs``): built templates of an older recipe are rebuilt.
RECIPE_FORMAT = 2


def recipe_digest(recipe: TemplateRecipe) -> str:
    """What a recipe template's build is valid for: the recipe and the build's format. A template
    built from another (or before this existed) is rebuilt by :func:`build_template`."""
    fields = [RECIPE_FORMAT, recipe.kind, recipe.suite, sorted(recipe.packages), sorted(recipe.apt_packages)]
    fields += [recipe.vcpus, recipe.memory_mb, recipe.disk_mb]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


TEMPLATE_ID_RE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
TAG_RE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
#: The tag a build gets when its name names none (E2B's).
DEFAULT_TAG = "default"


def template_dir(template_id: str, settings: Settings) -> Path:
    if not re.fullmatch(TEMPLATE_ID_RE, template_id):
        raise InvalidTemplateId(f"invalid template id {template_id!r}")
    return settings.templates_dir / template_id


def split_name(name: str) -> tuple[str, str | None]:
    """``name`` or ``name:tag`` -> (template id, tag or None), both checked."""
    template_id, sep, tag = name.partition(":")
    if not re.fullmatch(TEMPLATE_ID_RE, template_id) or (sep and not re.fullmatch(TAG_RE, tag)):
        raise InvalidTemplateId(
            f"invalid template name {name!r}: want <name> or <name>:<tag> of letters, digits, '.', '_', '-'"
        )
    return template_id, (tag if sep else None)


def is_built(template_id: str, settings: Settings) -> bool:
    tdir = template_dir(template_id, settings)
    return (tdir / COMPLETE_MARKER).is_file() and (tdir / "rootfs").is_dir()


def load_template(template_id: str, settings: Settings) -> TemplateImage:
    """The finished template, or :class:`TemplateNotBuilt` when it is not (completely) built.
    ``name:tag`` names the template's build of that tag (the current one or a kept older one)."""
    template_id, tag = split_name(template_id)
    tdir = template_dir(template_id, settings)
    if not is_built(template_id, settings):
        raise TemplateNotBuilt(
            f"template {template_id!r} is not built (run: forkyard template build {template_id})"
        )
    meta = read_metadata(template_id, settings)
    wanted = str(meta.get("build_id") or "")
    if tag is not None:
        wanted = _build_of_tag(template_id, tdir, meta, tag, settings)
    build_dir = tdir  # a recipe build (no build id), or the current one made before builds/
    if wanted and (tdir / BUILDS_DIR / wanted / COMPLETE_MARKER).is_file():
        build_dir = kept_build_dir(template_id, wanted, settings)
    elif wanted and wanted != meta.get("build_id"):
        raise TemplateNotBuilt(f"build {wanted} (tag {tag!r}) of template {template_id!r} is gone")
    meta = json.loads((build_dir / METADATA_FILE).read_text())
    return TemplateImage(
        template_id=template_id,
        rootfs=build_dir / "rootfs",
        vcpus=int(meta.get("vcpus", 2)),
        memory_mb=int(meta.get("memory_mb", 512)),
        disk_mb=int(meta.get("disk_mb", 4096)),
        runtime=meta.get("runtime"),
        workdir=str(meta["workdir"]) if meta.get("workdir") else None,
    )


def _build_of_tag(template_id: str, tdir: Path, meta: dict[str, Any], tag: str, settings: Settings) -> str:
    """The build id ``name:tag`` names: the tag's build; else, as E2B's, a build id itself (what
    the SDK and Harbor create after a build: ``name:<build id>``); ``default`` of a recipe
    template (it has no tags) is its current build. "" names the current recipe build."""
    tags = meta.get("tags") or {}
    if tag in tags:
        return str(tags[tag].get("build_id") or "")
    current = str(meta.get("build_id") or "")
    if not current and tag in (DEFAULT_TAG, recipe_build_id(tdir)):
        return ""
    if tag == current or (
        re.fullmatch(r"[A-Za-z0-9-]{1,64}", tag) and (tdir / BUILDS_DIR / tag / COMPLETE_MARKER).is_file()
    ):
        return tag
    raise TemplateNotBuilt(f"template {template_id!r} has no build tagged {tag!r}")


def recipe_build_id(tdir: Path) -> str:
    """The build id of a recipe build (which has none of its own): derived from its completion
    marker's timestamp, so each rebuild is a new build."""
    marker = tdir / COMPLETE_MARKER
    text = marker.read_text().strip() if marker.exists() else tdir.name
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "forkyard-template-build:" + text))


def read_metadata(template_id: str, settings: Settings) -> dict[str, Any]:
    """``template.json`` of a built template ({} when it has none)."""
    path = template_dir(template_id, settings) / METADATA_FILE
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return meta


def kept_build_dir(template_id: str, build_id: str, settings: Settings) -> Path:
    """Where an earlier build of the template is kept (``rootfs``, ``template.json``)."""
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", build_id):
        raise InvalidTemplateId(f"invalid build id {build_id!r}")
    return template_dir(template_id, settings) / BUILDS_DIR / build_id


def build_metadata(template_id: str, build_id: str, settings: Settings) -> dict[str, Any] | None:
    """``template.json`` of the template's build ``build_id`` (current or kept), None if gone."""
    current = read_metadata(template_id, settings)
    if current.get("build_id") == build_id and is_built(template_id, settings):
        return current
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", build_id):
        return None
    path = kept_build_dir(template_id, build_id, settings)
    if not (path / COMPLETE_MARKER).is_file():
        return None
    try:
        meta: dict[str, Any] = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta


def kept_builds(template_id: str, settings: Settings) -> list[dict[str, Any]]:
    """``template.json`` of every earlier build the template keeps (not the current), oldest first."""
    root = template_dir(template_id, settings) / BUILDS_DIR
    current = read_metadata(template_id, settings).get("build_id")
    found = []
    for bdir in root.iterdir() if root.is_dir() else []:
        if bdir.name != current and (bdir / COMPLETE_MARKER).is_file():
            try:
                found.append(json.loads((bdir / METADATA_FILE).read_text()))
            except (OSError, ValueError):
                continue
    return sorted(found, key=lambda m: str(m.get("created_at", "")))


def find_layer(layer_key: str, settings: Settings) -> tuple[Path, dict[str, Any]] | None:
    """A finished root of the step cache key ``layer_key``: a step layer kept after that step,
    else a build (any template, current or kept) that ended with it; with its metadata (the
    context after the step); None when there is none."""
    step = step_layers_dir(settings) / layer_key
    if (step / COMPLETE_MARKER).is_file():
        try:
            meta = json.loads((step / METADATA_FILE).read_text())
            os.utime(step / COMPLETE_MARKER)  # used: the eviction's recency
            return step / "rootfs", meta
        except (OSError, ValueError):
            pass
    root = settings.templates_dir
    if not root.is_dir():
        return None
    for tdir in sorted(root.iterdir()):
        if tdir.is_symlink() or not tdir.is_dir():  # a shared recipe template linked in
            continue
        legacy = [] if (tdir / "rootfs").is_symlink() else [tdir]  # a current build made before builds/
        candidates = [*legacy, *sorted((tdir / BUILDS_DIR).glob("*"))]
        for bdir in candidates:
            if not (bdir / COMPLETE_MARKER).is_file() or not (bdir / "rootfs").is_dir():
                continue
            try:
                meta = json.loads((bdir / METADATA_FILE).read_text())
            except (OSError, ValueError):
                continue
            if meta.get("layer_key") == layer_key:
                return bdir / "rootfs", meta
    return None


def step_layers_dir(settings: Settings) -> Path:
    """Per-step cache layers: ``<step key>/rootfs`` and its ``template.json`` (the context)."""
    return settings.data_dir / STEP_LAYERS_DIR


def seal_step_layer(
    settings: Settings, layer_key: str, base: Path, layers: list[Path], meta: dict[str, Any]
) -> bool:
    """Keep the root a build had after a step, keyed by the step's cache key: ``base`` (the
    build sandbox's template root) hard-linked, with ``layers`` (overlayfs format, newest first)
    applied on top. False when one of that key is kept already."""
    root = step_layers_dir(settings)
    final = root / layer_key
    if (final / COMPLETE_MARKER).is_file():
        return False
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{layer_key}.{time.time_ns()}.partial"
    partial.mkdir()
    try:
        (partial / "rootfs").mkdir()
        share_layer(base, partial / "rootfs")
        for layer in reversed(layers):
            apply_overlay_layer(layer, partial / "rootfs")
        write_json_atomic(partial / METADATA_FILE, {**meta, "layer_key": layer_key}, indent=2)
        write_atomic(partial / COMPLETE_MARKER, f"{time.time()}\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _evict_step_layers(root)
    return True


def _evict_step_layers(root: Path, kept: int = STEP_LAYERS_KEPT) -> None:
    """The least recently used step layers past ``kept`` go (a build using one as its build
    sandbox's root marks it used first; an hour-old mark is never a running build's)."""
    layers = [d for d in root.iterdir() if (d / COMPLETE_MARKER).is_file()]
    layers.sort(key=lambda d: (d / COMPLETE_MARKER).stat().st_mtime)
    for layer in layers[: max(0, len(layers) - kept)]:
        if time.time() - (layer / COMPLETE_MARKER).stat().st_mtime > 3600:
            shutil.rmtree(layer, ignore_errors=True)


def apply_overlay_layer(layer: Path, dest: Path) -> None:
    """Apply one overlayfs layer (an upper: 0/0 character devices are whiteouts, a directory
    marked opaque hides what was below it) onto the plain tree ``dest``. Files of ``dest`` may
    be hard links into other trees: each is replaced by unlinking, never written in place."""
    for dirpath, dirnames, filenames in os.walk(layer):
        rel = Path(dirpath).relative_to(layer)
        for name in [*dirnames, *filenames]:
            src, dst = Path(dirpath) / name, dest / rel / name
            st = src.lstat()
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout
                _remove_path(dst)
            elif stat.S_ISDIR(st.st_mode):
                if dst.is_symlink() or (dst.exists() and not dst.is_dir()) or _opaque(src):
                    _remove_path(dst)
                dst.mkdir(exist_ok=True)
                _copy_owner_and_mode(src, dst, st)
            else:
                _remove_path(dst)
                if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    shutil.copy2(src, dst, follow_symlinks=False)
                elif not stat.S_ISSOCK(st.st_mode):
                    os.mknod(dst, st.st_mode, st.st_rdev)
                _copy_owner_and_mode(src, dst, st)


def _opaque(directory: Path) -> bool:
    try:
        return os.getxattr(directory, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def _copy_owner_and_mode(src: Path, dst: Path, st: os.stat_result) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    for attr in os.listxattr(dst, follow_symlinks=False):  # overlayfs' own markers stay behind
        if attr.startswith("trusted.overlay."):
            os.removexattr(dst, attr, follow_symlinks=False)


def share_layer(layer: Path, dest: Path) -> None:
    """``dest`` becomes a tree of ``layer``'s files, hard-linked (read-only sharing: neither is
    ever written; the last build naming the data frees it); a copy across file systems."""
    proc = subprocess.run(["cp", "-al", f"{layer}/.", str(dest)], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        _run(["cp", "-a", f"{layer}/.", str(dest)])


def build_staging(template_id: str, build_id: str, settings: Settings) -> Path:
    """A fresh directory of the template's for one build's work (image layouts, the new root)."""
    staging = template_dir(template_id, settings) / f".build-{build_id}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publish_build(template_id: str, rootfs: Path, meta: dict[str, Any], settings: Settings) -> TemplateImage:
    """Make the finished root file system ``rootfs`` (in the template's build staging) the
    template's current build, with ``meta`` (build_id, limits, start command ...).

    Every build lives in ``builds/<build id>/`` (its root, its ``template.json``) and keeps that
    path for its life: sandboxes record it (a resume or a snapshot restore mounts it again), so a
    later build must not move it. ``rootfs`` of the template is a link to the current build's."""
    tdir = template_dir(template_id, settings)
    build_id = str(meta["build_id"])
    with _build_lock(tdir):
        old = read_metadata(template_id, settings) if is_built(template_id, settings) else {}
        created_at = _dt.datetime.now(_dt.UTC).isoformat()
        tags = dict(old.get("tags") or {})
        for tag in meta.pop("new_tags", []):
            tags[tag] = {"build_id": build_id, "created_at": created_at}
        full = {"template_id": template_id, "created_at": created_at, **meta}
        bdir = tdir / BUILDS_DIR / build_id
        bdir.mkdir(parents=True)
        os.rename(rootfs, bdir / "rootfs")
        write_json_atomic(bdir / METADATA_FILE, full, indent=2)
        write_atomic(bdir / COMPLETE_MARKER, f"{created_at} {build_id}\n")
        (tdir / COMPLETE_MARKER).unlink(missing_ok=True)
        current = tdir / "rootfs"
        if current.is_dir() and not current.is_symlink():  # a recipe build, or one made before builds/
            if old.get("build_id"):
                _keep_build(tdir, old)
            else:
                _retire(current)
        link = tdir / f".rootfs.link-{time.time_ns()}"
        link.symlink_to(f"{BUILDS_DIR}/{build_id}/rootfs")
        os.replace(link, current)
        write_json_atomic(tdir / METADATA_FILE, {**full, "tags": tags}, indent=2)
        write_atomic(tdir / COMPLETE_MARKER, f"{created_at} {build_id}\n")
        _drop_builds(tdir, {build_id, *(str(t["build_id"]) for t in tags.values())})
    return load_template(template_id, settings)


def _keep_build(tdir: Path, meta: dict[str, Any]) -> None:
    """Move a current build made before ``builds/`` existed under ``builds/<build id>/``."""
    bdir = tdir / BUILDS_DIR / str(meta["build_id"])
    if bdir.exists():
        shutil.rmtree(bdir, ignore_errors=True)
    bdir.mkdir(parents=True)
    os.rename(tdir / "rootfs", bdir / "rootfs")
    kept = {k: v for k, v in meta.items() if k != "tags"}
    write_json_atomic(bdir / METADATA_FILE, kept, indent=2)
    write_atomic(bdir / COMPLETE_MARKER, f"{meta.get('created_at', '')} {meta['build_id']}\n")


def _drop_builds(tdir: Path, named: set[str], untagged_kept: int = UNTAGGED_BUILDS_KEPT) -> None:
    """Builds neither current nor tagged: the newest ``untagged_kept`` stay listed, older ones
    are dropped in place (their roots freed by :func:`collect_dropped` once nothing names them)."""
    root = tdir / BUILDS_DIR
    kept = [b for b in (root.iterdir() if root.is_dir() else []) if (b / COMPLETE_MARKER).is_file()]
    unnamed = sorted(
        (b for b in kept if b.name not in named), key=lambda b: (b / COMPLETE_MARKER).read_text()
    )
    for bdir in unnamed[: max(0, len(unnamed) - untagged_kept)]:
        _drop(bdir)


def _drop(bdir: Path) -> None:
    """Unlist a kept build (no lookup, tag or step cache finds it again); its root stays."""
    write_atomic(bdir / DROPPED_MARKER, f"{time.time()}\n")
    (bdir / COMPLETE_MARKER).unlink()


def collect_dropped(templates_dir: Path, named: set[str]) -> list[str]:
    """Remove every dropped build and retired root no path of ``named`` (the template roots
    sandbox and snapshot records name) points into, and then-empty deleted template
    directories. Returns the roots removed."""
    root = templates_dir
    wanted = {os.path.realpath(p) for p in named}
    removed: list[str] = []
    for tdir in sorted(root.iterdir()) if root.is_dir() else []:
        if tdir.is_symlink() or not tdir.is_dir():  # a shared recipe template: not this node's
            continue
        with _build_lock(tdir):
            for bdir in (tdir / BUILDS_DIR).glob("*"):
                tree = bdir / "rootfs"
                if (bdir / DROPPED_MARKER).is_file() and os.path.realpath(tree) not in wanted:
                    shutil.rmtree(bdir, ignore_errors=True)
                    removed.append(str(tree))
            # A recipe root's records name ``rootfs``, whichever build it was when recorded:
            # replaced ones stay while anything names the template's root at all.
            if str(tdir / "rootfs") not in named and not _mounted(tdir):
                for tree in tdir.glob(RETIRED_PREFIX + "*"):
                    shutil.rmtree(tree, ignore_errors=True)
                    removed.append(str(tree))
            with contextlib.suppress(OSError):  # left with dropped builds still in use
                (tdir / BUILDS_DIR).rmdir()
        _remove_if_deleted(tdir)
    return removed


def _remove_if_deleted(tdir: Path) -> None:
    """A deleted template's directory once nothing is left in it (a build starting meanwhile
    has made its staging directory in it: then it stays)."""
    if (tdir / METADATA_FILE).exists() or [p for p in tdir.iterdir() if p.name != ".lock"]:
        return
    with contextlib.suppress(OSError):
        (tdir / ".lock").unlink()
        tdir.rmdir()


def is_dropped_root(rootfs: Path) -> bool:
    """``rootfs`` is the root of a dropped build (or already gone)."""
    return (rootfs.parent / DROPPED_MARKER).is_file() or not rootfs.is_dir()


def _mounted(tdir: Path) -> bool:
    """A host mount names a path in the template's directory (an overlay naming its lower
    layers absolutely: ours name them relatively, so the records above are what counts)."""
    return f"{tdir}/" in Path("/proc/mounts").read_text()


def set_tags(template_id: str, settings: Settings, add: dict[str, str], remove: list[str]) -> dict[str, Any]:
    """Point each tag of ``add`` at its build id and drop those of ``remove``; the new tags."""
    tdir = template_dir(template_id, settings)
    with _build_lock(tdir):
        meta = read_metadata(template_id, settings)
        tags = dict(meta.get("tags") or {})
        now = _dt.datetime.now(_dt.UTC).isoformat()
        for tag, build_id in add.items():
            tags[tag] = {"build_id": build_id, "created_at": now}
        for tag in remove:
            tags.pop(tag, None)
        meta["tags"] = tags
        write_json_atomic(tdir / METADATA_FILE, meta, indent=2)
        if remove:
            _drop_builds(tdir, {str(meta.get("build_id", "")), *(str(t["build_id"]) for t in tags.values())})
    return tags


def delete_template(template_id: str, settings: Settings) -> None:
    """Remove a template (E2B's: no lookup finds it, its sandboxes keep running and snapshots of
    it stay restorable). Every build is dropped in place; :func:`collect_dropped` frees each
    root, and then the template's directory, once no sandbox or snapshot names it."""
    tdir = template_dir(template_id, settings)
    if not tdir.is_dir():
        raise TemplateNotBuilt(f"template {template_id!r} not found")
    with _build_lock(tdir):
        (tdir / COMPLETE_MARKER).unlink(missing_ok=True)
        if (tdir / "rootfs").is_symlink():
            (tdir / "rootfs").unlink()
        elif (tdir / "rootfs").exists():
            _retire(tdir / "rootfs")
        _drop_builds(tdir, set(), untagged_kept=0)
        for entry in tdir.iterdir():
            if entry.name in (".lock", BUILDS_DIR) or entry.name.startswith(RETIRED_PREFIX):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def list_templates(settings: Settings) -> list[dict[str, object]]:
    """Metadata of every completely built template, sorted by id."""
    root = settings.templates_dir
    if not root.is_dir():
        return []
    found = []
    for tdir in sorted(root.iterdir()):
        if tdir.is_dir() and is_built(tdir.name, settings):
            found.append(json.loads((tdir / METADATA_FILE).read_text()))
    return found


def host_debian_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """The Debian archive URI the host's apt uses (deb822 ``.sources`` or one-line ``.list``)."""
    candidates = [*sorted((sources_dir / "sources.list.d").glob("*.sources"))]
    for path in candidates:
        for stanza in path.read_text().split("\n\n"):
            fields = dict(
                (k.strip().lower(), v.strip())
                for k, _, v in (line.partition(":") for line in stanza.splitlines() if ":" in line)
                if not k.startswith("#")
            )
            suites = fields.get("suites", "").split()
            if any(s in ("bookworm", "stable") for s in suites) and "uris" in fields:
                return fields["uris"].split()[0]
    lists = [sources_dir / "sources.list", *sorted((sources_dir / "sources.list.d").glob("*.list"))]
    for path in lists:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(bookworm|stable)\s", line)
            if m:
                return m.group(1)
    return DEFAULT_MIRROR


@contextmanager
def _build_lock(tdir: Path) -> Iterator[None]:
    tdir.mkdir(parents=True, exist_ok=True)
    with open(tdir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise TemplateBuildFailed(f"{cmd[0]} failed (exit {proc.returncode}): {tail}")


def _debootstrap(recipe: TemplateRecipe, target: Path, mirror: str) -> None:
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=" + ",".join(recipe.packages),
            recipe.suite,
            str(target),
            mirror,
        ]
    )


def _apt_install(root: Path, packages: tuple[str, ...]) -> None:
    """apt-get install ``packages`` (without recommends) in the debootstrapped ``root``, from the
    archive debootstrap used; with /proc mounted for the packages' scripts, no service started."""
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    apt = ["chroot", str(root), "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-q", "-y"]
    _run(["mount", "-t", "proc", "proc", str(root / "proc")])
    try:
        _run([*apt, "update"])
        _run([*apt, "install", "--no-install-recommends", *packages])
        _run([*apt, "clean"])
    finally:
        subprocess.run(["umount", "-l", str(root / "proc")], capture_output=True)
        policy.unlink(missing_ok=True)


def _busybox_rootfs(target: Path) -> None:
    """A root file system of one static busybox: no python, no libc, no package manager."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise TemplateBuildFailed("busybox is not installed (apt-get install busybox-static)")
    with open(busybox, "rb") as f:
        elf = f.read(1 << 20)
    if b"/lib64/ld-linux" in elf or b"ld-linux-x86-64.so" in elf:
        raise TemplateBuildFailed(f"{busybox} is dynamically linked; install busybox-static")
    for d in ("bin", "etc", "root", "tmp", "proc", "sys", "dev", f"home/{SANDBOX_USER}"):
        (target / d).mkdir(parents=True, exist_ok=True)
    (target / "tmp").chmod(0o1777)
    shutil.copy2(busybox, target / "bin" / "busybox")
    _run(["chroot", str(target), "/bin/busybox", "--install", "-s", "/bin"])
    (target / "etc/passwd").write_text(
        f"root:x:0:0:root:/root:/bin/sh\n"
        f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_UID}::/home/{SANDBOX_USER}:/bin/sh\n"
    )
    (target / "etc/group").write_text(f"root:x:0:\n{SANDBOX_USER}:x:{SANDBOX_UID}:\n")
    os.chown(target / "home" / SANDBOX_USER, SANDBOX_UID, SANDBOX_UID)
    (target / "etc/hostname").write_text("sandbox\n")
    (target / ".forkyard").mkdir()


def _populate(recipe: TemplateRecipe, target: Path) -> None:
    if recipe.kind == "busybox":
        _busybox_rootfs(target)
    elif recipe.kind == "debootstrap":
        _debootstrap(recipe, target, host_debian_mirror())
        if recipe.apt_packages:
            _apt_install(target, recipe.apt_packages)
        _configure_rootfs(target)
    else:
        raise TemplateBuildFailed(f"unknown template recipe kind {recipe.kind!r}")


def _retire(tree: Path, tdir: Path | None = None) -> None:
    """Move a finished rootfs out of the way (into ``tdir``, its own directory by default)
    instead of deleting it: running sandboxes may still use it as their overlay lower layer
    (``--force`` rebuilds, dropped builds)."""
    os.rename(tree, (tdir or tree.parent) / f"{RETIRED_PREFIX}{time.time_ns()}")


def _configure_rootfs(root: Path) -> None:
    """Make the tree sandbox-ready: the E2B default user, neutral host name, small caches."""
    _run(["chroot", str(root), "groupadd", "--gid", str(SANDBOX_UID), SANDBOX_USER])
    _run(
        [
            "chroot",
            str(root),
            "useradd",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--create-home",
            "--home-dir",
            f"/home/{SANDBOX_USER}",
            "--shell",
            "/bin/bash",
            "--groups",
            "sudo",
            SANDBOX_USER,
        ]
    )
    # Passwordless login for sudo, and no password at all (the account is locked for logins).
    sudoers = root / "etc/sudoers.d" / SANDBOX_USER
    sudoers.write_text(f"{SANDBOX_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    sudoers.chmod(0o440)
    (root / "etc/hostname").write_text("sandbox\n")
    (root / "etc/hosts").write_text(
        "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    # The host's resolver address means nothing inside a sandbox network namespace.
    resolv = root / "etc/resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("nameserver 1.1.1.1\nnameserver 8.8.8.8\n")
    # E2B's base has ``yarn``; Debian installs it as ``yarnpkg``.
    yarn = root / "usr/local/bin/yarn"
    if (root / "usr/bin/yarnpkg").exists() and not yarn.exists():
        yarn.symlink_to("/usr/bin/yarnpkg")
    # Mount point of the read-only envd bundle.
    (root / ".forkyard").mkdir(exist_ok=True)
    _drop_documentation(root)
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (root / cache).glob("*"):
            if entry.is_file():
                entry.unlink()


def is_current(template_id: str, settings: Settings) -> bool:
    """Built, and (a recipe template) from the recipe as it is now: nothing to rebuild."""
    if not is_built(template_id, settings):
        return False
    recipe = RECIPES.get(template_id)
    meta = read_metadata(template_id, settings)
    return recipe is None or bool(meta.get("build_id")) or meta.get("recipe") == recipe_digest(recipe)


#: What Debian's slim images leave out (a seventh of the base root); packages installed later
#: in a sandbox skip them too (dpkg's path-exclude). Copyright files stay.
_DPKG_EXCLUDES = """path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""


def _drop_documentation(root: Path) -> None:
    """Files only: the directories stay (some packages' scripts expect ``/usr/share/man/man1``)."""
    for tree in ("usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/doc"):
        for dirpath, _dirs, files in os.walk(root / tree):
            for name in files:
                if name not in ("copyright", "locale.alias"):
                    os.unlink(os.path.join(dirpath, name))
    (root / "etc/dpkg/dpkg.cfg.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/dpkg/dpkg.cfg.d/forkyard-nodoc").write_text(_DPKG_EXCLUDES)


def build_template(template_id: str, settings: Settings, *, force: bool = False) -> TemplateImage:
    """Build ``template_id`` unless it is already completely built from its recipe as it is now
    (then return at once). A template built from an older recipe is rebuilt: its sandboxes keep
    the old root (retired, freed once nothing names it), new ones get the new one."""
    recipe = RECIPES.get(template_id)
    tdir = template_dir(template_id, settings)
    if not force and is_current(template_id, settings):
        return load_template(template_id, settings)
    if recipe is None:
        raise TemplateNotBuilt(f"no build recipe for template {template_id!r} (known: {', '.join(RECIPES)})")
    with _build_lock(tdir):
        if not force and is_current(template_id, settings):  # built by someone else meanwhile
            return load_template(template_id, settings)
        started = time.monotonic()
        (tdir / COMPLETE_MARKER).unlink(missing_ok=True)
        partial = tdir / ".rootfs.partial"
        if partial.exists():  # an interrupted build
            shutil.rmtree(partial)
        try:
            partial.mkdir()
            _populate(recipe, partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        if (tdir / "rootfs").exists():
            _retire(tdir / "rootfs")
        os.rename(partial, tdir / "rootfs")
        created_at = _dt.datetime.now(_dt.UTC).isoformat()
        meta = {
            "template_id": template_id,
            "vcpus": recipe.vcpus,
            "memory_mb": recipe.memory_mb,
            "disk_mb": recipe.disk_mb,
            "created_at": created_at,
            "build_seconds": round(time.monotonic() - started, 1),
            "kind": recipe.kind,
            "suite": recipe.suite,
            "recipe": recipe_digest(recipe),
        }
        write_json_atomic(tdir / METADATA_FILE, meta, indent=2)
        write_atomic(tdir / COMPLETE_MARKER, created_at + "\n")
        return load_template(template_id, settings)
