"""The dependency direction of docs/ARCHITECTURE.md is checked, not just drawn: import-linter's
contracts in pyproject.toml hold for the tree, and break when a lower layer imports a higher one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_its_layers() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


def test_a_lower_layer_importing_a_higher_one_is_caught(tmp_path: Path) -> None:
    shutil.copytree(
        REPO / "forkyard", tmp_path / "forkyard", ignore=shutil.ignore_patterns("__pycache__", "*_pb.py")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    offender = tmp_path / "forkyard" / "storage" / "layering_offender.py"
    offender.write_text("from forkyard.orchestrator import lifecycle  # storage must not see it\n")

    result = lint_imports(tmp_path)

    assert result.returncode != 0
    assert "forkyard.storage.layering_offender -> forkyard.orchestrator.lifecycle" in result.stdout


def test_envd_importing_the_host_side_is_caught(tmp_path: Path) -> None:
    shutil.copytree(
        REPO / "forkyard", tmp_path / "forkyard", ignore=shutil.ignore_patterns("__pycache__", "*_pb.py")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "forkyard" / "envd" / "offender.py").write_text("import forkyard.config\n")

    result = lint_imports(tmp_path)

    assert result.returncode != 0
    assert "forkyard.envd.offender -> forkyard.config" in result.stdout
