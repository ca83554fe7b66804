"""The project's name is forkyard: the old one (another project's on PyPI, which
imports under the same name) appears only where README says where the project came from."""

from __future__ import annotations

import subprocess

from tests.support import REPO

OLD = "agent" + "env"  # spelt apart so that this file does not match itself
#: README's one sentence on where the project came from.
ALLOWED = {"README.md": 1}


def test_nothing_of_ours_is_called_by_the_old_name() -> None:
    tracked = subprocess.run(
        ["git", "grep", "-I", "-i", "-c", OLD], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout
    counts = {path: int(n) for path, n in (line.rsplit(":", 1) for line in tracked.splitlines())}
    assert counts == ALLOWED, counts
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert OLD not in files.lower()
