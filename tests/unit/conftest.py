"""Unit-test fixtures: every test is checked for fds it left watched in the session's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import pytest_asyncio

from tests.support.loops import drop_unwatched_fds


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def session_loop() -> asyncio.AbstractEventLoop:
    """The loop the session-scoped tests and fixtures share (pyproject.toml's default fixture
    loop scope)."""
    return asyncio.get_running_loop()


@pytest.fixture(autouse=True)
def no_unwatched_fds(session_loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Fails the test that closed an fd under the session loop's selector (tests/support/loops.py):
    left there, it makes whichever socket of a later test gets the number deaf, a timeout far from
    its cause. The keys are dropped, so only this test fails."""
    yield
    left = drop_unwatched_fds(session_loop)
    if left:
        pytest.fail(f"closed while the session's event loop still watched them (fd: callbacks): {left}")
