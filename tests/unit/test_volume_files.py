"""The volume content API's file operations (:class:`forkyard.storage.volumes.VolumeFiles`) never
leave the volume: a symlink a sandbox made inside it is reported, never followed, by every
operation (they run as root on the host); and the checks on names and mount paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forkyard.api.routes_volumes import check_mount_path
from forkyard.errors import Conflict, Gone, Invalid, NotFound
from forkyard.runtime.gvisor.checkpoint import saved_volumes
from forkyard.storage.volumes import VolumeFiles, check_volume_name, normalise

pytestmark = pytest.mark.requires_root("chown of the entries the content API makes")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "secret.txt").write_text("host secret")
    return secret


@pytest.fixture
def files(tmp_path: Path, outside: Path) -> VolumeFiles:
    root = tmp_path / "vol"
    root.mkdir()
    (root / "link").symlink_to(outside)  # what `ln -s` in a sandbox leaves in its volume
    (root / "file-link").symlink_to(outside / "secret.txt")
    return VolumeFiles(root)


def test_symlinks_are_reported_never_followed(files: VolumeFiles, outside: Path) -> None:
    entry = files.stat("/link")
    assert (entry["type"], entry["target"]) == ("symlink", str(outside))
    for op in (
        lambda: files.open_for_read("/link/secret.txt"),
        lambda: files.open_for_read("/file-link"),
        lambda: files.list_dir("/link"),
        lambda: files.open_for_write("/link/new.txt", None, None, None, True),
        lambda: files.open_for_write("/file-link", None, None, None, True),
        lambda: files.make_dir("/link/sub", None, None, None, True),
        lambda: files.update_metadata("/link/secret.txt", 0, 0, 0o777),
        lambda: files.remove("/link/secret.txt"),
    ):
        with pytest.raises((NotFound, Invalid)):
            op()
    files.remove("/link")  # removes the link itself
    assert (outside / "secret.txt").read_text() == "host secret"
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert os.stat(outside / "secret.txt").st_mode & 0o777 != 0o777


def test_recursive_remove_does_not_cross_a_symlink(files: VolumeFiles, outside: Path) -> None:
    files.make_dir("/d", None, None, None, False)
    os.symlink(outside, files.root / "d" / "inner-link")
    files.remove("/d")
    assert (outside / "secret.txt").exists()


def test_create_semantics(files: VolumeFiles) -> None:
    fd = files.open_for_write("/a", None, None, None, False)
    os.close(fd)
    assert files.stat("/a")["uid"] == 1000 and files.stat("/a")["mode"] == 0o666
    with pytest.raises(Conflict):
        files.open_for_write("/a", None, None, None, False)
    with pytest.raises(NotFound):
        files.open_for_write("/missing/a", None, None, None, True)
    with pytest.raises(NotFound):
        files.make_dir("/x/y", None, None, None, False)
    assert files.make_dir("/x/y", 0, 0, 0o700, True)["mode"] == 0o700
    with pytest.raises(Conflict):
        files.make_dir("/x/y", None, None, None, False)
    with pytest.raises(Invalid):
        files.remove("/")
    assert [e["path"] for e in files.list_dir("/x", depth=2)] == ["/x/y"]


@pytest.mark.parametrize(
    ("raw", "normal"), [("a/b", "/a/b"), ("/../../etc", "/etc"), ("/a/./b/../c", "/a/c")]
)
def test_paths_are_normalised_inside_the_volume(raw: str, normal: str) -> None:
    assert normalise(raw) == normal


@pytest.mark.parametrize("name", ["", "a b", "a/b", "..", "x" * 129])
def test_volume_names_follow_e2b_pattern(name: str) -> None:
    with pytest.raises(Invalid):
        check_volume_name(name)


@pytest.mark.parametrize(
    "path", ["rel", "/", "/a/../b", "/proc", "/dev/shm", "/.forkyard", "/usr/bin/sudo", "/usr/bin"]
)
def test_bad_mount_paths(path: str) -> None:
    with pytest.raises(Invalid):
        check_mount_path(path)


def test_a_snapshot_whose_volume_was_deleted_is_gone(tmp_path: Path) -> None:
    mount = {"name": "v", "volume_id": "1", "source": str(tmp_path / "deleted"), "path": "/mnt/v"}
    with pytest.raises(Gone, match="volume 'v'"):
        saved_volumes({"volumes": [mount]})
    (tmp_path / "deleted").mkdir()
    assert [v.path for v in saved_volumes({"volumes": [mount]})] == ["/mnt/v"]
