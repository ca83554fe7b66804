"""Garbage collection has one owner: whoever frees something notifies it and goes on; it runs
in the background and serves a burst of notices with one more run, not one run each."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from forkyard.orchestrator.background import Background
from forkyard.orchestrator.garbage import GarbageCollector

pytestmark = pytest.mark.asyncio(loop_scope="session")
FORKYARD = Path(__file__).resolve().parents[2] / "forkyard"


class Collection:
    """A collection that holds until released, counting its runs."""

    def __init__(self, fail: bool = False) -> None:
        self.runs = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.fail = fail

    async def __call__(self) -> None:
        self.runs += 1
        self.started.set()
        await self.release.wait()
        if self.fail:
            raise RuntimeError("collection failed")


async def test_notices_during_a_run_are_served_by_one_more_run() -> None:
    collection = Collection()
    garbage = GarbageCollector(collection, Background())
    garbage.notify()
    await collection.started.wait()
    for _ in range(10):  # a burst of kills and deletes while the first run holds
        garbage.notify()
    collection.release.set()
    await garbage.settled()
    assert collection.runs == 2


async def test_collect_waits_for_a_run_that_started_after_it() -> None:
    collection = Collection()
    garbage = GarbageCollector(collection, Background())
    garbage.notify()
    await collection.started.wait()
    waiter = asyncio.ensure_future(garbage.collect())
    await asyncio.sleep(0)
    assert not waiter.done()
    collection.release.set()
    await waiter
    assert collection.runs == 2  # the run under way when it was called does not count


async def test_a_failed_run_fails_no_caller_and_the_next_notice_runs_again() -> None:
    collection = Collection(fail=True)
    collection.release.set()
    garbage = GarbageCollector(collection, Background())
    await garbage.collect()
    await garbage.collect()
    assert collection.runs == 2


async def test_settled_with_nothing_notified_returns_at_once() -> None:
    collection = Collection()
    await GarbageCollector(collection, Background()).settled()
    assert collection.runs == 0


async def test_nobody_but_the_collector_calls_the_collection() -> None:
    """No module calls the catalog's collection by hand (eight places did): they notify, or await
    ``GarbageCollector.collect``. Only the composition root hands the collection to the collector."""
    callers = [
        f"{path.relative_to(FORKYARD)}:{n}"
        for path in sorted(FORKYARD.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"catalog\.collect_garbage\b", line) and "GarbageCollector(" not in line
    ]
    assert callers == []
