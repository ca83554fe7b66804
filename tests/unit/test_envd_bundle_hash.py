"""The envd bundle's hash: computed once per fingerprint, recomputed when a bundled file changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forkyard.storage import envd_bundle


def test_hash_is_reused_until_a_bundled_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "forkyard"
    (package / "envd").mkdir(parents=True)
    source = package / "envd" / "app.py"
    source.write_text("print('v1')\n")
    monkeypatch.setattr(envd_bundle, "envd_source_dir", lambda: package / "envd")
    monkeypatch.setattr(envd_bundle, "SHARED_MODULES", ())
    hashed: list[int] = []
    real = envd_bundle._content_hash

    def counting(py: envd_bundle.HostPython) -> str:
        hashed.append(1)
        return real(py)

    monkeypatch.setattr(envd_bundle, "_content_hash", counting)
    envd_bundle._HASHES.clear()

    first = envd_bundle.bundle_hash()
    assert envd_bundle.bundle_hash() == first
    assert len(hashed) == 1  # the second call only stat()ed

    source.write_text("print('v2')\n")  # same size: the mtime tells
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1_000_000))
    second = envd_bundle.bundle_hash()
    assert second != first and len(hashed) == 2

    (package / "envd" / "new.py").write_text("x = 1\n")  # a new module is bundled too
    assert envd_bundle.bundle_hash() not in (first, second)
    envd_bundle._HASHES.clear()
