"""The dependency direction of docs/ARCHITECTURE.md is checked, not just drawn: import-linter's
contracts in pyproject.toml hold for the tree, and break when a lower layer imports a higher one."""

from __future__ import annotations

import ast
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


def _tree_with(tmp_path: Path, offender: str, source: str) -> subprocess.CompletedProcess[str]:
    shutil.copytree(
        REPO / "forkyard", tmp_path / "forkyard", ignore=shutil.ignore_patterns("__pycache__", "*_pb.py")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "forkyard" / offender).write_text(source)
    return lint_imports(tmp_path)


def test_the_gateway_importing_the_node_proxy_is_caught(tmp_path: Path) -> None:
    result = _tree_with(tmp_path, "gateway/offender.py", "from forkyard.api.proxy import SandboxProxy\n")

    assert result.returncode != 0
    assert "the gateway imports no node-API internals" in result.stdout
    assert "forkyard.gateway.offender -> forkyard.api.proxy" in result.stdout


def test_the_gateway_importing_a_route_module_is_caught(tmp_path: Path) -> None:
    result = _tree_with(tmp_path, "gateway/offender.py", "from forkyard.api import routes_sandboxes\n")

    assert result.returncode != 0
    assert "forkyard.gateway.offender -> forkyard.api.routes_sandboxes" in result.stdout


def test_the_api_importing_a_concrete_runtime_is_caught(tmp_path: Path) -> None:
    result = _tree_with(
        tmp_path, "api/offender.py", "from forkyard.runtime.gvisor.runtime import GvisorRuntime\n"
    )

    assert result.returncode != 0
    assert "no layer above the runtimes imports a concrete runtime" in result.stdout
    assert "forkyard.api.offender -> forkyard.runtime.gvisor.runtime" in result.stdout


def private_imports_across_packages(root: Path) -> list[str]:
    """``from forkyard.a.b import _name`` where the importer is not in package ``forkyard.a``: a
    name with an underscore is its module's (or package's) own; what others need is public."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("forkyard."):
                continue
            source_package = str(node.module).rsplit(".", 1)[0]
            for alias in node.names:
                if alias.name.startswith("_") and source_package != package:
                    found.append(f"{module} imports {node.module}.{alias.name}")
    return found


def test_no_private_name_is_imported_from_another_package() -> None:
    assert private_imports_across_packages(REPO / "forkyard") == []


def test_a_private_name_imported_across_packages_is_caught(tmp_path: Path) -> None:
    (tmp_path / "forkyard" / "gateway").mkdir(parents=True)
    (tmp_path / "forkyard" / "gateway" / "offender.py").write_text(
        "from forkyard.api.limits import _content_length\nfrom forkyard.gateway.placement import _x\n"
    )

    assert private_imports_across_packages(tmp_path / "forkyard") == [
        "forkyard.gateway.offender imports forkyard.api.limits._content_length"
    ]
