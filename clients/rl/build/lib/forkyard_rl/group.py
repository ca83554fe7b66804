"""Groups: N sandboxes made at once, one action in all of them concurrently, killed on exit.

    async with await SandboxGroup.create("base", 16, lifetime=120) as group:
        results = await group.run("pytest -q", command_timeout=60)  # one RunResult per member

Every member is created with a server-side timeout (``lifetime``, E2B's ``timeout``): the backstop
that ends the sandboxes of a trainer that crashed before it could kill them. Members carry the
metadata ``forkyard_rl.group=<group id>``, so a restarted trainer can also kill a crashed run's
leftovers at once (:meth:`SandboxGroup.kill_leftovers`).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from forkyard_rl.actions import Action, RunResult, bounded, per_member, run_action
from forkyard_rl.api import Connection
from forkyard_rl.trajectory import Trajectory

if TYPE_CHECKING:
    from e2b import AsyncSandbox

T = TypeVar("T")

GROUP_METADATA_KEY = "forkyard_rl.group"
DEFAULT_CONCURRENCY = 8


class GroupError(Exception):
    """Some members could not be created; the ones that were have been killed."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__(f"{len(errors)} member(s) failed: {'; '.join(str(e) for e in errors[:3])}")
        self.errors = errors


async def kill_quietly(sandbox: AsyncSandbox) -> bool:
    """Kill ``sandbox``; False when it was gone already or the kill failed (it then ends by its
    server-side timeout)."""
    with contextlib.suppress(Exception):
        return bool(await sandbox.kill())
    return False


def retryable(exc: BaseException) -> bool:
    """Whether trying again may help: not after the server refused the request itself (a bad
    template, a bad argument, a bad key: the SDK's 4xx exceptions other than rate limiting)."""
    from e2b import (
        AuthenticationException,
        InvalidArgumentException,
        NotEnoughSpaceException,
        NotFoundException,
    )

    return not isinstance(
        exc, NotFoundException | InvalidArgumentException | AuthenticationException | NotEnoughSpaceException
    ) and not str(exc).startswith(("400", "401", "403", "404"))


class SandboxGroup:
    def __init__(
        self,
        members: Sequence[AsyncSandbox],
        *,
        group_id: str | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        trajectory: Trajectory | None = None,
    ) -> None:
        self.members = list(members)
        self.group_id = group_id or "grp" + secrets.token_hex(6)
        self.concurrency = concurrency
        self.trajectory = trajectory or Trajectory(f"group:{self.group_id}")

    @classmethod
    async def create(
        cls,
        template: str,
        n: int,
        *,
        lifetime: int = 300,
        concurrency: int = DEFAULT_CONCURRENCY,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        connection: Connection | None = None,
        group_id: str | None = None,
        retries: int = 1,
    ) -> SandboxGroup:
        """``n`` sandboxes of ``template`` (a template or a snapshot id), at most ``concurrency``
        created at a time. ``lifetime``: each member's server-side timeout in seconds. A failed
        create is tried again up to ``retries`` times (not one the server refused with a 4xx:
        that would fail again). All or nothing: when a member cannot be created the others are
        killed and :class:`GroupError` is raised."""
        from e2b import AsyncSandbox

        if n < 1:
            raise ValueError("a group needs at least one member")
        group_id = group_id or "grp" + secrets.token_hex(6)
        tags = {**(metadata or {}), GROUP_METADATA_KEY: group_id}
        opts = (connection or Connection()).opts()

        async def make() -> AsyncSandbox | BaseException:
            for attempt in range(retries + 1):
                try:
                    return await AsyncSandbox.create(
                        template, timeout=lifetime, metadata=tags, envs=envs, **opts
                    )
                except Exception as exc:
                    if attempt == retries or not retryable(exc):
                        return exc
            raise AssertionError("unreachable")

        made = await bounded(concurrency, [make] * n)
        members = [m for m in made if not isinstance(m, BaseException)]
        errors = [m for m in made if isinstance(m, BaseException)]
        if errors:
            await bounded(concurrency, [partial(kill_quietly, m) for m in members])
            raise GroupError(errors)
        return cls(members, group_id=group_id, concurrency=concurrency)

    # -- the members ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index: int) -> AsyncSandbox:
        return self.members[index]

    @property
    def sandbox_ids(self) -> list[str]:
        return [m.sandbox_id for m in self.members]

    async def map(self, fn: Callable[[int, AsyncSandbox], Awaitable[T]]) -> list[T]:
        """``fn(i, member)`` for every member, at most ``concurrency`` at a time."""
        return await bounded(self.concurrency, [partial(fn, i, m) for i, m in enumerate(self.members)])

    async def run(
        self,
        actions: Action | Sequence[Action] | Callable[[int], Action],
        *,
        command_timeout: float = 60.0,
    ) -> list[RunResult]:
        """Run an action in every member (the same one, one each, or ``actions(i)``) and return
        their results in member order; each is recorded in :attr:`trajectory`."""
        todo = per_member(actions, len(self.members))

        async def one(i: int, member: AsyncSandbox) -> RunResult:
            result = await run_action(member, todo[i], command_timeout=command_timeout)
            self.trajectory.record(str(i), todo[i], result)
            return result

        return await self.map(one)

    async def set_timeout(self, seconds: int) -> None:
        """Every member now expires ``seconds`` from now (a keep-alive for long batches)."""
        await self.map(lambda _, m: m.set_timeout(seconds))

    # -- the end -------------------------------------------------------------------------------

    async def kill(self) -> list[str]:
        """Kill every member; returns the ids that were killed (not already gone)."""
        killed = await self.map(lambda _, m: kill_quietly(m))
        ids = [m.sandbox_id for m, k in zip(self.members, killed, strict=True) if k]
        self.members = []
        return ids

    async def __aenter__(self) -> SandboxGroup:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.kill()

    @staticmethod
    async def kill_leftovers(group_id: str, connection: Connection | None = None) -> list[str]:
        """Kill the sandboxes a (crashed) group left, found by their metadata; returns their ids."""
        from e2b import AsyncSandbox, SandboxQuery

        opts = (connection or Connection()).opts()
        paginator = AsyncSandbox.list(query=SandboxQuery(metadata={GROUP_METADATA_KEY: group_id}), **opts)
        ids: list[str] = []
        while paginator.has_next:
            ids += [info.sandbox_id for info in await paginator.next_items()]
        for sandbox_id in ids:
            with contextlib.suppress(Exception):
                await AsyncSandbox.kill(sandbox_id, **opts)
        return ids
