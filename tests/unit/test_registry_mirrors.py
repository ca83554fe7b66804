"""Registry mirrors for template builds (``FORKYARD_REGISTRY_MIRRORS``): Docker Hub's names pulled
from a mirror that wants credentials (tests/support/mirror_registry.py: Debian's
``docker-registry`` on loopback holding images we made). Docker Hub itself is unreachable here, so
every pull that works came through the mirror (each image carries ``/mirror.txt`` too). No
sandbox and no server: tests/system/test_template_mirrors.py builds through the SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from forkyard.config import RegistryMirror, Settings
from forkyard.storage import images
from tests.support.mirror_registry import MARKER, MIRROR_PASSWORD, MirrorRegistry, mirror_registry


@pytest.fixture(scope="module")
def mirror() -> Iterator[MirrorRegistry]:
    with mirror_registry() as reg:
        yield reg


def _mirrors(reg: MirrorRegistry, **overrides: str | None) -> dict[str, RegistryMirror]:
    entry = {**reg.mirrors()["docker.io"], **overrides}
    return {"docker.io": RegistryMirror.model_validate(entry)}


@pytest.mark.parametrize(
    "image", ["ubuntu:22.04", "docker.io/library/ubuntu:22.04", "busybox", "library/busybox:latest"]
)
def test_docker_hub_names_resolve_through_the_mirror(
    mirror: MirrorRegistry, tmp_path: Path, image: str
) -> None:
    rootfs = tmp_path / "rootfs"
    config = images.pull_image_rootfs(image, rootfs, tmp_path / "pull", mirrors=_mirrors(mirror))
    assert (rootfs / "mirror.txt").read_text() == MARKER
    assert config.env.get("MIRRORED") == "yes"
    assert not (tmp_path / "pull").exists()  # the auth file and registries.conf went with it


def test_without_a_mirror_docker_hub_is_out_of_reach(tmp_path: Path) -> None:
    with pytest.raises(images.ImageError):
        images.pull_image_rootfs("ubuntu:22.04", tmp_path / "rootfs", tmp_path / "pull")


def test_wrong_mirror_credentials_fail_naming_the_mirror_not_the_secret(
    mirror: MirrorRegistry, tmp_path: Path
) -> None:
    with pytest.raises(images.ImageError) as raised:
        images.pull_image_rootfs(
            "ubuntu:22.04",
            tmp_path / "rootfs",
            tmp_path / "pull",
            mirrors=_mirrors(mirror, password="not-the-pw-9431"),
        )
    assert f"through the mirror {mirror.host} of docker.io" in raised.value.message
    assert "not-the-pw-9431" not in raised.value.message and MIRROR_PASSWORD not in raised.value.message


def test_a_mirror_of_another_registry_leaves_docker_hub_alone(mirror: MirrorRegistry, tmp_path: Path) -> None:
    other = {"ghcr.io": RegistryMirror(location=mirror.host)}
    with pytest.raises(images.ImageError) as raised:
        images.pull_image_rootfs("ubuntu:22.04", tmp_path / "rootfs", tmp_path / "pull", mirrors=other)
    assert (
        "through the mirror" not in raised.value.message and "Mirrors also failed" not in raised.value.message
    )


def test_settings_read_mirrors_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "FORKYARD_REGISTRY_MIRRORS",
        '{"docker.io": "https://mirror.internal:5000/hub/", '
        '"ghcr.io": {"location": "m.internal/ghcr", "username": "u", "password": "p", "insecure": true}}',
    )
    mirrors = Settings().registry_mirrors
    assert mirrors["docker.io"] == RegistryMirror(location="mirror.internal:5000/hub")
    assert mirrors["ghcr.io"].username == "u" and mirrors["ghcr.io"].insecure
    assert "p" not in repr(mirrors["ghcr.io"]).replace("username", "")
    monkeypatch.setenv("FORKYARD_REGISTRY_MIRRORS", '{"docker.io": "not a location"}')
    with pytest.raises(ValueError, match="host\\[:port\\]"):
        Settings()


def test_registry_names_and_docker_hub_aliases() -> None:
    assert images.registry_of("ubuntu:22.04") == "docker.io"
    assert images.registry_of("ghcr.io/org/img:1") == "ghcr.io"
    assert images.registry_of("localhost:5000/x") == "localhost:5000"
    hub = RegistryMirror(location="m:5000")
    assert images._mirror_for("docker.io", {"registry-1.docker.io": hub}) is hub
    assert images._mirror_for("docker.io", {"index.docker.io": hub}) is hub
    assert images._mirror_for("quay.io", {"docker.io": hub}) is None
