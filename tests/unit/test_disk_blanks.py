"""New sandbox disks are sparse copies of one file system made per size (runtime/gvisor/disk.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from forkyard.runtime.gvisor.disk import RootDisks, sparse_copy


def test_sparse_copy_keeps_data_and_holes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.write(b"head" * 1024)
        f.seek(8 << 20)
        f.write(b"middle" * 4096)
        f.truncate(64 << 20)  # ends in a hole
    dst = tmp_path / "dst"
    sparse_copy(src, dst)
    assert dst.read_bytes() == src.read_bytes()
    assert os.stat(dst).st_blocks <= os.stat(src).st_blocks + 16  # the holes stayed holes
    assert os.stat(dst).st_blocks * 512 < 1 << 20


def test_sparse_copy_of_a_file_that_is_all_hole(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.truncate(1 << 20)
    sparse_copy(src, tmp_path / "dst")
    assert (tmp_path / "dst").stat().st_size == 1 << 20 and (tmp_path / "dst").stat().st_blocks == 0


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")
def test_one_blank_file_system_per_size_and_its_copies_are_clean(tmp_path: Path) -> None:
    disks = RootDisks(tmp_path)
    blank = disks._blank(64, "sbx-a")
    made = blank.stat().st_mtime_ns
    assert disks._blank(64, "sbx-b") == blank and blank.stat().st_mtime_ns == made  # made once
    assert disks._blank(80, "sbx-c") != blank and disks._blank(80, "sbx-c").stat().st_size == 80 << 20
    copy = tmp_path / "disk.img"
    sparse_copy(blank, copy)
    check = subprocess.run(["fsck.ext4", "-n", "-f", str(copy)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert [p.name for p in blank.parent.iterdir() if p.name.startswith(".")] == []  # no temporaries
