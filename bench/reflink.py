"""Reflink disk layers: time and disk cost of cloning sandbox disks from a 1 GiB base.

    .venv/bin/python -m bench.reflink [--runs 20] [--clones 100]

Uses a temporary data directory with its own loop-mounted XFS pool (this node's root is ext4),
removed afterwards. Writes bench/results/reflink.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.harness import stats, write_result
from forkyard.storage.reflink import ReflinkPool, clone_file, disk_usage_bytes

GIB = 1 << 30
MIB = 1 << 20


def _write_base(path: Path, size: int) -> None:
    chunk = os.urandom(MIB)
    with open(path, "wb") as f:
        for _ in range(size // MIB):
            f.write(chunk)
        os.fsync(f.fileno())


def run(runs: int, clones: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="aebench-reflink-") as tmp:
        pool = ReflinkPool(Path(tmp) / "data", pool_size=16 * GIB)
        started = time.perf_counter()
        pool.ensure()
        pool_setup_s = time.perf_counter() - started
        try:
            base = pool.root / "base.img"
            _write_base(base, GIB)
            batch_s: list[float] = []
            single_s: list[float] = []
            new_disk: list[int] = []
            for run_no in range(runs):
                os.sync()
                before = disk_usage_bytes(pool.root)
                t0 = time.perf_counter()
                for i in range(clones):
                    t1 = time.perf_counter()
                    clone_file(base, pool.root / f"r{run_no}" / f"sb{i}.img")
                    single_s.append(time.perf_counter() - t1)
                batch_s.append(time.perf_counter() - t0)
                os.sync()
                new_disk.append(disk_usage_bytes(pool.root) - before)
                pool.remove_tree(pool.root / f"r{run_no}")
        finally:
            pool.destroy()
    return {
        f"{clones} clones of 1 GiB": stats(batch_s),
        "one clone": stats(single_s),
        "max new disk per batch (MiB)": round(max(new_disk) / MIB, 3),
        "pool setup (s)": round(pool_setup_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reflink")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--clones", type=int, default=100)
    args = parser.parse_args()
    result = run(args.runs, args.clones)
    print(write_result("reflink", result))
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
