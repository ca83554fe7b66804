"""A cluster on this machine for the cluster tests and benchmarks: one ``forkyard gateway`` and two
``forkyard node serve`` processes (own data dirs, subnets, ports) on one registry database and one
S3 bucket (docs/CLUSTER.md).

    with postgres_cluster() as pg, s3_server() as s3, run_cluster(pg.new_database(), s3) as cluster:
        Sandbox.create(**cluster.sdk)

No pytest here: bench/ imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tests.support import REPO, SHARED_TEMPLATES, free_port
from tests.support.s3 import S3Server
from tests.support.server import TEST_DEFAULTS, remove_data_dir

SECRET = "cluster-test-secret-0123456789abcdef"
API_KEY = "e2b_cluster_test_key"
#: Small, so the loss of node a shows within seconds.
HEARTBEAT_S = 0.5
LOST_AFTER_S = 3.0
SUBNETS = {"node-a": "10.217.0.0/20", "node-b": "10.217.16.0/20"}
READY_S = 120.0


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.argv, "--port", str(self.port)],
                env=self.env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + READY_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 204:
                    return
            assert time.monotonic() < deadline, f"{self.name} not ready:\n{self.log_tail()}"
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


@dataclass
class Cluster:
    database_url: str
    gateway: Proc
    nodes: dict[str, Proc]
    data_dirs: list[Path] = field(default_factory=list)

    @property
    def sdk(self) -> dict[str, str]:
        return {"api_key": API_KEY, "api_url": self.gateway.url, "sandbox_url": self.gateway.url}

    def rows(self, sql: str, **params: Any) -> list[Any]:
        async def query() -> list[Any]:
            engine = create_async_engine(self.database_url)
            try:
                async with engine.connect() as conn:
                    return list((await conn.execute(text(sql), params)).all())
            finally:
                await engine.dispose()

        return asyncio.run(query())

    def owner(self, sandbox_id: str) -> str:
        found = self.rows("SELECT node_id FROM sandboxes WHERE sandbox_id = :s", s=sandbox_id)
        assert found, f"{sandbox_id} has no registry row"
        return str(found[0][0])


def _env(
    data_dir: Path, database_url: str, extra: Mapping[str, str], defaults: Mapping[str, str] = TEST_DEFAULTS
) -> dict[str, str]:
    return {
        **os.environ,
        **defaults,
        "FORKYARD_DATA_DIR": str(data_dir),
        "FORKYARD_TEMPLATES_PATH": str(SHARED_TEMPLATES),
        "FORKYARD_DATABASE_URL": database_url,
        "FORKYARD_NODE_SECRETS": json.dumps([SECRET]),
        "FORKYARD_API_KEYS": json.dumps([API_KEY]),
        "FORKYARD_NODE_HEARTBEAT_SECONDS": str(HEARTBEAT_S),
        "FORKYARD_NODE_LOST_AFTER_SECONDS": str(LOST_AFTER_S),
        "FORKYARD_SNAPSHOT_STANDBYS": "0",
        **extra,
    }


def gateway_proc(database_url: str, port: int, data_dir: Path) -> Proc:
    argv = [sys.executable, "-m", "forkyard.cli.main", "gateway"]
    return Proc("gateway", argv, _env(data_dir, database_url, {}), port, data_dir / f"gateway-{port}.log")


@contextlib.contextmanager
def run_cluster(
    database_url: str,
    s3: S3Server | None,
    defaults: Mapping[str, str] = TEST_DEFAULTS,
    node_env: Mapping[str, Mapping[str, str]] | None = None,
    gc_grace_seconds: str = "600",
    node_names: tuple[str, ...] = tuple(SUBNETS),
) -> Iterator[Cluster]:
    """Two nodes and a gateway on ``database_url`` and a new bucket of ``s3`` (``node_env``: more
        variables per node name, e.g. ``{"node-a": {"FORKYARD_MAX_SANDBOXES": "2"}}``; the store's sweep
    grace is the product's 600 s: with 0 a sweep on one node can take a chunk that an upload on the
        other is about to name, which no grace-free protocol on S3 prevents); on the way out
        (after a failure too) dead nodes are started again (their recovery cleans up), every listed
        sandbox killed, everything stopped and the data dirs removed. ``s3`` None: no snapshot
        store; ``node_names``: fewer nodes (of ``SUBNETS``)."""
    s3_env = (
        {}
        if s3 is None
        else s3.forkyard_env(s3.new_bucket(), gc_grace_seconds=gc_grace_seconds, upload_templates="false")
    )
    gateway_dir = Path(tempfile.mkdtemp(prefix="ae-gw-", dir="/tmp"))
    nodes: dict[str, Proc] = {}
    for name in node_names:
        subnet = SUBNETS[name]
        data_dir = Path(tempfile.mkdtemp(prefix=f"ae-{name[-1]}-", dir="/tmp"))
        port = free_port()
        extra = {
            **s3_env,
            "FORKYARD_NODE_ID": name,
            "FORKYARD_SANDBOX_SUBNET": subnet,
            "FORKYARD_NODE_URL": f"http://127.0.0.1:{port}",
            **(node_env or {}).get(name, {}),
        }
        argv = [sys.executable, "-m", "forkyard.cli.main", "node", "serve"]
        nodes[name] = Proc(
            name, argv, _env(data_dir, database_url, extra, defaults), port, data_dir / f"{name}.log"
        )
    cluster = Cluster(database_url, gateway_proc(database_url, free_port(), gateway_dir), nodes)
    cluster.data_dirs = [gateway_dir, *(Path(p.env["FORKYARD_DATA_DIR"]) for p in nodes.values())]
    try:
        for node in nodes.values():
            node.start()
        cluster.gateway.start()
        yield cluster
    finally:
        for node in nodes.values():  # a node killed by a failed test: its recovery cleans up
            if node.proc is not None and node.proc.poll() is not None:
                with contextlib.suppress(Exception):
                    node.start()
        with contextlib.suppress(Exception):
            for info in Sandbox.list(**cluster.sdk).next_items():
                with contextlib.suppress(Exception):
                    Sandbox.kill(info.sandbox_id, **cluster.sdk)
        cluster.gateway.stop()
        for node in nodes.values():
            node.stop()
        for data_dir in cluster.data_dirs:
            remove_data_dir(data_dir)
