"""An OCI registry on loopback holding the base template's root as an image: Debian's
``docker-registry``, seeded with an image made from ``base``'s rootfs (umoci) and pushed with skopeo.
Docker Hub is not reachable here; this is the image the template-build and framework tests pull.

    with base_image_registry(tags=("latest", "v2")) as reg:
        reg.image("latest")      # "127.0.0.1:<port>/forkyard/base:latest"

The image is Debian with python3 and bash (what the base template has), and ``FROM_IMAGE_ENV=yes``
in its config. Seeding takes ~10-30 s (a copy and a compression of the root). No pytest here.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support import SHARED_TEMPLATES, free_port

REPOSITORY = "forkyard/base"


@dataclass
class BaseImageRegistry:
    host: str
    seconds: float

    def image(self, tag: str = "latest") -> str:
        return f"{self.host}/{REPOSITORY}:{tag}"


@contextlib.contextmanager
def base_image_registry(tags: Sequence[str] = ("latest",)) -> Iterator[BaseImageRegistry]:
    for tool in ("docker-registry", "umoci", "skopeo"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed (scripts/bootstrap.sh --test installs it)")
    work = Path(tempfile.mkdtemp(prefix="forkyard-registry-"))
    port = free_port()
    config = work / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {work / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
    )
    log = open(work / "registry.log", "wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    host = f"127.0.0.1:{port}"
    try:
        _wait_http(f"http://{host}/v2/", proc)
        started = time.monotonic()
        layout = _base_layout(work)
        for tag in tags:
            subprocess.run(
                [
                    "skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                    f"oci:{layout}:base", f"docker://{host}/{REPOSITORY}:{tag}",
                ],
                check=True,
                capture_output=True,
            )  # fmt: skip
        yield BaseImageRegistry(host, time.monotonic() - started)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def _base_layout(work: Path) -> Path:
    layout, bundle = work / "layout", work / "bundle"
    for cmd in (
        ["umoci", "init", "--layout", str(layout)],
        ["umoci", "new", "--image", f"{layout}:base"],
        ["umoci", "unpack", "--image", f"{layout}:base", str(bundle)],
        ["cp", "-a", f"{SHARED_TEMPLATES / 'base' / 'rootfs'}/.", str(bundle / "rootfs")],
        # Documentation and translations are a quarter of the root and nothing here reads them.
        ["rm", "-rf", *(str(bundle / "rootfs/usr/share" / d) for d in ("doc", "man", "locale"))],
        ["umoci", "repack", "--image", f"{layout}:base", str(bundle)],
        ["umoci", "config", "--image", f"{layout}:base", "--config.env", "FROM_IMAGE_ENV=yes"],
    ):
        subprocess.run(cmd, check=True, capture_output=True)
    shutil.rmtree(bundle)
    return layout


def _wait_http(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("docker-registry exited")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"docker-registry did not answer {url}")
