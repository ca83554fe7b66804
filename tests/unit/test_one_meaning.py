"""One meaning per name: "registry" is an OCI image registry a template build pulls from, and
nothing of ours (the database, the runtime catalogue and the gateway's node directory had the
name too; docs/ARCHITECTURE.md "One meaning per name")."""

from __future__ import annotations

import ast
from pathlib import Path

FORKYARD = Path(__file__).resolve().parents[2] / "forkyard"
#: Our names that do mean an image registry.
IMAGE_REGISTRY_NAMES = {"RegistryMirror", "RegistryAuth", "FromImageRegistry"}
#: The image registries' helpers: a build's credentials and checks, the mirrors' lookups.
IMAGE_REGISTRY_HELPERS = {
    "registry_credentials",
    "_check_registry",
    "_registry_identity",
    "_loopback_registry",
    "registry_of",
}


def test_no_module_of_ours_is_a_registry() -> None:
    assert [str(p.relative_to(FORKYARD)) for p in FORKYARD.rglob("*registry*.py")] == []


def test_only_image_registries_are_called_registry() -> None:
    named = set()
    for path in FORKYARD.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and (
                "registry" in node.name.lower()
            ):
                named.add(node.name)
    assert named - IMAGE_REGISTRY_NAMES <= IMAGE_REGISTRY_HELPERS, named
