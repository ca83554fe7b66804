"""A registry mirror for template builds: Debian's ``docker-registry`` on loopback with htpasswd
authentication, holding images we make ourselves under the names Docker Hub gives them
(``library/ubuntu:22.04``, ``library/busybox:latest``), so that ``FROM ubuntu:22.04`` and
``from_image("docker.io/library/busybox")`` resolve through it (nodes are configured with
``FORKYARD_REGISTRY_MIRRORS={"docker.io": ...}``). Docker Hub is not reachable here: a pull that
works came from the mirror; each image also carries ``/mirror.txt`` to show it.

    with mirror_registry() as mirror:   # mirror.host "127.0.0.1:<port>", mirror.settings_json

The images are a static busybox with ``/mirror.txt`` (a second or so to pull); no pytest here.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.auth_registry import _wait_for_auth, busybox_layout, start_htpasswd_registry

MIRROR_USER, MIRROR_PASSWORD = "mirror-reader", "mirror-s3cret"
MIRRORED = ("library/ubuntu:22.04", "library/busybox:latest")
MARKER = "served by the forkyard test mirror\n"


@dataclass
class MirrorRegistry:
    host: str
    log: Path

    def mirrors(self, *, credentials: bool = True) -> dict[str, dict[str, str]]:
        """``FORKYARD_REGISTRY_MIRRORS``' value mapping Docker Hub to this registry."""
        entry = {"location": self.host}
        if credentials:
            entry |= {"username": MIRROR_USER, "password": MIRROR_PASSWORD}
        return {"docker.io": entry}

    def settings_json(self, *, credentials: bool = True) -> str:
        return json.dumps(self.mirrors(credentials=credentials))


@contextlib.contextmanager
def mirror_registry() -> Iterator[MirrorRegistry]:
    for tool in ("docker-registry", "umoci", "skopeo", "busybox"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed (scripts/bootstrap.sh --test installs it)")
    work = Path(tempfile.mkdtemp(prefix="forkyard-mirror-"))
    users = {MIRROR_USER: MIRROR_PASSWORD}
    log, proc, host = start_htpasswd_registry(work, users, realm="forkyard-mirror", level="info")
    try:
        _wait_for_auth(f"http://{host}/v2/", proc)
        layout = busybox_layout(work, ("mirror.txt", MARKER), "MIRRORED=yes")
        for name in MIRRORED:
            subprocess.run(
                [
                    "skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                    "--dest-creds", f"{MIRROR_USER}:{MIRROR_PASSWORD}",
                    f"oci:{layout}:img", f"docker://{host}/{name}",
                ],
                check=True,
                capture_output=True,
            )  # fmt: skip
        yield MirrorRegistry(host, work / "registry.log")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
