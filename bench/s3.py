"""Snapshots in S3: create from a snapshot on the node that has it cached vs on a node that must
fetch it from S3 (p50/p95), and the upload time per snapshot.

    .venv/bin/python -m bench.s3 [--runs 20]        (or: python -m bench --only s3)

Two real ``forkyard serve`` processes share one bucket of moto's S3 server (a process started
here; tests/support/s3.py): node *a* takes the snapshots (its copies stay cached), node *b* has
its own data dir and ``FORKYARD_S3__CACHE_MAX_MIB=1``, so every create there fetches the
snapshot (memory image and disk layers) from S3 and evicts it after the restore. Standbys are off
on both: every create is a restore. A fetched sample counts only when *b* listed the snapshot as
not cached right before it. Writes bench/results/s3.json.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import httpx
from e2b import Sandbox

from bench.harness import stats, write_result
from tests.support.s3 import s3_server
from tests.support.server import ServerProcess, serve

COMMON = {
    "FORKYARD_SNAPSHOT_STANDBYS": "0",
    "FORKYARD_WARM_POOL_HIGH": "0",
}


def storage_of(server: ServerProcess, snapshot_id: str) -> dict[str, Any] | None:
    listed = httpx.get(server.url + "/snapshots", headers=server.headers, timeout=30).json()
    found = [s.get("storage") for s in listed if s["snapshotID"] == snapshot_id]
    return found[0] if found else None


def wait_for(
    server: ServerProcess, snapshot_id: str, key: str, value: bool, timeout: float = 120
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        storage = storage_of(server, snapshot_id)
        if storage is not None and storage.get(key) is value:
            return storage
        if storage is not None and storage.get("state") == "failed":
            raise RuntimeError(f"upload of {snapshot_id} failed: {storage}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"snapshot {snapshot_id}: {key} never became {value} ({storage})")
        time.sleep(0.1)


def create_to_first_command(server: ServerProcess, snapshot_id: str) -> float:
    start = time.perf_counter()
    sbx = Sandbox.create(snapshot_id, timeout=120, **server.sdk_opts)
    sbx.commands.run("true")
    elapsed = time.perf_counter() - start
    sbx.kill()
    return elapsed


FETCH_LINE = re.compile(r"fetched snapshot \S+ from the snapshot store: (\d+) bytes")
DURABLE_LINE = re.compile(r"is durable: (\d+) chunks sent \((\d+) bytes\), (\d+) reused")


def upload_chunks(log: str) -> dict[str, int]:
    """Chunks sent vs reused (deduplicated) over the node's uploads, from its log lines."""
    found = [tuple(int(x) for x in m.groups()) for m in DURABLE_LINE.finditer(log)]
    return {
        "uploads": len(found),
        "chunks_sent": sum(f[0] for f in found),
        "bytes_sent": sum(f[1] for f in found),
        "chunks_reused": sum(f[2] for f in found),
    }


def run(runs: int, chunk_mib: int = 8) -> dict[str, object]:
    with s3_server() as s3:
        bucket = s3.new_bucket()
        # Templates are shared by path here (one machine): only snapshots travel through S3.
        env = {**COMMON, **s3.forkyard_env(bucket, upload_templates="false", chunk_mib=str(chunk_mib))}
        with (
            serve(prefix="ae-bs3a-", extra_env={**env, "FORKYARD_SANDBOX_SUBNET": "10.216.0.0/20"}) as a,
            serve(
                prefix="ae-bs3b-",
                extra_env={
                    **env,
                    "FORKYARD_SANDBOX_SUBNET": "10.216.16.0/20",
                    "FORKYARD_S3__CACHE_MAX_MIB": "1",
                },
            ) as b,
        ):
            sbx = Sandbox.create(timeout=600, **a.sdk_opts)
            sbx.commands.run("head -c 8M /dev/urandom > /home/user/blob && sh -c 'sleep 100000 &'")
            uploads: list[float] = []
            snapshot_ids: list[str] = []
            for i in range(runs):  # one incremental snapshot per run, 1 MiB written before each
                sbx.commands.run(f"head -c 1M /dev/urandom > /home/user/step-{i}")
                sid = sbx.create_snapshot().snapshot_id
                snapshot_ids.append(sid)
                uploads.append(float(wait_for(a, sid, "durable", True)["uploadMs"]) / 1000)
            sbx.kill()
            target = snapshot_ids[-1]
            cached = [create_to_first_command(a, target) for _ in range(runs)]
            fetched: list[float] = []
            for _ in range(runs):
                storage = storage_of(b, target)
                if storage is not None:
                    wait_for(b, target, "cached", False)
                fetched.append(create_to_first_command(b, target))
            fetched_bytes = [int(n) for n in FETCH_LINE.findall(b.log_path.read_text())]
            dedupe = upload_chunks(a.log_path.read_text())
            objects = len(s3.keys(bucket))
    return {
        "create_from_snapshot_to_first_command": {"cached": stats(cached), "fetched_from_s3": stats(fetched)},
        "upload_per_snapshot": {
            "first (whole chain)": stats(uploads[:1]),
            "incremental (1 MiB written)": stats(uploads[1:]),
        },
        # Per run, in order: how long the fetched create took and how many bytes node b fetched.
        "fetched_samples_ms": [round(x * 1000, 1) for x in fetched],
        "fetched_bytes_per_fetch": fetched_bytes,
        "upload_chunks": dedupe,
        "objects_in_bucket": objects,
        "runs": runs,
        "chunk_mib": chunk_mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.s3")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--chunk-mib", type=int, default=8, help="FORKYARD_S3__CHUNK_MIB of both servers")
    parser.add_argument("--result", default="s3", help="name of the result file under bench/results/")
    args = parser.parse_args()
    print(write_result(args.result, run(args.runs, args.chunk_mib)))


if __name__ == "__main__":
    main()
