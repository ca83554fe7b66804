"""The two distributions as a user installs them: wheels built from this checkout, installed into
fresh virtual environments (dependencies from the package index, as `pip install` does).

* ``forkyard[rl]``: the ``forkyard`` command serves, and the official SDK drives a sandbox through it;
  the RL client imports beside it.
* ``forkyard-rl`` alone: the RL client and the SDK, nothing of the server.
* Nothing installed has the old name (another project's on PyPI).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from tests.support import REPO
from tests.support.server import remove_data_dir, start_server

OLD_NAME = "agent" + "env"  # spelt apart: tests/unit/test_name.py finds the old name nowhere
pytestmark = pytest.mark.requires_root("serves real gVisor sandboxes from an installed wheel")


def run(*argv: str | Path, cwd: Path = Path("/")) -> str:
    """Run from outside the checkout (``python -c`` puts the working directory on the path)."""
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, f"{argv}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    for project in (REPO, REPO / "clients" / "rl"):
        run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, project)
    return dist


def fresh_venv(root: Path, wheels: Path, requirement: str) -> Path:
    """A new venv in ``root`` with ``requirement`` installed from ``wheels`` (and the index)."""
    run(sys.executable, "-m", "venv", root)
    python = root / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--find-links", wheels, requirement, cwd=root)
    return python


def installed(python: Path) -> set[str]:
    listing = run(python, "-m", "pip", "list", "--format=freeze")
    return {line.split("==")[0].lower() for line in listing.splitlines() if "==" in line}


def test_the_wheels_are_named_forkyard(wheels: Path) -> None:
    names = sorted(w.name for w in wheels.glob("*.whl"))
    assert [n.split("-")[0] for n in names] == ["forkyard", "forkyard_rl"], names
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            assert not [n for n in archive.namelist() if OLD_NAME in n.lower()]
            entry_points = [n for n in archive.namelist() if n.endswith("entry_points.txt")]
            for name in entry_points:
                assert OLD_NAME not in archive.read(name).decode().lower()


@pytest.fixture(scope="module")
def server_venv(wheels: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fy-venv-") as root:
        yield fresh_venv(Path(root), wheels, "forkyard[rl]")


def test_forkyard_with_rl_serves_and_the_sdk_runs_a_command(server_venv: Path) -> None:
    packages = installed(server_venv)
    assert {"forkyard", "forkyard-rl", "e2b"} <= packages and OLD_NAME not in packages
    assert "Usage" in run(server_venv.parent / "forkyard", "--help")
    # The RL client and the server's modules, from the installed wheels (not this checkout).
    where = run(
        server_venv,
        "-c",
        "import forkyard, forkyard_rl, forkyard.api.app; print(forkyard.__file__, forkyard_rl.__file__)",
    )
    assert str(REPO) not in where and "site-packages" in where

    data_dir = Path(tempfile.mkdtemp(prefix="fy-wheel-", dir="/tmp"))
    server = start_server(data_dir, python=server_venv)
    try:
        sandbox = Sandbox.create("base", timeout=60, **server.sdk_opts)
        try:
            assert sandbox.commands.run("echo served from the wheel").stdout == "served from the wheel\n"
        finally:
            sandbox.kill()
    finally:
        server.kill_all_sandboxes()
        server.stop()
        remove_data_dir(data_dir)


def test_forkyard_rl_alone_needs_only_the_sdk(wheels: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "venv", wheels, "forkyard-rl")
    packages = installed(python)
    assert {"forkyard-rl", "e2b"} <= packages
    assert not {"forkyard", "fastapi", "uvicorn", "sqlalchemy", "boto3"} & packages, packages
    run(python, "-c", "from forkyard_rl import ForkTree, SandboxGroup, grpo_step; import e2b")
    missing = subprocess.run(
        [python, "-c", "import forkyard"], cwd="/", capture_output=True, text=True, check=False
    )
    assert missing.returncode != 0 and "No module named 'forkyard'" in missing.stderr
