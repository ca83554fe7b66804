"""The official JS SDK (npm ``e2b``, tests/js/package.json) against a real ``forkyard serve``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.support import TESTS
from tests.support.leaks import wait_no_host_resources
from tests.support.server import ServerProcess

JS_DIR = TESTS / "js"


def test_js_sdk_create_run_write_read_kill(forkyard_server: ServerProcess) -> None:
    if shutil.which("node") is None:
        pytest.fail("node is not installed (scripts/bootstrap.sh --test installs it)")
    if not (JS_DIR / "node_modules" / "e2b").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=JS_DIR, check=True)
    proc = subprocess.run(
        ["node", "smoke.mjs"],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **forkyard_server.sdk_env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stdout"] == "hi-from-js\n" and out["stderr"] == "err\n" and out["exitCode"] == 0
    assert out["read"] == "written by js" and out["listed"] is True
    assert out["found"] == [out["sandboxId"]] and out["info"] == "base"
    assert out["killed"] is True and out["runningAfterKill"] is False
    assert wait_no_host_resources(out["sandboxId"]) == []


def test_js_sdk_volumes(forkyard_server: ServerProcess) -> None:
    """Volume.create, the content API and volumeMounts on create through the JS SDK."""
    if shutil.which("node") is None:
        pytest.fail("node is not installed (scripts/bootstrap.sh --test installs it)")
    proc = subprocess.run(
        ["node", "volumes.mjs"],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **forkyard_server.sdk_env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["written"], out["read"], out["listed"], out["inList"]) == (7, "from js", ["in.txt"], True)
    assert out["seenInSandbox"] == "from js" and out["back"] == "back\n"
    assert out["mounts"] == [{"name": out["name"], "path": "/mnt/js"}]
    assert out["destroyed"] is True
