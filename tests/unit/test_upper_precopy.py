"""Pre-copy of a running sandbox's upper (``upper_delta.precopy`` and ``build``): large settled files
are copied before the pause and linked into the layer only while they are provably unchanged."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forkyard.runtime.gvisor import cgroups, upper_delta

BIG = upper_delta.PRECOPY_MIN_BYTES * 2


def _settle() -> None:
    time.sleep(upper_delta.SETTLED_NS / 1e9 + 0.02)


def _upper(tmp_path: Path) -> Path:
    upper = tmp_path / "upper"
    (upper / "home/user").mkdir(parents=True)
    (upper / "home/user/big").write_bytes(b"a" * BIG)
    (upper / "home/user/small").write_text("small\n")
    return upper


def test_a_settled_large_file_is_copied_before_and_linked_in_the_pause(tmp_path: Path) -> None:
    upper = _upper(tmp_path)
    _settle()
    staged = upper_delta.precopy(upper, tmp_path / "staging", {}, set())
    assert set(staged) == {"home/user/big"}  # the small file waits for the pause's copy

    upper_delta.build(upper, tmp_path / "layer", {}, staged, set())
    layer_big = tmp_path / "layer/home/user/big"
    assert layer_big.samefile(staged["home/user/big"].path)  # linked, not copied again
    assert layer_big.read_bytes() == b"a" * BIG
    assert (tmp_path / "layer/home/user/small").read_text() == "small\n"


def test_a_file_changed_after_its_precopy_is_copied_in_the_pause(tmp_path: Path) -> None:
    upper = _upper(tmp_path)
    _settle()
    staged = upper_delta.precopy(upper, tmp_path / "staging", {}, set())
    with open(upper / "home/user/big", "r+b") as f:  # same size, same inode: only times move
        f.write(b"b")

    upper_delta.build(upper, tmp_path / "layer", {}, staged, set())
    layer_big = tmp_path / "layer/home/user/big"
    assert not layer_big.samefile(staged["home/user/big"].path)
    assert layer_big.read_bytes() == b"b" + b"a" * (BIG - 1)


def test_a_mapped_file_is_copied_in_the_pause_even_when_its_times_did_not_move(tmp_path: Path) -> None:
    """A write through a mapping whose pages are already writable moves no timestamp: the staged
    copy below stands for such a stale copy (its key still matches the upper's file)."""
    upper = _upper(tmp_path)
    _settle()
    staged = upper_delta.precopy(upper, tmp_path / "staging", {}, set())
    staged["home/user/big"].path.write_bytes(b"stale" * 10)
    ino = (upper / "home/user/big").stat().st_ino

    upper_delta.build(upper, tmp_path / "layer", {}, staged, {ino})
    assert (tmp_path / "layer/home/user/big").read_bytes() == b"a" * BIG

    upper_delta.build(upper, tmp_path / "layer2", {}, staged, set())  # what the guard prevents
    assert (tmp_path / "layer2/home/user/big").read_bytes() == b"stale" * 10


def test_just_written_mapped_and_unchanged_files_are_not_precopied(tmp_path: Path) -> None:
    upper = _upper(tmp_path)
    _settle()
    before = upper_delta.scan(upper)
    (upper / "home/user/other").write_bytes(b"o" * BIG)
    (upper / "home/user/fresh").write_bytes(b"f" * BIG)
    other_ino = (upper / "home/user/other").stat().st_ino
    time.sleep(upper_delta.SETTLED_NS / 1e9 + 0.02)
    (upper / "home/user/fresh").write_bytes(b"g" * BIG)  # written again just now

    staged = upper_delta.precopy(upper, tmp_path / "staging", before, {other_ino})
    # big: unchanged since ``before``; other: mapped; fresh: written within SETTLED_NS
    assert staged == {}


@pytest.fixture
def freezer_cgroup() -> object:
    group = cgroups.CGROUP_V1_ROOT / "freezer" / cgroups.CGROUP_PARENT / f"precopy-test-{os.getpid()}"
    if not (cgroups.CGROUP_V1_ROOT / "freezer").is_dir() or os.geteuid() != 0:
        pytest.skip("needs root and the cgroup v1 freezer hierarchy (where runsc puts sandboxes)")
    group.mkdir(parents=True, exist_ok=True)
    yield group
    group.rmdir()


def test_mapped_inodes_sees_a_shared_mapping_held_by_a_process_of_the_sandbox(
    tmp_path: Path, freezer_cgroup: Path
) -> None:
    target = tmp_path / "mapped.bin"
    target.write_bytes(b"\0" * mmap.PAGESIZE)
    unmapped = tmp_path / "plain.bin"
    unmapped.write_bytes(b"\0" * mmap.PAGESIZE)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys, time\n"
            "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0)\n"
            "m[0:2] = b'hi'; print('mapped', flush=True); time.sleep(60)\n",
            str(target),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        (freezer_cgroup / "cgroup.procs").write_text(str(holder.pid))
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"
        mapped = cgroups.mapped_inodes(freezer_cgroup.name)
        assert mapped is not None
        assert target.stat().st_ino in mapped and unmapped.stat().st_ino not in mapped
        assert cgroups.mapped_inodes("no-such-sandbox") is None  # unknown: no pre-copy
    finally:
        holder.kill()
        holder.wait()
