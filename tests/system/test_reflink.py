"""Reflink disk layers: real FICLONE on a real (loop-mounted XFS where needed) file system."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from forkyard.storage.reflink import ReflinkError, ReflinkPool, clone_file, disk_usage_bytes

pytestmark = pytest.mark.requires_root("mounting the XFS pool")

GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture
def pool(tmp_path: Path):
    p = ReflinkPool(tmp_path / "data", pool_size=8 * GIB)
    p.ensure()
    yield p
    p.destroy()
    assert not os.path.ismount(p.root)
    assert not p.pool_file.exists()


def _write_base(path: Path, size: int) -> None:
    """Real data (not a sparse hole), so a non-reflink copy would cost ``size`` bytes."""
    chunk = os.urandom(MIB)
    with open(path, "wb") as f:
        for _ in range(size // MIB):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def test_hundred_clones_of_a_1gib_base_cost_under_10mib(pool: ReflinkPool) -> None:
    base = pool.root / "base.img"
    _write_base(base, GIB)
    os.sync()
    before = disk_usage_bytes(pool.root)
    started = time.perf_counter()
    for i in range(100):
        clone_file(base, pool.root / "sandboxes" / f"sb{i}" / "upper.img")
    elapsed = time.perf_counter() - started
    os.sync()
    used = disk_usage_bytes(pool.root) - before
    print(f"100 reflink clones of 1 GiB: {elapsed * 1000:.1f} ms, {used / MIB:.2f} MiB new disk")
    assert used < 10 * MIB
    for i in (0, 99):
        assert (pool.root / "sandboxes" / f"sb{i}" / "upper.img").stat().st_size == GIB


def test_clone_is_copy_on_write(pool: ReflinkPool) -> None:
    base = pool.root / "base.img"
    base.write_bytes(b"A" * 65536)
    clone = pool.clone(base, pool.root / "clone.img")
    with open(clone, "r+b") as f:
        f.write(b"B" * 4096)
    assert base.read_bytes() == b"A" * 65536
    assert clone.read_bytes() == b"B" * 4096 + b"A" * (65536 - 4096)


def test_clone_across_file_systems_fails_clearly(pool: ReflinkPool, tmp_path: Path) -> None:
    outside = tmp_path / "outside.img"
    outside.write_bytes(b"x" * 4096)
    with pytest.raises(ReflinkError, match="cannot reflink"):
        clone_file(outside, pool.root / "x.img")
    assert not (pool.root / "x.img").exists()


def test_pool_survives_unmount_and_remount(pool: ReflinkPool) -> None:
    (pool.root / "keep.img").write_bytes(b"keep")
    pool.unmount()
    assert not os.path.ismount(pool.root)
    pool.ensure()
    assert (pool.root / "keep.img").read_bytes() == b"keep"


def test_remove_tree_refuses_paths_outside_the_pool(pool: ReflinkPool, tmp_path: Path) -> None:
    with pytest.raises(ReflinkError):
        pool.remove_tree(tmp_path)
