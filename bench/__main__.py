"""`make bench`: every benchmark against a real server, results in bench/results/*.json and a
summary table in bench/results/SUMMARY.md (copied into README between its bench markers)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import core
from bench.harness import REPO, RESULTS, serve, write_result


def _rows(prefix: str, data: object) -> list[str]:
    rows: list[str] = []
    if isinstance(data, dict):
        if "p50_ms" in data:
            cells = [data["n"], data["p50_ms"], data["p95_ms"], data["max_ms"]]
            rows.append(f"| {prefix} | " + " | ".join(str(c) for c in cells) + " |")
        else:
            for key, value in data.items():
                rows.extend(_rows(f"{prefix} / {key}" if prefix else key, value))
    return rows


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def target_table(lifecycle: dict[str, object]) -> list[str]:
    """The issue's targets: each operation's p50/p95/max beside its baseline, met or not."""
    rows = lifecycle.get("targets")
    if not isinstance(rows, list) or not rows:
        return []
    lines = [
        "| target row | target | n | p50 ms | p95 ms | max ms | baseline (same run) "
        "| baseline p50 ms | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        met = "**yes**" if row["met"] else "no"
        cells = [
            row["measurement"],
            row["target"],
            row["n"],
            row.get("p50_ms"),
            row.get("p95_ms"),
            row.get("max_ms"),
            row["baseline"],
            row.get("baseline_p50_ms"),
            f"{met} ({row['result']})" if "result" in row else met,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines.append(f"\nlifecycle targets met: **{lifecycle.get('targets_met', '-')}**")
    return lines


def density_table(density: dict[str, object]) -> list[str]:
    """Host memory per idle sandbox by state (p50 over the sandboxes) and disk per on-disk one."""
    states = [(s, density.get(s)) for s in ("running", "frozen", "disk")]
    if not all(isinstance(d, dict) for _, d in states):
        return []
    per_gib = density.get("idle_sandboxes_per_gib")
    per_gib = per_gib if isinstance(per_gib, dict) else {}
    lines = [
        "| density (idle sandbox) | sandboxes | PSS MiB p50 | RSS MiB p50 | cgroup MiB p50 "
        "| host processes | sandboxes per GiB (PSS) | disk MiB p50 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for state, data in states:
        assert isinstance(data, dict)
        disk = data.get("memory_image_mib", {}).get("p50", 0) if state == "disk" else 0
        cells = [
            state,
            data["pss_mib"].get("n"),
            data["pss_mib"].get("p50"),
            data["rss_mib"].get("p50"),
            data["cgroup_mib"].get("p50"),
            round(float(data["processes"].get("p50", 0))),
            per_gib.get(f"{state}_pss", "-"),
            disk,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


#: Keys the generic table leaves to the tables above.
TABLED = ("targets", "running", "frozen", "disk")


def summarise(results: dict[str, dict[str, object]]) -> str:
    lines: list[str] = []
    for special in (target_table(results.get("lifecycle", {})), density_table(results.get("density", {}))):
        if special:
            lines += [*special, ""]
    lines += ["| measurement | n | p50 ms | p95 ms | max ms |", "| --- | --- | --- | --- | --- |"]
    for name, payload in results.items():
        lines.extend(_rows(name, {k: v for k, v in payload.items() if k not in TABLED}))
    for name, payload in results.items():
        for key, value in payload.items():
            if not isinstance(value, dict | list):
                lines.append(f"\n{name} / {key}: **{value}**")
    return "\n".join(lines) + "\n"


def _measurements(payload: dict[str, object]) -> dict[str, object]:
    """A result file without its bookkeeping fields."""
    return {k: v for k, v in payload.items() if k not in ("benchmark", "recorded_at", "errors")}


def update_readme(summary: str) -> None:
    readme = REPO / "README.md"
    text = readme.read_text()
    pattern = re.compile(r"(<!-- bench:start -->\n).*?(<!-- bench:end -->)", re.S)
    if pattern.search(text):
        readme.write_text(pattern.sub(lambda m: m.group(1) + summary + m.group(2), text))


BENCHMARKS = (
    "core",
    "lifecycle",
    "sandbox_urls",
    "density",
    "runtimes",
    "microvm",
    "s3",
    "rl",
    "rl_swe",
    "fork_stream",
    "fork_cpu",
    "cluster",
    "fork_spill",
    "code_interpreter",
)


def _optional(name: str) -> object | None:
    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"bench.{name}":
            raise
        print(f"bench: {name} benchmark not present, skipped")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--runs", type=int, default=20, help="repetitions per measurement (>= 20 for p95)")
    parser.add_argument("--only", choices=BENCHMARKS, action="append")
    args = parser.parse_args()
    templates = Path(os.environ.get("FORKYARD_TEMPLATES_PATH", "/var/lib/forkyard/templates"))
    wanted = set(args.only or BENCHMARKS)
    results: dict[str, dict[str, object]] = {}
    failed: list[str] = []

    def attempt(name: str, measure: Callable[[], dict[str, object]]) -> None:
        """Run one benchmark and write its result; a failure is reported, the others still run
        and the summary is still written (``make bench`` exits non-zero at the end)."""
        try:
            results[name] = measure()
        except Exception:
            traceback.print_exc()
            print(f"bench: {name} failed; its previous result (if any) stays in the summary")
            failed.append(name)
            return
        write_result(name, results[name])

    # core and lifecycle share one server with production settings; lifecycle starts its cold and
    # disk servers itself, density and runtimes their own servers.
    if wanted & {"core", "lifecycle"}:
        with serve() as server:
            if "core" in wanted:
                attempt("core", lambda: core.run(server, args.runs, templates))
            if "lifecycle" in wanted:
                from bench import lifecycle

                attempt("lifecycle", lambda: lifecycle.run(server, args.runs))
    if "sandbox_urls" in wanted:
        from bench import sandbox_urls

        # envd calls over HTTP (E2B_SANDBOX_URL) vs HTTPS sandbox URLs (the SDK's default route).
        attempt("sandbox_urls", lambda: sandbox_urls.run(args.runs))
    if "density" in wanted:
        from bench import density

        attempt("density", lambda: density.run(args.runs))
    runtimes = _optional("runtimes") if "runtimes" in wanted else None
    if runtimes is not None:
        # runtimes starts a server per runtime: the URL and key arguments are not used.
        attempt("runtimes", lambda: runtimes.run("", "", args.runs))  # type: ignore[attr-defined]

    if "code_interpreter" in wanted:
        from bench import code_interpreter

        # E2B's code interpreter beside base, on its own server (both templates pooled).
        attempt("code_interpreter", lambda: code_interpreter.run(args.runs))
    if "microvm" in wanted:
        from bench import microvm

        # QEMU restore by mapped RAM vs streamed RAM, runtime level (its own data dir, no server).
        attempt("microvm", lambda: microvm.run(args.runs))

    if "s3" in wanted:
        from bench import s3

        attempt("s3", lambda: s3.run(args.runs))

    if "rl" in wanted:
        from bench import rl

        # rl starts its own server (production settings); its rollout count is its own setting.
        attempt("rl", lambda: rl.run(args.runs))
    if "rl_swe" in wanted:
        from bench import rl_swe

        # SWE-style rollouts (a repository, a wheelhouse install, patch + tests): fork vs fresh (issue 26).
        attempt("rl_swe", lambda: rl_swe.run(args.runs))
    if "fork_stream" in wanted:
        from bench import fork_stream

        # Fork 16 -> first / all answering: E2B's fork call against the streaming shapes (issue 26).
        attempt("fork_stream", lambda: fork_stream.run(args.runs))

    if "fork_cpu" in wanted:
        from bench import fork_cpu

        # Host CPU seconds and processes per forked child, by component (issue 26, part 3).
        attempt("fork_cpu", lambda: fork_cpu.run(args.runs))

    if "cluster" in wanted:
        from bench import cluster

        # A gateway and two nodes on PostgreSQL and moto S3: the gateway hop vs the node directly.
        attempt("cluster", lambda: cluster.run(max(args.runs, 100)))

    if "fork_spill" in wanted:
        from bench import fork_spill

        # A fork past the parent node's room: a local child vs one spilled to another node via S3.
        attempt("fork_spill", lambda: fork_spill.run(args.runs))

    # The summary covers every recorded benchmark, also those not re-run this time.
    recorded = {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}
    summary = summarise({name: _measurements(payload) for name, payload in recorded.items()})
    (RESULTS / "SUMMARY.md").write_text(summary)
    update_readme(summary)
    print(summary)
    print(json.dumps({k: str(RESULTS / f"{k}.json") for k in results}, indent=2))
    if failed:
        sys.exit(f"bench: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
