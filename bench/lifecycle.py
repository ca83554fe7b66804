"""Lifecycle benchmark: create-from-snapshot, pause, resume, incremental snapshot, fork 16.

Every figure sits next to the cold create (template boot) measured in the same run.
Called by ``python -m bench`` as ``run(server_url, api_key, runs)``; the result JSON is written
to ``bench/results/lifecycle.json`` by the caller (or by ``python -m bench.lifecycle``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.harness import stats, write_result

FORK_COUNT = 16


def _sdk(server_url: str, api_key: str) -> dict[str, str]:
    return {"api_key": api_key, "api_url": server_url, "sandbox_url": server_url}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(server_url: str, api_key: str, runs: int) -> dict[str, Any]:
    from e2b import Sandbox

    opts = _sdk(server_url, api_key)
    samples: dict[str, list[float]] = {
        "cold_create_to_first_command": [], "create_from_snapshot_to_first_command": [],
        "pause": [], "resume_to_first_command": [], "snapshot_after_100mib_write": [],
        "fork16_to_all_answering": [],
    }
    errors: list[str] = []

    def cold() -> None:
        sbx = Sandbox.create("base", timeout=300, **opts)  # type: ignore[arg-type]
        sbx.commands.run("true")
        sbx.kill()

    # A parent with a running process and a file: the state the lifecycle copies around.
    parent = Sandbox.create("base", timeout=3600, **opts)  # type: ignore[arg-type]
    try:
        parent.commands.run("nohup sh -c 'while true; do sleep 1; done' >/dev/null 2>&1 &")
        parent.files.write("/home/user/state.txt", "bench")
        snap = parent.create_snapshot()
        for _ in range(runs):
            start = time.perf_counter()
            cold()
            samples["cold_create_to_first_command"].append(time.perf_counter() - start)

            start = time.perf_counter()
            child = Sandbox.create(snap.snapshot_id, timeout=300, **opts)  # type: ignore[arg-type]
            child.commands.run("true")
            samples["create_from_snapshot_to_first_command"].append(time.perf_counter() - start)

            samples["pause"].append(_timed(child.pause))
            start = time.perf_counter()
            resumed = Sandbox.connect(child.sandbox_id, timeout=300, **opts)  # type: ignore[arg-type,call-overload]
            resumed.commands.run("true")
            samples["resume_to_first_command"].append(time.perf_counter() - start)

            resumed.commands.run("head -c 104857600 /dev/urandom > /home/user/blob")
            def snapshot_and_drop(sbx: Any = resumed) -> None:
                info = sbx.create_snapshot()
                Sandbox.delete_snapshot(info.snapshot_id, **opts)  # type: ignore[arg-type]

            samples["snapshot_after_100mib_write"].append(_timed(snapshot_and_drop))
            resumed.kill()
        fork_runs = max(1, min(runs, int(os.environ.get("AGENTENV_BENCH_FORK_RUNS", "3"))))
        for _ in range(fork_runs):
            start = time.perf_counter()
            results = parent.fork(count=FORK_COUNT, timeout=300)
            children = [c for c in results if isinstance(c, Sandbox)]
            errors += [str(e) for e in results if not isinstance(e, Sandbox)]
            for c in children:
                c.commands.run("true")
            if len(children) == FORK_COUNT:
                samples["fork16_to_all_answering"].append(time.perf_counter() - start)
            for c in children:
                c.kill()
        Sandbox.delete_snapshot(snap.snapshot_id, **opts)  # type: ignore[arg-type]
    finally:
        parent.kill()
    return {
        "runs": runs,
        "stats": {name: stats(values) for name, values in samples.items()},
        "errors": errors,
        "notes": "runtime gvisor (runsc 2022-12, ptrace); fork runs limited by AGENTENV_BENCH_FORK_RUNS "
                 "(default 3) because one fork 16 takes tens of seconds on this runsc",
    }


def main() -> None:
    """``python -m bench.lifecycle [runs]``: against E2B_API_URL, or a server of its own."""
    from bench.harness import serve

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    if os.environ.get("E2B_API_URL"):
        result = run(os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"], runs)
    else:
        with serve() as server:
            result = run(server.url, server.api_key, runs)
    path = write_result("lifecycle", result)
    print(json.dumps(result["stats"], indent=2), "\n->", path)


if __name__ == "__main__":
    main()
