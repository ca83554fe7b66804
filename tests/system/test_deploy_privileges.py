"""What a node's container needs (README "Cluster", "What the container needs"), measured: a gVisor
node started with only Docker's default capabilities plus CAP_SYS_ADMIN, CAP_NET_ADMIN and
CAP_SYS_PTRACE, and with no_new_privs (what the systemd node units set), creates a sandbox with its
network, runs a command in it, and after a kill -9 and a restart under the same limits re-attaches it.

The limits are the kernel's: the scenario runs in a child process under ``setpriv``, so the server
it starts (and runsc, iptables, ip under it) inherit them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.support import REPO, base_template_missing
from tests.support.leaks import wait_no_host_resources
from tests.support.server import remove_data_dir, start_server

pytestmark = pytest.mark.requires_root("capabilities are dropped from root's")

#: Docker's default capability set (moby's oci/caps/defaults.go) plus the three the node needs.
DOCKER_DEFAULT_CAPS = (
    "chown dac_override fsetid fowner mknod net_raw setgid setuid setfcap setpcap net_bind_service "
    "sys_chroot kill audit_write"
).split()
NODE_CAPS = [*DOCKER_DEFAULT_CAPS, "sys_admin", "net_admin", "sys_ptrace"]


def constrained(argv: list[str]) -> list[str]:
    bounding = ",".join(["-all", *(f"+{cap}" for cap in NODE_CAPS)])
    return ["setpriv", "--no-new-privs", "--inh-caps=-all", f"--bounding-set={bounding}", *argv]


def scenario() -> None:
    """Run in the constrained child: create, command, kill -9 of the server, restart, re-attach."""
    data = Path(tempfile.mkdtemp(prefix="forkyard-caps-", dir="/tmp"))
    server = start_server(data, extra_env={"FORKYARD_SANDBOX_SUBNET": "10.217.0.0/16"})
    headers = {"X-API-Key": server.api_key}
    try:
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
            resp = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
            assert resp.status_code == 201, resp.text
            sandbox_id = resp.json()["sandboxID"]
        server.kill_hard()
        server = start_server(data, api_key=server.api_key)
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
            assert client.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
            envd = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
            assert client.get("/health", headers=envd).status_code == 204  # envd over its network
            assert client.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        print(f"ok: {sandbox_id} created, re-attached after kill -9, killed")
    finally:
        server.kill_all_sandboxes()
        server.stop()
        remove_data_dir(data)


def test_a_node_runs_with_dockers_default_capabilities_plus_three() -> None:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    child = constrained([sys.executable, "-m", "tests.system.test_deploy_privileges"])
    result = subprocess.run(child, cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: " in result.stdout
    assert wait_no_host_resources(result.stdout.split("ok: ")[1].split()[0]) == []


if __name__ == "__main__":
    status = Path("/proc/self/status").read_text()
    assert "NoNewPrivs:\t1" in status, "run me through the test, under setpriv"
    scenario()
