"""The registry's cost on the lifecycle's hot path: what every state transition writes.

    .venv/bin/python -m bench.registry [--runs 300] [--label after] [--postgres]

Two loops, on SQLite in a temporary directory (``--postgres``: also on a throwaway PostgreSQL
cluster, tests/support/postgres.py):

* ``store``: the registry writes of one sandbox's create→kill (insert as ``creating``, save as
  ``running``, two log lines, save as ``killing``, save as ``killed``), straight on the store;
* ``orchestrator``: ``create`` then ``kill`` through the lifecycle owner on the loopback runtime
  (a real HTTP server per sandbox), the registry included.

Writes bench/results/registry-<label>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import tempfile
import time
import uuid
from pathlib import Path

from bench.harness import stats, write_result
from forkyard.config import Settings
from forkyard.orchestrator.lifecycle import CreateRequest, build_orchestrator
from forkyard.orchestrator.store import NetworkPolicy, SandboxRecord, SandboxStore
from forkyard.types import SandboxState
from tests.support.loopback import LoopbackRuntime, write_template


def _record() -> SandboxRecord:
    now = dt.datetime.now(dt.UTC)
    return SandboxRecord(
        sandbox_id=uuid.uuid4().hex[:20],
        template_id="base",
        client_id="bench",
        state=SandboxState.CREATING,
        started_at=now,
        end_at=now + dt.timedelta(seconds=300),
        cpu_count=1,
        memory_mb=512,
        disk_mb=1024,
        runtime="loopback",
        envd_version="0.1.0",
        metadata={"k": "v"},
    )


async def _store_loop(store: SandboxStore, runs: int) -> list[float]:
    samples: list[float] = []
    for _ in range(runs):
        rec = _record()
        started = time.perf_counter()
        await store.insert(rec)
        rec.state = SandboxState.RUNNING
        await store.save(rec)
        await store.add_log(rec.sandbox_id, "info", "sandbox created")
        await store.add_logs(rec.sandbox_id, [("info", "envd up", {"port": "49983"})])
        for state in (SandboxState.KILLING, SandboxState.KILLED):
            rec.state = state
            await store.save(rec)
        samples.append(time.perf_counter() - started)
    return samples


def _store_for(tmp: Path, url: str) -> SandboxStore:
    return SandboxStore.from_settings(Settings(data_dir=tmp / "data", database_url=url))


async def _orchestrator_loop(tmp: Path, runs: int, url: str) -> list[float]:
    write_template(tmp / "templates")
    config = Settings(
        data_dir=tmp / "orch",
        templates_path=tmp / "templates",
        template_snapshots=False,
        warm_pool_high=0,
        database_url=url,
    )
    runtime = LoopbackRuntime(config)
    orch = build_orchestrator(config, runtime)
    await orch.start()
    request = CreateRequest(
        template_id="base",
        timeout_seconds=60,
        metadata={},
        envs={},
        secure=False,
        network=NetworkPolicy(allow_internet_access=True),
    )
    samples: list[float] = []
    try:
        for _ in range(runs):
            started = time.perf_counter()
            rec = await orch.create(request)
            await orch.kill(rec.sandbox_id)
            samples.append(time.perf_counter() - started)
    finally:
        await orch.close()
        await runtime.close()
    return samples


async def _measure(runs: int, url: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="aebench-registry-") as name:
        tmp = Path(name)
        store = _store_for(tmp, url)
        await store.open()
        try:
            await _store_loop(store, 20)  # warm caches (statement compilation, pages)
            store_samples = await _store_loop(store, runs)
        finally:
            await store.close()
        orch_samples = await _orchestrator_loop(tmp, runs, url)
    return {"store_create_to_kill": stats(store_samples), "orchestrator_create_kill": stats(orch_samples)}


def run(runs: int, postgres: bool) -> dict[str, object]:
    out: dict[str, object] = {"runs": runs, "sqlite": asyncio.run(_measure(runs, ""))}
    if postgres:
        from tests.support.postgres import postgres_cluster

        with postgres_cluster(durable=True) as pg:
            out["postgresql"] = asyncio.run(_measure(runs, pg.new_database()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--label", default="current")
    parser.add_argument("--postgres", action="store_true")
    args = parser.parse_args()
    result = run(args.runs, args.postgres)
    print(write_result(f"registry-{args.label}", result))
    print(result)


if __name__ == "__main__":
    main()
