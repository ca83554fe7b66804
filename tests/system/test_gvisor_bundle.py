"""The envd runtime bundle: self-contained, pruned, content-addressed; runs envd in a rootfs
that has nothing but a static busybox (no python, no libc), inside gVisor."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from e2b.envd.client_shared import ENVD_JSON_CODEC
from e2b.envd.process import process_connect, process_pb

from forkyard.config import Settings
from forkyard.runtime.gvisor.runtime import GvisorRuntime
from forkyard.storage.envd_bundle import (
    LOADER_NAME,
    STDLIB_REL,
    build_envd_bundle,
    bundle_hash,
    envd_argv,
    envd_env,
)
from forkyard.storage.templates import build_template
from forkyard.types import SandboxInstance
from tests.support import SHARED_TEMPLATES
from tests.support.fixtures import RuntimeFactory, SandboxFactory

pytestmark = pytest.mark.requires_root("runsc, chroot")
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"


def test_bundle_layout_and_pruning(envd_bundle: Path) -> None:
    manifest = json.loads((envd_bundle / "manifest.json").read_text())
    assert envd_bundle.name == manifest["hash"] == bundle_hash()
    stdlib = envd_bundle / STDLIB_REL
    for pruned in ("test", "idlelib", "tkinter", "ensurepip", "lib2to3"):
        assert not (stdlib / pruned).exists(), pruned
    assert not list(stdlib.glob("config-*"))
    site = stdlib / "site-packages"
    for needed in ("starlette", "uvicorn", "h11", "anyio", "connectrpc", "forkyard/envd"):
        assert (site / needed).is_dir(), needed
    assert not (site / "fastapi").exists() and not (site / "pydantic").exists()  # not envd's
    assert not list(site.glob("*.pth"))  # no editable-install hooks pointing at the host
    assert list((site / "forkyard/envd/__pycache__").glob("server.cpython-*.pyc"))
    lib = envd_bundle / "lib"
    for name in (LOADER_NAME, "libc.so.6", "libpython3.11.so.1.0", "libssl.so.3", "libgcc_s.so.1"):
        assert (lib / name).is_file(), name
    python = str(envd_bundle / "bin/python3")
    interp = subprocess.run(["readelf", "-l", python], capture_output=True, text=True)
    assert f"/.forkyard/lib/{LOADER_NAME}" in interp.stdout
    assert (envd_bundle / "bin/envd").read_text().startswith("#!/.forkyard/bin/python3 -I\n")
    print(f"\nenvd bundle: {manifest['size_bytes'] / 1e6:.1f} MB, {len(manifest['libraries'])} libraries")


def test_argv_and_env_do_not_leak_the_bundle() -> None:
    argv = envd_argv()
    assert argv[:4] == [
        "/.forkyard/lib/ld-linux-x86-64.so.2",
        "--library-path",
        "/.forkyard/lib",
        "/.forkyard/bin/python3",
    ]
    assert argv[4:7] == ["-I", "-m", "forkyard.envd"]
    env = envd_env({"FOO": "bar"})
    assert env["FOO"] == "bar" and not any(k.startswith("PYTHON") for k in env)


def test_concurrent_builds_share_one_bundle(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, templates_path=SHARED_TEMPLATES)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(build_envd_bundle(settings))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    entries = [p.name for p in (tmp_path / "envd-runtime").iterdir() if p.name != ".lock"]
    assert entries == [results[0].name]  # no temporary build directory left


def test_bundle_runs_in_busybox_chroot(envd_bundle: Path, tmp_path: Path) -> None:
    """Outside any sandbox: chroot into a busybox-only tree with the bundle bind-mounted."""
    settings = Settings(data_dir=tmp_path / "data", templates_path=tmp_path / "templates")
    rootfs = build_template("busybox", settings).rootfs
    target = rootfs / ".forkyard"
    subprocess.run(["mount", "--bind", "-o", "ro", str(envd_bundle), str(target)], check=True)
    try:
        code = "import sys, forkyard.envd.server, ssl, json; print(sys.prefix, sys.version_info[:2])"
        argv = [*envd_argv()[:4], "-I", "-c", code]
        out = subprocess.run([CHROOT, str(rootfs), *argv], capture_output=True, text=True, env={}, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == "/.forkyard"
        launcher = subprocess.run(
            [CHROOT, str(rootfs), "/.forkyard/bin/envd", "--help"],
            capture_output=True,
            text=True,
            env={},
            timeout=60,
        )
        assert launcher.returncode == 0 and "--port" in launcher.stdout, launcher.stderr
    finally:
        subprocess.run(["umount", str(target)], check=True)


def run_sh(instance: SandboxInstance, script: str) -> tuple[int, bytes]:
    """Run ``/bin/sh -c script`` through envd's Process.Start (the SDK's low-level client;
    ``sandbox.commands.run`` would use /bin/bash, which a busybox rootfs does not have)."""
    client = process_connect.ProcessClientSync(instance.envd_url, codec=ENVD_JSON_CODEC)
    request = process_pb.StartRequest(process=process_pb.ProcessConfig(cmd="/bin/sh", args=["-c", script]))
    output, exit_code = b"", -1
    for message in client.start(request, timeout_ms=30_000, headers={"User-Agent": "forkyard-test"}):
        event = message.event.event if message.event else None
        if event is None:
            continue
        if event.field == "data":
            data = event.value
            output += (data.stdout or b"") if hasattr(data, "stdout") else b""  # type: ignore[union-attr]
            output += (getattr(data, "output", None) and data.output.value) or b""  # type: ignore[union-attr]
        elif event.field == "end":
            exit_code = event.value.exit_code  # type: ignore[union-attr]
    return exit_code, output


@pytest.mark.asyncio(loop_scope="session")
async def test_envd_runs_in_busybox_sandbox(
    runtime_factory: RuntimeFactory, sandbox_factory: SandboxFactory, tmp_path: Path
) -> None:
    runtime = runtime_factory("gvisor")
    assert isinstance(runtime, GvisorRuntime)
    settings = Settings(data_dir=tmp_path / "data", templates_path=tmp_path / "templates")
    busybox = await asyncio.to_thread(build_template, "busybox", settings)
    assert not (busybox.rootfs / "usr").exists()
    instance = await sandbox_factory(runtime, template=busybox)
    async with httpx.AsyncClient(trust_env=False) as client:
        assert (await client.get(f"{instance.envd_url}/health")).status_code == 204
    code, out = await asyncio.to_thread(run_sh, instance, "ls /bin/python3 2>&1; echo hello-$((6*7))")
    assert code == 0, out
    assert b"hello-42" in out and b"No such file" in out
