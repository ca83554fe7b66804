"""WarmPool: watermarks, and refills that wait for a quiet moment after a claim."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from forkyard.orchestrator.pool import MAX_QUIET_WAITS, WarmPool
from forkyard.types import SandboxInstance


class Maker:
    """Makes pooled sandboxes and records when each make started."""

    def __init__(self) -> None:
        self.started: list[float] = []
        self.killed: list[str] = []

    async def make(self, key: str) -> SandboxInstance:
        self.started.append(time.monotonic())
        await asyncio.sleep(0)
        return SandboxInstance.placeholder(f"{key}-{len(self.started)}", "loopback")

    async def kill(self, instance: SandboxInstance) -> None:
        self.killed.append(instance.sandbox_id)


async def _until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_first_fill_starts_at_once_and_stops_at_high() -> None:
    maker = Maker()
    pool = WarmPool(1, 2, maker.make, maker.kill, quiet_seconds=10.0)
    began = time.monotonic()
    pool.fill("t")
    await _until(lambda: pool.ready("t") == 2)
    assert maker.started[0] - began < 0.5  # no claim yet: nothing to wait for
    await asyncio.sleep(0.05)
    assert len(maker.started) == 2
    await pool.close()
    assert sorted(maker.killed) == ["t-1", "t-2"]


async def test_refill_waits_until_no_claim_for_quiet_seconds() -> None:
    maker = Maker()
    quiet = 0.3
    pool = WarmPool(1, 2, maker.make, maker.kill, quiet_seconds=quiet)
    pool.fill("t")
    await _until(lambda: pool.ready("t") == 2)
    first = pool.take("t")
    assert first is not None and pool.ready("t") == 1  # above low: no refill
    await asyncio.sleep(0.1)
    claimed_at = time.monotonic()
    second = pool.take("t")  # empties the pool: a refill is due, after a quiet moment
    assert second is not None and second.sandbox_id != first.sandbox_id
    await asyncio.sleep(quiet / 2)
    assert len(maker.started) == 2, "the refill started while the claim was fresh"
    await _until(lambda: pool.ready("t") == 2)
    assert maker.started[2] - claimed_at >= quiet * 0.95
    await pool.close()


async def test_claims_that_never_stop_still_get_a_refill() -> None:
    maker = Maker()
    quiet = 0.05
    pool = WarmPool(1, 1, maker.make, maker.kill, quiet_seconds=quiet)
    pool.fill("t")
    await _until(lambda: pool.ready("t") == 1)
    began = time.monotonic()
    assert pool.take("t") is not None  # empties it
    while time.monotonic() - began < MAX_QUIET_WAITS * quiet * 3 and pool.ready("t") == 0:
        pool.take("t")  # a claim attempt on the empty pool is no claim
        pool._last_claim = time.monotonic()  # as if claims of another key kept coming
        await asyncio.sleep(quiet / 5)
    assert pool.ready("t") == 1, "a stream of claims starved the refill"
    assert maker.started[1] - began < MAX_QUIET_WAITS * quiet * 2
    await pool.close()


def test_bad_watermarks_are_refused() -> None:
    async def make(key: str) -> SandboxInstance:
        raise AssertionError

    async def kill(instance: SandboxInstance) -> None:
        raise AssertionError

    with pytest.raises(ValueError, match="watermarks"):
        WarmPool(3, 2, make, kill)


async def test_a_sandbox_made_while_its_pool_closes_is_killed() -> None:
    """A refill cancelled mid-make (shut-down) waits for the make and kills what it made: a
    sandbox left running after the server stopped is a leak no start-up of this data dir may
    ever clean."""
    made = asyncio.Event()
    killed: list[str] = []

    async def slow_make(key: str) -> SandboxInstance:
        await asyncio.sleep(0.2)
        made.set()
        return SandboxInstance.placeholder(f"{key}-slow", "loopback")

    async def kill(instance: SandboxInstance) -> None:
        killed.append(instance.sandbox_id)

    pool = WarmPool(1, 1, slow_make, kill)
    pool.fill("t")
    await asyncio.sleep(0.05)  # mid-make
    await pool.close()
    assert made.is_set() and killed == ["t-slow"]
