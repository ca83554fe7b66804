"""An OCI registry that wants credentials: Debian's ``docker-registry`` on loopback (plain HTTP,
which skopeo allows with TLS verification off) with htpasswd authentication, holding one small
image pushed with skopeo. The template-build tests pull from it the three ways E2B's SDK offers
(``from_image`` with a username and password, ``from_gcp_registry``, ``from_aws_registry``).

    with auth_registry() as reg:   # reg.image: "127.0.0.1:<port>/private/hello:v1"

htpasswd wants bcrypt: the hashes come from the C library's ``crypt`` (libxcrypt does ``$2b$``), so
nothing is installed for it. The image is a static busybox (``/bin/sh``, ``adduser``: what the
builder's provisioning needs), one file ``/hello.txt`` and ``PRIVATE_IMAGE=yes`` in its config.

No pytest here (like tests/support/s3.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx

from tests.support import free_port

with warnings.catch_warnings():  # deprecated in 3.11, gone in 3.13: the test's bcrypt hashes only
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt

PASSWORD = "s3cret-registry-password"
#: Short: Go's bcrypt refuses passwords over 72 bytes (real GCP registries do not use bcrypt).
SERVICE_ACCOUNT = {"type": "service_account", "project_id": "forkyard"}
#: What moto's ECR GetAuthorizationToken returns: base64("AWS:<account>-auth-token").
ECR_USER, ECR_TOKEN = "AWS", "123456789012-auth-token"
HELLO = "from a private registry\n"


@dataclass
class AuthRegistry:
    host: str
    image: str
    log: Path


def _bcrypt(password: str) -> str:
    return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))


@contextlib.contextmanager
def auth_registry() -> Iterator[AuthRegistry]:
    for tool in ("docker-registry", "umoci", "skopeo", "busybox"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed (scripts/bootstrap.sh --test installs it)")
    work = Path(tempfile.mkdtemp(prefix="forkyard-authreg-"))
    users = {"alice": PASSWORD, "_json_key": json.dumps(SERVICE_ACCOUNT), ECR_USER: ECR_TOKEN}
    log, proc, host = start_htpasswd_registry(work, users, realm="forkyard-test", level="warn")
    try:
        _wait_for_auth(f"http://{host}/v2/", proc)
        image = f"{host}/private/hello:v1"
        _seed(work, image)
        yield AuthRegistry(host, image, work / "registry.log")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def _wait_for_auth(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("docker-registry exited")
        try:
            if httpx.get(url, timeout=1).status_code == 401:  # up, and wants credentials
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"docker-registry did not answer {url}")


def start_htpasswd_registry(
    work: Path, users: dict[str, str], *, realm: str, level: str
) -> tuple[BinaryIO, subprocess.Popen[bytes], str]:
    """Debian's docker-registry on a free loopback port, storing under ``work`` and asking
    ``users`` (name -> password) for htpasswd logins: (its log file, its process, host:port)."""
    (work / "htpasswd").write_text("".join(f"{u}:{_bcrypt(p)}\n" for u, p in users.items()))
    port = free_port()
    (work / "config.yml").write_text(
        f"version: 0.1\nlog:\n  level: {level}\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {work / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
        f"auth:\n  htpasswd:\n    realm: {realm}\n    path: {work / 'htpasswd'}\n"
    )
    log = open(work / "registry.log", "wb")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(work / "config.yml")], stdout=log, stderr=subprocess.STDOUT
    )
    return log, proc, f"127.0.0.1:{port}"


def busybox_layout(work: Path, file: tuple[str, str], env: str) -> Path:
    """An OCI layout (``<work>/layout``, image ``img``) of a static busybox (what the builder's
    provisioning needs: ``/bin/sh``, ``adduser``) with ``file`` (name, text) at its root and ``env``
    (``NAME=value``) in its config."""
    layout, bundle = work / "layout", work / "bundle"
    for cmd in (
        ["umoci", "init", "--layout", str(layout)],
        ["umoci", "new", "--image", f"{layout}:img"],
        ["umoci", "unpack", "--image", f"{layout}:img", str(bundle)],
    ):
        subprocess.run(cmd, check=True, capture_output=True)
    root = bundle / "rootfs"
    for d in ("bin", "etc", "tmp", "root"):
        (root / d).mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)
    shutil.copy2(str(shutil.which("busybox")), root / "bin" / "busybox")
    subprocess.run(["chroot", str(root), "/bin/busybox", "--install", "-s", "/bin"], check=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    (root / file[0]).write_text(file[1])
    for cmd in (
        ["umoci", "repack", "--image", f"{layout}:img", str(bundle)],
        ["umoci", "config", "--image", f"{layout}:img", "--config.env", env],
    ):
        subprocess.run(cmd, check=True, capture_output=True)
    shutil.rmtree(bundle)
    return layout


def _seed(work: Path, image: str) -> None:
    layout = busybox_layout(work, ("hello.txt", HELLO), "PRIVATE_IMAGE=yes")
    for cmd in (
        [
            "skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--dest-creds", f"alice:{PASSWORD}",
            f"oci:{layout}:img", f"docker://{image}",
        ],
    ):  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
