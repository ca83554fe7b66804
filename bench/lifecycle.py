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
from pathlib import Path
from typing import Any

from bench.harness import stats, write_result

FORK_COUNT = 16


def _sdk(server_url: str, api_key: str) -> dict[str, str]:
    return {"api_key": api_key, "api_url": server_url, "sandbox_url": server_url}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


POOLED = " ready in "


def _wait_pool(server_log: Path | None, ready_lines: int, limit: float = 60.0) -> None:
    """Wait until the server logged ``ready_lines`` warm-pool sandboxes in all."""
    if server_log is None:
        return
    deadline = time.monotonic() + limit
    while server_log.read_text(errors="replace").count(POOLED) < ready_lines:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not refill within 60 s")
        time.sleep(0.05)


def _cold_baseline(runs: int) -> list[float]:
    """Cold create → first command on a server without template snapshots (a real boot)."""
    from e2b import Sandbox

    from bench.harness import serve

    samples = []
    with serve(extra_env={"AGENTENV_TEMPLATE_SNAPSHOTS": "false"}) as cold:
        opts = _sdk(cold.url, cold.api_key)
        for _ in range(runs):
            start = time.perf_counter()
            sbx = Sandbox.create("base", timeout=300, **opts)  # type: ignore[arg-type]
            sbx.commands.run("true")
            samples.append(time.perf_counter() - start)
            sbx.kill()
    return samples


def run(server_url: str, api_key: str, runs: int, server_log: Path | None = None) -> dict[str, Any]:
    """``server_log``: the server's log file, to wait for its warm pool between pooled creates."""
    from e2b import Sandbox

    opts = _sdk(server_url, api_key)
    samples: dict[str, list[float]] = {
        "cold_create_to_first_command": _cold_baseline(runs),
        "template_create_warm_pool_to_first_command": [],
        "template_create_to_first_command": [],
        "create_from_snapshot_to_first_command": [],
        "pause": [],
        "resume_to_first_command": [],
        "snapshot_after_100mib_write": [],
        "fork16_to_all_answering": [],
    }
    errors: list[str] = []
    pooled = 0

    # Creates from the template: with a log to watch, each one finds a full warm pool.
    for _ in range(runs):
        _wait_pool(server_log, pooled + 1)  # at least one ready sandbox not yet claimed
        start = time.perf_counter()
        sbx = Sandbox.create("base", timeout=300, **opts)  # type: ignore[arg-type]
        sbx.commands.run("true")
        key = "template_create_to_first_command"
        if server_log is not None:
            key = "template_create_warm_pool_to_first_command"
        samples[key].append(time.perf_counter() - start)
        sbx.kill()
        pooled += 1

    # A parent with a running process and a file: the state the lifecycle copies around.
    parent = Sandbox.create("base", timeout=3600, **opts)  # type: ignore[arg-type]
    try:
        parent.commands.run("nohup sh -c 'while true; do sleep 1; done' >/dev/null 2>&1 &")
        parent.files.write("/home/user/state.txt", "bench")
        snap = parent.create_snapshot()
        for _ in range(runs):
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
    summary = {name: stats(values) for name, values in samples.items() if values}
    return {
        "runs": runs,
        "stats": summary,
        "ratios_to_cold_p50": _ratios(summary),
        "errors": errors,
        "notes": "runtime gvisor (runsc 2022-12, ptrace); cold = a server without template snapshots; "
        "template creates claim a warm-pool sandbox (restored from the template's snapshot); "
        "fork runs limited by AGENTENV_BENCH_FORK_RUNS (default 3)",
    }


def _ratios(summary: dict[str, dict[str, float | int]]) -> dict[str, float]:
    """Each operation's p50 as a fraction of the cold create's p50 measured in the same run."""
    cold = float(summary["cold_create_to_first_command"]["p50_ms"])
    return {
        name: round(float(s["p50_ms"]) / cold, 4)
        for name, s in summary.items()
        if name != "cold_create_to_first_command" and "p50_ms" in s
    }


def main() -> None:
    """``python -m bench.lifecycle [runs]``: against E2B_API_URL, or a server of its own."""
    from bench.harness import serve

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    if os.environ.get("E2B_API_URL"):
        result = run(os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"], runs)
    else:
        with serve() as server:
            result = run(server.url, server.api_key, runs, server.log_path)
    path = write_result("lifecycle", result)
    print(json.dumps(result["stats"], indent=2), "\n->", path)


if __name__ == "__main__":
    main()
