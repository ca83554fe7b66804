"""Per-sandbox network setup/teardown (netns, veth, iptables) without any runtime.

    .venv/bin/python -m bench.network [--runs 5] [--count 16]

Each run sets up and tears down ``count`` networks one after the other, then ``count`` at once
(``asyncio.gather``, as fork children restore). Uses a throw-away data directory and its own
subnet; needs root. Writes bench/results/network.json with per-call and per-batch latencies and
the number of processes one setup and one teardown start.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from bench.harness import stats, write_result
from forkyard.config import Settings
from forkyard.runtime import network

SUBNET = "10.214.240.0/20"
T = TypeVar("T")


@contextmanager
def count_processes() -> Iterator[list[int]]:
    """Counts every process started through subprocess (asyncio's subprocesses included)."""
    counter = [0]
    original = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def counting(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return original(self, *args, **kwargs)

    subprocess.Popen._execute_child = counting  # type: ignore[attr-defined]
    try:
        yield counter
    finally:
        subprocess.Popen._execute_child = original  # type: ignore[attr-defined]


async def _timed(samples: list[float], step: Awaitable[T]) -> T:
    start = time.perf_counter()
    result = await step
    samples.append(time.perf_counter() - start)
    return result


async def run(runs: int, count: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="aebench-net-") as tmp:
        settings = Settings(data_dir=Path(tmp), sandbox_subnet=SUBNET)
        await network.ensure_chains()
        # One warm-up network, so the counts below describe a steady state.
        warm = f"bw{uuid.uuid4().hex[:10]}"
        await network.teardown_network(
            settings, warm, await network.setup_network(settings, warm, allow_internet_access=True)
        )
        with count_processes() as started:
            sid = f"bc{uuid.uuid4().hex[:10]}"
            net = await network.setup_network(settings, sid, allow_internet_access=True)
            setup_procs = started[0]
            await network.teardown_network(settings, sid, net)
            teardown_procs = started[0] - setup_procs

        seq_setup: list[float] = []
        seq_teardown: list[float] = []
        par_setup: list[float] = []
        par_teardown: list[float] = []
        seq_setup_batch: list[float] = []
        seq_teardown_batch: list[float] = []
        par_setup_batch: list[float] = []
        par_teardown_batch: list[float] = []
        try:
            for _ in range(runs):
                ids = [f"bs{uuid.uuid4().hex[:10]}" for _ in range(count)]
                nets = []
                start = time.perf_counter()
                for i, sid in enumerate(ids):
                    nets.append(
                        await _timed(
                            seq_setup, network.setup_network(settings, sid, allow_internet_access=i % 2 == 0)
                        )
                    )
                seq_setup_batch.append(time.perf_counter() - start)
                start = time.perf_counter()
                for net in nets:
                    await _timed(seq_teardown, network.teardown_network(settings, net.sandbox_id, net))
                seq_teardown_batch.append(time.perf_counter() - start)

                ids = [f"bp{uuid.uuid4().hex[:10]}" for _ in range(count)]
                start = time.perf_counter()
                nets = list(
                    await asyncio.gather(
                        *(
                            _timed(
                                par_setup,
                                network.setup_network(settings, sid, allow_internet_access=i % 2 == 0),
                            )
                            for i, sid in enumerate(ids)
                        )
                    )
                )
                par_setup_batch.append(time.perf_counter() - start)
                start = time.perf_counter()
                await asyncio.gather(
                    *(
                        _timed(par_teardown, network.teardown_network(settings, net.sandbox_id, net))
                        for net in nets
                    )
                )
                par_teardown_batch.append(time.perf_counter() - start)
        finally:
            await network.cleanup_orphans(settings, set())
    return {
        "processes per setup": setup_procs,
        "processes per teardown": teardown_procs,
        "sequential": {
            "setup": stats(seq_setup),
            "teardown": stats(seq_teardown),
            f"{count} setups": stats(seq_setup_batch),
            f"{count} teardowns": stats(seq_teardown_batch),
        },
        f"{count} concurrent": {
            "setup": stats(par_setup),
            "teardown": stats(par_teardown),
            f"{count} setups": stats(par_setup_batch),
            f"{count} teardowns": stats(par_teardown_batch),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.network")
    parser.add_argument("--runs", type=int, default=5, help="batches of --count networks")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    result = asyncio.run(run(args.runs, args.count))
    if not args.no_write:
        print(write_result("network", result))
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
