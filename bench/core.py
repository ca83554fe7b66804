"""Issue-2 benchmark: create-to-first-command, `commands.run` round trip and 1 MiB file
write/read through the official e2b SDK, for 1 and 16 concurrent sandboxes; issue 9's
`commands.run("echo hi")` round trip (docs/LATENCY.md).

Baseline measured in the same run: a cold `runsc run /bin/true` on the template's root file
system (the floor any gVisor sandbox pays, without envd or the API).

`python -m bench.core echo [--runs N]` measures only the `echo hi` row, against its own server."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness import ServerProcess, serve, stats, timed

ONE_MIB = os.urandom(1 << 20)


def runsc_cold_baseline(rootfs: Path, runs: int) -> list[float]:
    """Seconds for `runsc run` of /bin/true on a read-only rootfs, no network."""
    samples: list[float] = []
    with tempfile.TemporaryDirectory(prefix="forkyard-bench-runsc-") as tmp:
        bundle = Path(tmp)
        subprocess.run(["runsc", "spec", "--bundle", str(bundle), "--", "/bin/true"], check=True)
        spec = json.loads((bundle / "config.json").read_text())
        spec["root"] = {"path": str(rootfs), "readonly": True}
        spec["process"]["terminal"] = False
        (bundle / "config.json").write_text(json.dumps(spec))
        for _ in range(runs):
            cid = "ae-bench-" + uuid.uuid4().hex[:10]
            cmd = [
                "runsc",
                "--root",
                str(bundle / "state"),
                "--network=none",
                "run",
                "--bundle",
                str(bundle),
                cid,
            ]
            samples.append(timed(lambda c=cmd: subprocess.run(c, check=True, capture_output=True)))
    return samples


def one_sandbox_session(commands: int) -> dict[str, list[float]]:
    """Create, first command, `commands` round trips, 1 MiB write+read, kill; seconds each."""
    from e2b import Sandbox

    out: dict[str, list[float]] = {
        "create_to_first_command": [],
        "command_round_trip": [],
        "file_write_1mib": [],
        "file_read_1mib": [],
        "kill": [],
    }
    start = time.perf_counter()
    sandbox = Sandbox.create("base")
    try:
        result = sandbox.commands.run("echo ready")
        assert result.stdout.strip() == "ready", result
        out["create_to_first_command"].append(time.perf_counter() - start)
        for _ in range(commands):
            out["command_round_trip"].append(timed(lambda: sandbox.commands.run("true")))
        for i in range(3):
            out["file_write_1mib"].append(timed(lambda i=i: sandbox.files.write(f"/tmp/b{i}", ONE_MIB)))
            read_back: list[bytes] = []

            def read(p: str = f"/tmp/b{i}", sink: list[bytes] = read_back) -> None:
                sink.append(bytes(sandbox.files.read(p, format="bytes")))

            out["file_read_1mib"].append(timed(read))
            assert read_back[0] == ONE_MIB
    finally:
        out["kill"].append(timed(sandbox.kill))
    return out


def run_concurrency(concurrency: int, sessions: int, commands: int) -> dict[str, object]:
    merged: dict[str, list[float]] = {}
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for result in pool.map(lambda _: one_sandbox_session(commands), range(sessions)):
            for key, samples in result.items():
                merged.setdefault(key, []).extend(samples)
    return {key: stats(samples) for key, samples in merged.items()}


#: A server's first create boots, then makes the template's snapshot and fills the warm pool from
#: it; every claim refills the pool: `runsc` work on the same two cores, let it finish first.
SETTLE_SECONDS = 6.0


def echo_hi_round_trips(runs: int) -> dict[str, float | int]:
    """`commands.run("echo hi")` back to back on one settled sandbox: the SDK's Start stream
    through the proxy, envd, `bash -l -c "echo hi"` (issue 9: p50 < 30 ms)."""
    from e2b import Sandbox

    Sandbox.create("base").kill()  # the template snapshot and the warm pool come from here
    time.sleep(SETTLE_SECONDS)
    sandbox = Sandbox.create("base")
    try:
        assert sandbox.commands.run("echo hi").stdout == "hi\n"
        time.sleep(SETTLE_SECONDS)
        samples = [timed(lambda: sandbox.commands.run("echo hi")) for _ in range(max(runs, 20))]
    finally:
        sandbox.kill()
    return stats(samples)


def run(server: ServerProcess, runs: int, templates_dir: Path) -> dict[str, object]:
    os.environ.update(server.sdk_env)
    rootfs = templates_dir / "base" / "rootfs"
    baseline = stats(runsc_cold_baseline(rootfs, runs)) if shutil.which("runsc") else {"n": 0}
    echo_hi = echo_hi_round_trips(runs)
    single = run_concurrency(1, runs, commands=10)
    parallel = run_concurrency(16, 16, commands=10)
    ratio = None
    if baseline.get("n"):
        ratio = round(float(single["create_to_first_command"]["p50_ms"]) / float(baseline["p50_ms"]), 2)  # type: ignore[index]
    return {
        "baseline_runsc_cold_true": baseline,
        "echo_hi_round_trip": echo_hi,
        "concurrency_1": single,
        "concurrency_16": parallel,
        "create_p50_vs_runsc_cold_p50": ratio,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.core")
    parser.add_argument("only", choices=["echo"], help="the one measurement to run")
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    with serve() as server:
        os.environ.update(server.sdk_env)
        print(json.dumps({"echo_hi_round_trip": echo_hi_round_trips(args.runs)}, indent=2))


if __name__ == "__main__":
    main()
