"""Which Firecracker releases the firecracker runtime speaks to, and the check a binary must pass
(beside the runtime package: the runtime catalogue, kinds.py, checks a binary without importing a
concrete runtime).

The API bodies the runtime sends are checked against Firecracker 1.17's published schema (tests/
data/firecracker) and ran for real against v1.12.1 (the emulated KVM host, docs/KVM.md); a binary
outside that range may reject a field or lack one (the balloon's free page reporting, the Uffd
handshake's ``page_size``), so it is refused with the reason rather than failing mid-boot."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

#: (major, minor) of the oldest and the newest supported release, both included.
OLDEST_SUPPORTED = (1, 12)
NEWEST_SUPPORTED = (1, 17)

_VERSION = re.compile(r"Firecracker v(\d+)\.(\d+)\.(\d+)")


def parse_version(output: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) from ``firecracker --version`` output, None when it has none."""
    m = _VERSION.search(output)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def version_problem(output: str) -> str | None:
    """None when ``firecracker --version`` printed a supported release, else why not."""
    version = parse_version(output)
    if version is None:
        return f"firecracker --version printed no version: {output.strip()[:200]!r}"
    if not OLDEST_SUPPORTED <= version[:2] <= NEWEST_SUPPORTED:
        found = ".".join(map(str, version))
        low, high = (".".join(map(str, v)) for v in (OLDEST_SUPPORTED, NEWEST_SUPPORTED))
        return f"firecracker v{found} is not supported (supported: v{low}.x to v{high}.x)"
    return None


def binary_version_problem(binary: str) -> str | None:
    """None when the firecracker at ``binary`` (a path or a name on PATH) is a supported release."""
    return version_problem(_version_output(*_file_key(binary)))


def binary_version(binary: str) -> tuple[int, int, int] | None:
    """The release of the firecracker at ``binary``, None when it does not say."""
    return parse_version(_version_output(*_file_key(binary)))


def _file_key(binary: str) -> tuple[str, int, int]:
    """A replaced binary (another inode or mtime) is asked again."""
    path = shutil.which(binary) or binary
    try:
        st = os.stat(path)
    except OSError:
        return path, 0, 0
    return path, st.st_ino, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _version_output(binary: str, _inode: int, _mtime_ns: int) -> str:
    """``firecracker --version``, asked once per binary file (the start-up probe, every VMM start)."""
    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"firecracker --version failed: {exc}"
    return proc.stdout + proc.stderr
