"""A real S3-protocol server for the snapshot store tests and benchmarks: moto's server mode
(``moto[server]``, pinned in the ``test`` extra) as a process on a free loopback port.

    with s3_server() as s3:
        bucket = s3.new_bucket()
        env = s3.forkyard_env(bucket)      # FORKYARD_S3__* for an ``forkyard serve``

No pytest here: bench/ imports this module.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support import free_port

ACCESS_KEY = "forkyard-test"
SECRET_KEY = "forkyard-test-secret"
REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )

    def new_bucket(self) -> str:
        name = "ae-" + secrets.token_hex(6)
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key of the bucket under ``prefix`` (the store's own prefix included)."""
        client = self.client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [obj["Key"] for obj in page.get("Contents", [])]
        return keys

    def forkyard_env(self, bucket: str, **extra: str) -> dict[str, str]:
        """The ``FORKYARD_S3__*`` settings of a server using ``bucket`` on this server."""
        return {
            "FORKYARD_S3__BUCKET": bucket,
            "FORKYARD_S3__ENDPOINT_URL": self.endpoint,
            "FORKYARD_S3__REGION": REGION,
            "FORKYARD_S3__ACCESS_KEY_ID": ACCESS_KEY,
            "FORKYARD_S3__SECRET_ACCESS_KEY": SECRET_KEY,
            **{f"FORKYARD_S3__{k.upper()}": v for k, v in extra.items()},
        }

    def settings(self, bucket: str, **extra: Any) -> Any:
        from forkyard.config import S3Settings

        return S3Settings(
            bucket=bucket,
            endpoint_url=self.endpoint,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            **extra,
        )

    def stop(self) -> None:
        """Stop the server (an outage of the store: its in-memory buckets go with it)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def start(self, ready_timeout: float = 30.0) -> None:
        """Start it again on the same port (empty: buckets must be made again)."""
        port = int(self.endpoint.rsplit(":", 1)[1])
        self.proc = _spawn(port, self.log_path)
        _wait_ready(self, ready_timeout)


def _spawn(port: int, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait_ready(server: S3Server, ready_timeout: float) -> None:
    deadline = time.monotonic() + ready_timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"moto server exited ({server.proc.returncode}): {server.log_path.read_text()}"
            )
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(server.endpoint + "/moto-api/", timeout=1).status_code < 500:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"moto server not ready in {ready_timeout} s")
        time.sleep(0.1)


@contextlib.contextmanager
def s3_server(ready_timeout: float = 30.0) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1; stopped (and its in-memory buckets gone) afterwards."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="ae-moto-", suffix=".log", delete=False)
    log.close()
    log_path = Path(log.name)
    server = S3Server(f"http://127.0.0.1:{port}", _spawn(port, log_path), log_path)
    try:
        _wait_ready(server, ready_timeout)
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()
        log_path.unlink(missing_ok=True)
