"""Groups: N sandboxes made at once, one action in all of them concurrently, killed on exit.

    async with await SandboxGroup.create("base", 16, lifetime=120) as group:
        results = await group.run("pytest -q", command_timeout=60)  # one RunResult per member

    # From a stored snapshot in one call, or forked from a sandbox (running or paused), each
    # member's work starting the moment it is up (not when the last one is):
    group = await SandboxGroup.from_snapshot(snapshot_id, 16, each=rollout)   # rollout(i, member)
    group = await SandboxGroup.fork(parent, 16, each=rollout)
    group.each_results                                                      # rollout's, member order

Every member is created with a server-side timeout (``lifetime``, E2B's ``timeout``): the backstop
that ends the sandboxes of a trainer that crashed before it could kill them. Members carry the
metadata ``forkyard_rl.group=<group id>``, so a restarted trainer can also kill a crashed run's
leftovers at once (:meth:`SandboxGroup.kill_leftovers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from forkyard_rl.actions import Action, RunResult, bounded, per_member, run_action
from forkyard_rl.api import Connection
from forkyard_rl.stream import Started, fork_stream, from_snapshot
from forkyard_rl.trajectory import Trajectory

if TYPE_CHECKING:
    from e2b import AsyncSandbox

T = TypeVar("T")

#: ``each(i, sandbox)``: the work of member ``i`` (arrival order), started the moment it is up.
EachFn = Callable[[int, "AsyncSandbox"], Awaitable[Any]]

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


@dataclass
class Arrived:
    """What :func:`as_they_come` collected: members and their templates in arrival order, and
    ``each``'s result per member."""

    members: list[AsyncSandbox]
    template_ids: list[str | None]
    results: list[Any]


async def as_they_come(arrivals: AsyncIterator[Started], each: EachFn | None, *, concurrency: int) -> Arrived:
    """Take sandboxes as they come up and start ``each(i, sandbox)`` for every one at once (at
    most ``concurrency`` running). All or nothing: when a sandbox fails to come up, ``each`` is
    stopped everywhere, every member killed and :class:`GroupError` raised; so too (re-raised)
    when the caller is cancelled or the stream breaks. ``each``'s first error propagates once
    every ``each`` has ended."""
    gate = asyncio.Semaphore(concurrency)
    members: list[AsyncSandbox] = []
    templates: list[str | None] = []
    errors: list[BaseException] = []
    work: list[asyncio.Task[tuple[Any, BaseException | None]]] = []

    async def run(i: int, sandbox: AsyncSandbox) -> tuple[Any, BaseException | None]:
        assert each is not None
        async with gate:
            try:
                return await each(i, sandbox), None
            except Exception as exc:
                return None, exc

    try:
        async for started in arrivals:
            if started.sandbox is None:
                errors.append(started.error or GroupError([]))
                continue
            members.append(started.sandbox)
            templates.append(started.template_id)
            if each is not None and not errors:
                work.append(asyncio.ensure_future(run(len(members) - 1, started.sandbox)))
    except BaseException:
        await _abandon(work, members, concurrency)
        raise
    if errors:
        await _abandon(work, members, concurrency)
        raise GroupError(errors)
    outcomes = await asyncio.gather(*work)
    for _, error in outcomes:
        if error is not None:
            raise error
    return Arrived(members, templates, [value for value, _ in outcomes])


async def _abandon(work: list[asyncio.Task[Any]], members: list[AsyncSandbox], concurrency: int) -> None:
    for task in work:
        task.cancel()
    await asyncio.gather(*work, return_exceptions=True)
    await asyncio.shield(bounded(concurrency, [partial(kill_quietly, m) for m in members]))


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
        #: ``each``'s result per member when the group was made with one (member order).
        self.each_results: list[Any] = []

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

    @classmethod
    async def from_snapshot(
        cls,
        snapshot_id: str,
        n: int,
        *,
        each: EachFn | None = None,
        lifetime: int = 300,
        concurrency: int = DEFAULT_CONCURRENCY,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        connection: Connection | None = None,
        group_id: str | None = None,
    ) -> SandboxGroup:
        """``n`` sandboxes from the stored snapshot ``snapshot_id`` in one call (our extension;
        ``n`` concurrent SDK creates against a server without it), members in the order they came
        up. ``each(i, member)`` starts for every member the moment it is up; its results are
        :attr:`each_results`. All or nothing, as :meth:`create`."""
        if n < 1:
            raise ValueError("a group needs at least one member")
        group_id = group_id or "grp" + secrets.token_hex(6)
        tags = {**(metadata or {}), GROUP_METADATA_KEY: group_id}
        arrivals = from_snapshot(
            snapshot_id, n, lifetime=lifetime, metadata=tags, envs=envs, connection=connection
        )
        return cls._of(await as_they_come(arrivals, each, concurrency=concurrency), group_id, concurrency)

    @classmethod
    async def fork(
        cls,
        parent: AsyncSandbox,
        n: int,
        *,
        each: EachFn | None = None,
        lifetime: int = 300,
        concurrency: int = DEFAULT_CONCURRENCY,
        group_id: str | None = None,
    ) -> SandboxGroup:
        """``n`` children of ``parent`` (running, or paused: it stays paused) as one group, members
        in the order they came up; ``each`` as in :meth:`from_snapshot`. The children carry the
        parent's metadata (a fork copies it), not a group tag."""
        arrivals = fork_stream(parent, n, lifetime=lifetime)
        arrived = await as_they_come(arrivals, each, concurrency=concurrency)
        return cls._of(arrived, group_id, concurrency)

    @classmethod
    def _of(cls, arrived: Arrived, group_id: str | None, concurrency: int) -> SandboxGroup:
        group = cls(arrived.members, group_id=group_id, concurrency=concurrency)
        group.each_results = arrived.results
        return group

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
