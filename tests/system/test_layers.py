"""Overlay disk layers: real overlay mounts, checked by comparing whole merged views."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forkyard.storage import mounts
from forkyard.storage.layers import (
    MAX_LOWERS,
    OPAQUE_XATTR,
    WHITEOUT_XATTR,
    LayerError,
    LayerStore,
    overlay_mount,
    overlay_unmount,
)

pytestmark = pytest.mark.requires_root("overlay mounts")

#: Weighted towards directories and whiteouts: their interplay is what a squash can get wrong.
KINDS = ["file", "dir", "dir", "dir", "whiteout", "xwhiteout", "xwhiteout", "opaque", "symlink"]

View = dict[str, tuple[object, ...]]
Mount = Callable[..., Path]


def view(root: Path) -> View:
    """Everything a program in the sandbox could observe of a tree, except atime/ctime/inode numbers."""
    st = os.lstat(root)
    out: View = {".": (st.st_mode, st.st_uid, st.st_gid)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.lexists(path):  # readdir can list an xattr whiteout that lookups hide
                out[os.path.relpath(path, root)] = _describe(path)
    return out


def _describe(path: str) -> tuple[object, ...]:
    st = os.lstat(path)
    xattrs = sorted(
        (k, os.getxattr(path, k, follow_symlinks=False)) for k in os.listxattr(path, follow_symlinks=False)
    )
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            body: object = f.read()
    elif stat.S_ISLNK(st.st_mode):
        body = os.readlink(path)
    else:
        body = st.st_rdev
    nlink = 0 if stat.S_ISDIR(st.st_mode) else st.st_nlink
    return (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size, nlink, body, xattrs)


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split(" ")[4] == str(path) for line in f)


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    """Mounts an overlay on a fresh target with (unless ``upper=False``) a fresh upper; all are
    unmounted at the end, whatever the test did."""
    targets: list[Path] = []

    def make(lowers: list[Path], upper: bool = True, name: str = "") -> Path:
        n = len(targets)
        base = tmp_path / f"m{n}{name}"
        for sub in ("merged", "upper", "work"):
            (base / sub).mkdir(parents=True)
        if upper:
            overlay_mount(base / "merged", lowers, base / "upper", base / "work")
        else:
            overlay_mount(base / "merged", lowers, None, None)
        targets.append(base / "merged")
        return base / "merged"

    yield make
    for target in reversed(targets):
        overlay_unmount(target)
    assert not any(_mounted(t) for t in targets)


@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    return LayerStore(tmp_path / "data" / "disk-layers")


def _template(root: Path) -> Path:
    for d in ("etc", "opt/tree/sub", "var/old/deep", "usr/bin", "home/user"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for f, text in {
        "etc/keep": "keep",
        "etc/gone": "gone",
        "etc/mode": "mode",
        "opt/tree/a": "a",
        "opt/tree/sub/b": "b",
        "var/old/x": "x",
        "var/old/deep/y": "y",
        "usr/bin/tool": "#!/bin/sh\n",
    }.items():
        (root / f).write_text(text)
    os.symlink("tool", root / "usr/bin/link")
    os.mkfifo(root / "var/fifo")
    os.link(root / "etc/keep", root / "etc/keep-link")
    return root


def _first_changes(m: Path) -> None:
    """What a sandbox does: overlayfs turns it into whiteouts, opaque dirs and copied-up files."""
    (m / "etc/new").write_text("new")
    (m / "etc/keep").write_text("changed")
    (m / "etc/gone").unlink()
    os.chmod(m / "etc/mode", 0o600)
    subprocess.run(["rm", "-rf", str(m / "opt/tree")], check=True)
    (m / "opt/tree").mkdir()
    (m / "opt/tree/z").write_text("z")
    subprocess.run(["mv", str(m / "var/old"), str(m / "var/new")], check=True)
    os.symlink("../etc/new", m / "usr/bin/newlink")
    os.link(m / "etc/new", m / "etc/new-link")
    os.chown(m / "etc/new", 1000, 1000)
    os.setxattr(m / "etc/new", "user.tag", b"v1")
    with open(m / "home/user/sparse", "wb") as f:
        f.truncate(64 << 20)
        f.seek(32 << 20)
        f.write(b"data in the middle")
    (m / "home/user/big").write_bytes(os.urandom(1 << 20))


def _second_changes(m: Path) -> None:
    (m / "etc/new-link").unlink()
    (m / "etc/gone").mkdir()  # a directory where a whiteout was
    (m / "etc/gone/inside").write_text("inside")
    subprocess.run(["rm", "-rf", str(m / "var/new")], check=True)
    (m / "usr/bin/tool").unlink()
    (m / "usr/bin/tool").mkdir()  # file -> dir
    (m / "home/user/big").write_bytes(b"small now")
    os.setxattr(m / "etc/new", "user.tag", b"v2")


def _third_changes(m: Path) -> None:
    subprocess.run(["rm", "-rf", str(m / "etc/gone")], check=True)
    (m / "etc/gone").write_text("a file again")  # dir -> file
    (m / "var/new").mkdir()
    (m / "var/new/again").write_text("again")
    os.unlink(m / "usr/bin/link")
    (m / "usr/bin/link").write_text("symlink -> file")
    os.removexattr(m / "etc/new", "user.tag")
    os.mkfifo(m / "home/user/pipe")
    (m / "opt/tree/z").unlink()


def _seal(store: LayerStore, merged: Path) -> str:
    """Unmount and adopt the upper of a ``mount`` fixture overlay: what a snapshot does."""
    overlay_unmount(merged)
    return store.adopt(merged.parent / "upper")


def _chain(store: LayerStore, mount: Mount, template: Path) -> tuple[list[str], View]:
    """Three snapshots in a row; returns the chain (newest first) and the final view."""
    chain: list[str] = []
    for changes in (_first_changes, _second_changes, _third_changes):
        m = mount([store.path(lid) for lid in chain] + [template])
        changes(m)
        final = view(m)
        chain.insert(0, _seal(store, m))
    return chain, final


def test_adopted_upper_as_lower_shows_the_same_tree(tmp_path: Path, store: LayerStore, mount: Mount) -> None:
    template = _template(tmp_path / "template")
    m = mount([template])
    _first_changes(m)
    before = view(m)
    layer = _seal(store, m)
    assert not (m.parent / "upper").exists()
    assert store.ids() == {layer}
    lp = store.path(layer)
    assert os.getxattr(lp / "opt/tree", OPAQUE_XATTR) == b"y"
    assert stat.S_ISCHR(os.lstat(lp / "etc/gone").st_mode)
    assert view(mount([lp, template])) == before
    assert view(mount([lp, template], upper=False)) == before  # read-only child


def test_squash_equals_the_stacked_layers(tmp_path: Path, store: LayerStore, mount: Mount) -> None:
    template = _template(tmp_path / "template")
    chain, final = _chain(store, mount, template)
    assert view(mount([store.path(lid) for lid in chain] + [template])) == final
    inputs = {lid: view(store.path(lid)) for lid in chain}

    everything = store.squash(chain)
    assert view(mount([store.path(everything), template])) == final
    newest_two = store.squash(chain[:2])
    assert view(mount([store.path(newest_two), store.path(chain[2]), template])) == final
    assert {lid: view(store.path(lid)) for lid in chain} == inputs  # inputs untouched
    assert store.ids() == {*chain, everything, newest_two}
    # The sparse file stays sparse: a real copy of the 64 MiB would show here.
    assert store.disk_usage(everything) < 8 << 20
    squashed = store.path(everything)
    assert stat.S_ISCHR(os.lstat(squashed / "etc/new-link").st_mode)  # a whiteout: the template is below
    assert os.getxattr(squashed / "var/new", OPAQUE_XATTR) == b"y"  # re-created after an rm -rf
    oldest = store.path(store.squash(chain[2:]))
    assert os.lstat(oldest / "etc/new").st_ino == os.lstat(oldest / "etc/new-link").st_ino


def _random_layer(root: Path, rng: random.Random, names: list[str]) -> None:
    """A hand-made layer with every marker overlayfs knows, including combinations overlayfs
    itself never writes (a non-opaque directory over a whiteout, xattr whiteouts)."""
    root.mkdir()
    os.chmod(root, rng.choice([0o755, 0o750]))
    _fill(root, rng, names, depth=0)


def _fill(d: Path, rng: random.Random, names: list[str], depth: int) -> None:
    for name in rng.sample(names, rng.randint(1, len(names))):
        p = d / name
        kind = rng.choice(KINDS)
        if kind in ("dir", "opaque") and depth < 2:
            p.mkdir()
            if kind == "opaque":
                os.setxattr(p, OPAQUE_XATTR, b"y")
            os.chmod(p, rng.choice([0o755, 0o700, 0o1777]))
            _fill(p, rng, names, depth + 1)
        elif kind == "whiteout":
            os.mknod(p, stat.S_IFCHR, os.makedev(0, 0))
        elif kind == "xwhiteout":
            p.touch()
            os.setxattr(p, WHITEOUT_XATTR, b"")
            if OPAQUE_XATTR not in os.listxattr(d):
                os.setxattr(d, OPAQUE_XATTR, b"x")  # "holds xattr whiteouts", not opaque
        elif kind == "symlink":
            os.symlink(f"target-{rng.randint(0, 9)}", p)
        else:
            p.write_text(f"{name}-{rng.random()}")
            os.chmod(p, rng.choice([0o644, 0o600, 0o755]))


@pytest.mark.parametrize("seed", range(6))
def test_squash_of_random_layers(tmp_path: Path, store: LayerStore, mount: Mount, seed: int) -> None:
    rng = random.Random(seed)
    names = ["a", "b", "c", "d", "e"]
    template = tmp_path / "template"
    template.mkdir()
    _fill(template, random.Random(seed + 100), names, depth=0)
    for p in template.rglob("*"):  # the template has no overlay markers of its own
        if p.is_char_device() or (p.is_file() and WHITEOUT_XATTR in os.listxattr(p)):
            p.unlink()
    chain: list[str] = []
    store.root.mkdir(parents=True)
    for i in range(5):
        _random_layer(store.root / f"l{seed:015x}{i}", rng, names)
        chain.insert(0, f"l{seed:015x}{i}")
    stacked = view(mount([store.path(lid) for lid in chain] + [template], upper=False))
    squashed = store.squash(chain)
    assert view(mount([store.path(squashed), template], upper=False)) == stacked
    half = store.squash(chain[:2])
    lowers = [store.path(half), *(store.path(lid) for lid in chain[2:]), template]
    assert view(mount(lowers, upper=False)) == stacked


def test_gc_remove_and_ids(tmp_path: Path, store: LayerStore) -> None:
    layers = []
    for _ in range(3):
        upper = tmp_path / "upper"
        (upper / "d").mkdir(parents=True)
        layers.append(store.adopt(upper))
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in (".tmp-rm-lx-1", f".tmp-build-{dead.pid}-1", ".tmp-build-1-live"):
        (store.root / name / "x").mkdir(parents=True)
    assert store.ids() == set(layers)

    assert store.gc({layers[0], "l0000000000000000"}) == sorted(layers[1:])
    assert store.ids() == {layers[0]}
    # Only the build of a live process (pid 1) is left alone.
    assert sorted(os.listdir(store.root)) == [".tmp-build-1-live", layers[0]]

    store.remove(layers[0])
    store.remove(layers[0])
    assert not store.exists(layers[0])
    assert store.gc(set()) == []
    for bad in ("../etc", "l123", "x" + "0" * 16, "l" + "A" * 16, "l" + "0" * 16 + "/x", ""):
        with pytest.raises(LayerError):
            store.path(bad)
    with pytest.raises(LayerError):
        store.squash([])
    with pytest.raises(LayerError, match="missing"):
        store.squash(["l" + "1" * 16])


def test_many_layers_with_a_long_store_path(tmp_path: Path, mount: Mount) -> None:
    store = LayerStore(tmp_path / ("long-" * 40) / "disk-layers")
    template = _template(tmp_path / "template")
    chain: list[str] = []
    for i in range(MAX_LOWERS - 1):
        upper = tmp_path / "upper"
        upper.mkdir()
        (upper / f"f{i}").write_text(str(i))
        (upper / "shared").write_text(str(i))
        chain.insert(0, store.adopt(upper))
    assert len(":".join(str(store.path(lid)) for lid in chain)) > 4096  # absolute paths would not fit
    m = mount([store.path(lid) for lid in chain] + [template])
    assert (m / "shared").read_text() == str(MAX_LOWERS - 2)
    assert {f"f{i}" for i in range(MAX_LOWERS - 1)} <= set(os.listdir(m))
    (m / "etc/keep").write_text("writable")

    many = [store.path(lid) for lid in chain] * 3
    with pytest.raises(LayerError, match="bytes"):
        overlay_mount(tmp_path / "nowhere", many, None, None)


def test_adopt_refuses_live_missing_and_foreign_uppers(
    tmp_path: Path, store: LayerStore, mount: Mount
) -> None:
    template = _template(tmp_path / "template")
    m = mount([template])
    with pytest.raises(LayerError, match="still the upper"):
        store.adopt(m.parent / "upper")
    with pytest.raises(LayerError, match="not a directory"):
        store.adopt(tmp_path / "missing")
    foreign = tmp_path / "tmpfs"
    foreign.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(foreign)], check=True)
    try:
        (foreign / "upper").mkdir()
        with pytest.raises(LayerError, match="different file systems"):
            store.adopt(foreign / "upper")
    finally:
        overlay_unmount(foreign)
    assert store.ids() == set()


def test_mount_errors_and_unmount_is_idempotent(tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.mkdir()
    with pytest.raises(LayerError, match="does not exist"):
        overlay_mount(target, [tmp_path / "missing"], None, None)
    with pytest.raises(LayerError, match="work directory"):
        overlay_mount(target, [tmp_path], tmp_path / "upper", None)
    bad = tmp_path / "a:b"
    bad.mkdir()
    with pytest.raises(LayerError, match="contains"):
        overlay_mount(target, [bad, tmp_path], None, None)
    overlay_unmount(target)
    assert not _mounted(target)


def test_a_single_lower_without_upper_is_a_read_only_view(tmp_path: Path, mount: Mount) -> None:
    template = _template(tmp_path / "template")
    m = mount([template], upper=False)  # overlayfs itself wants two lowers then
    assert view(m) == view(template)
    with pytest.raises(OSError, match="Read-only"):
        (m / "etc/keep").write_text("no")


def test_squash_of_xattr_whiteouts(tmp_path: Path, store: LayerStore, mount: Mount) -> None:
    """``trusted.overlay.opaque=x`` (Linux 6.7+) marks a directory holding xattr whiteouts, and is
    not opaque: what lies below the directory stays visible."""
    template = tmp_path / "template"
    (template / "d").mkdir(parents=True)
    for name in ("gone", "keep"):
        (template / "d" / name).write_text(name)
    older, newer = "l" + "1" * 16, "l" + "2" * 16
    (store.root / older / "d").mkdir(parents=True)
    (store.root / older / "d/extra").write_text("extra")
    (store.root / newer / "d").mkdir(parents=True)
    (store.root / newer / "d/gone").touch()
    os.setxattr(store.root / newer / "d/gone", WHITEOUT_XATTR, b"")
    os.setxattr(store.root / newer / "d", OPAQUE_XATTR, b"x")
    stacked = view(mount([store.path(newer), store.path(older), template], upper=False))
    assert sorted(os.listdir(tmp_path / "m0/merged/d")) == ["extra", "keep"]
    squashed = store.path(store.squash([newer, older]))
    assert view(mount([squashed, template], upper=False)) == stacked
    assert stat.S_ISCHR(os.lstat(squashed / "d/gone").st_mode)
    assert OPAQUE_XATTR not in os.listxattr(squashed / "d")


def test_unmount_waits_for_a_busy_overlay_then_goes_lazy(
    tmp_path: Path, mount: Mount, caplog: pytest.LogCaptureFixture
) -> None:
    template = _template(tmp_path / "template")
    m = mount([template])
    held = open(m / "etc/keep")  # closed by the timer, as by a process that is exiting
    timer = threading.Timer(0.2, held.close)
    timer.start()
    overlay_unmount(m, busy_timeout=5)
    timer.join()
    assert not _mounted(m) and "lazily" not in caplog.text

    m = mount([template])
    with open(m / "etc/keep"):
        overlay_unmount(m, busy_timeout=0.1)
        assert not _mounted(m) and "lazily" in caplog.text


def test_mounts_and_disks_are_system_calls_not_processes(
    tmp_path: Path, mount: Mount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An overlay (relative lowers: the kernel resolves them against a working directory of the
    mounting thread's own, the server's stays), a bind view and a loop-mounted disk image are
    mounted and unmounted without a process (a fork of 16 made 4 mount/umount processes per child);
    the loop device goes with the unmount (autoclear)."""
    template = _template(tmp_path / "template")
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    disk = tmp_path / "disk"
    disk.mkdir()
    cwd = os.getcwd()

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started: {args[1]!r}")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", no_process)
    merged = mount([template])
    assert view(merged) == view(template) and os.getcwd() == cwd
    assert view(mount([template], upper=False)) == view(template)
    mounts.mount_image(image, disk, "ext4", mounts.MS_NOATIME, "discard")
    try:
        (disk / "f").write_text("on the disk")
        device = next(line.split()[0] for line in open("/proc/self/mounts") if line.split()[1] == str(disk))
        assert device.startswith("/dev/loop")
        backing = Path(f"/sys/block/{Path(device).name}/loop/backing_file")
        assert backing.read_text().strip() == str(image)
        assert "noatime" in next(line for line in open("/proc/self/mounts") if line.split()[1] == str(disk))
    finally:
        overlay_unmount(disk)
    assert not _mounted(disk) and not backing.exists()  # the loop device was freed
    overlay_unmount(merged)
    assert not _mounted(merged)
