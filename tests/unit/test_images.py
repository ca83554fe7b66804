"""Guest image pipeline pieces that need no VM: bzImage payload extraction, cpio, modules."""

from __future__ import annotations

import gzip
import lzma
import struct
from pathlib import Path

import lz4.block
import pytest

from forkyard.storage import images

ELF = b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 64


def _bzimage(payload: bytes, setup_sects: int = 3) -> bytes:
    """A minimal bzImage: boot header (protocol 2.15) + protected-mode part holding ``payload``."""
    setup = bytearray((setup_sects + 1) * 512)
    setup[0x1F1] = setup_sects
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, 0x20F)
    offset = 0x40  # the decompressor stub precedes the payload
    struct.pack_into("<II", setup, 0x248, offset, len(payload))
    return bytes(setup) + b"\x90" * offset + payload + b"\0" * 16


def _lz4_legacy(data: bytes) -> bytes:
    out = bytearray(b"\x02\x21\x4c\x18")
    for i in range(0, len(data), 8 << 20):
        block = lz4.block.compress(data[i : i + (8 << 20)], store_size=False)
        out += struct.pack("<I", len(block)) + block
    return bytes(out) + struct.pack("<I", len(data))  # the kernel build appends the size


@pytest.mark.parametrize(
    "compress",
    [gzip.compress, lambda d: lzma.compress(d, format=lzma.FORMAT_XZ), _lz4_legacy],
    ids=["gzip", "xz", "lz4-legacy"],
)
def test_extract_vmlinux(compress) -> None:  # type: ignore[no-untyped-def]
    assert images.extract_vmlinux(_bzimage(compress(ELF))) == ELF


def test_extract_vmlinux_errors() -> None:
    with pytest.raises(images.ImageError, match="not a bzImage"):
        images.extract_vmlinux(b"\0" * 4096)
    with pytest.raises(images.ImageError, match="unknown kernel payload compression"):
        images.extract_vmlinux(_bzimage(b"\x11\x22\x33\x44" * 8))
    with pytest.raises(images.ImageError, match="not an ELF"):
        images.extract_vmlinux(_bzimage(gzip.compress(b"not a kernel")))


def test_cpio_newc_layout() -> None:
    archive = images._cpio_newc([("init", 0o100755, b"#!/bin/sh\n"), ("dev/console", 0o20600, b"")])
    assert archive.startswith(b"070701") and len(archive) % 4 == 0
    assert b"TRAILER!!!\0" in archive
    header = archive.index(b"dev/console") - 110
    fields = archive[header + 6 : header + 110]
    rdev = int(fields[9 * 8 : 10 * 8], 16), int(fields[10 * 8 : 11 * 8], 16)
    assert rdev == (5, 1)  # /dev/console is a real character device for init's stdio


def test_init_script_execs_envd_from_its_drive() -> None:
    script = images.init_script()
    assert script.startswith("#!/bin/busybox sh")
    assert "exec /bin/env -i PATH=" in script and " /bin/switch_root /newroot /.forkyard/" in script
    assert "/.forkyard/lib/ld-linux-x86-64.so.2" in script and "-m forkyard.envd" in script


def _template(root: Path, marker: str) -> Path:
    rootfs = root / "rootfs"
    (rootfs / "etc").mkdir(parents=True, exist_ok=True)
    (rootfs / "etc" / "hostname").write_text("sandbox\n")
    (root / ".complete").write_text(marker)
    return rootfs


def test_rootfs_digest_is_remembered_per_template_build(tmp_path: Path) -> None:
    """The emulated KVM host's node hashed the base rootfs listing over 9p for minutes on every
    first create: the digest is remembered per build (the .complete marker and the root's
    mtime), and a new build (new marker) is walked again."""
    rootfs = _template(tmp_path / "tpl", "2026-12-06 build-1\n")
    memo = tmp_path / "memo"
    first = images.rootfs_digest(rootfs, memo)
    assert first == images.tree_digest(rootfs)
    (rootfs / "etc" / "motd").write_text("deep in the tree: the same build\n")
    assert images.rootfs_digest(rootfs, memo) == first  # remembered, not walked
    (tmp_path / "tpl" / ".complete").write_text("2026-12-06 build-2\n")
    assert images.rootfs_digest(rootfs, memo) == images.tree_digest(rootfs) != first


def test_rootfs_digest_without_a_marker_or_a_writable_memo_is_computed(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    (bare / "etc").mkdir(parents=True)
    assert images.rootfs_digest(bare, tmp_path / "memo") == images.tree_digest(bare)
    assert not (tmp_path / "memo").exists()
    rootfs = _template(tmp_path / "tpl", "m\n")
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    assert images.rootfs_digest(rootfs, blocked / "memo") == images.tree_digest(rootfs)
