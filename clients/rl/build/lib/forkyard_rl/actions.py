"""What an agent does in a sandbox (a shell command or a piece of code) and what came of it.

An action is a plain ``str`` (a shell command), a :class:`Command` (with user, cwd, env vars) or
a :class:`Code` (Python source, run by the sandbox's ``python3``). :func:`run_action` runs one
through the SDK and always returns a :class:`RunResult`: a non-zero exit, a timeout or a lost
sandbox is a result with ``error`` set, never an exception, so one bad member of a batch does
not cost the others theirs.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar, cast

if TYPE_CHECKING:
    from e2b import AsyncSandbox

T = TypeVar("T")

#: Seconds a request may take beyond the command's own timeout before the client gives up on it
#: (the command timeout is enforced by envd; this guards against a request that never answers).
REQUEST_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class Command:
    """A shell command (run by envd as ``bash -l -c``, as the SDK's ``commands.run``)."""

    cmd: str
    user: str | None = None
    cwd: str | None = None
    envs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Code:
    """Source code run by the sandbox's interpreter; only Python (``python3``) for now."""

    source: str
    language: Literal["python"] = "python"
    user: str | None = None
    cwd: str | None = None
    envs: dict[str, str] = field(default_factory=dict)


Action = str | Command | Code


def as_command(action: Action) -> Command:
    """The shell command an action runs. Code goes in a quoted here-document (one round trip,
    no file left behind; stdin stays the program's)."""
    if isinstance(action, str):
        return Command(action)
    if isinstance(action, Command):
        return action
    marker = "FORKYARD_CODE_" + secrets.token_hex(6)
    while marker in action.source:  # a marker inside the source would end the document early
        marker = "FORKYARD_CODE_" + secrets.token_hex(6)
    cmd = f"python3 -c \"$(cat <<'{marker}'\n{action.source}\n{marker}\n)\""
    return Command(cmd, user=action.user, cwd=action.cwd, envs=dict(action.envs))


def describe(action: Action) -> tuple[str, str]:
    """``(kind, text)`` of an action, as a trajectory records it."""
    if isinstance(action, Code):
        return f"code:{action.language}", action.source
    return "command", as_command(action).cmd


@dataclass(frozen=True)
class RunResult:
    """What one action did in one sandbox."""

    sandbox_id: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    started_at: float
    #: Why the action did not finish (timeout, lost sandbox); None when it ran to its exit code.
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


async def run_action(sandbox: AsyncSandbox, action: Action, *, command_timeout: float = 60.0) -> RunResult:
    """Run ``action`` in ``sandbox``; ``command_timeout`` seconds for the command (envd ends it)."""
    from e2b import CommandExitException

    command = as_command(action)
    started_at, started = time.time(), time.monotonic()

    def result(code: int | None, out: str, err: str, error: str | None = None) -> RunResult:
        return RunResult(sandbox.sandbox_id, code, out, err, time.monotonic() - started, started_at, error)

    try:
        async with asyncio.timeout(command_timeout + REQUEST_GRACE_SECONDS):
            done = await sandbox.commands.run(
                command.cmd,
                envs=command.envs or None,
                user=command.user,  # type: ignore[arg-type]
                cwd=command.cwd,
                timeout=command_timeout,
                request_timeout=command_timeout + REQUEST_GRACE_SECONDS,
            )
    except CommandExitException as exc:
        return result(exc.exit_code, exc.stdout or "", exc.stderr or "")
    except TimeoutError:
        return result(None, "", "", f"no answer within {command_timeout + REQUEST_GRACE_SECONDS:.0f} s")
    except Exception as exc:  # the SDK's timeouts, a killed sandbox, a transport error
        return result(None, "", "", f"{type(exc).__name__}: {exc}")
    return result(done.exit_code, done.stdout, done.stderr)


async def bounded(limit: int, jobs: Iterable[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the jobs concurrently, at most ``limit`` at a time; results in the jobs' order. The
    first failure propagates once every job has ended (none is left running)."""
    if limit < 1:
        raise ValueError("concurrency must be at least 1")
    gate = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[T]]) -> tuple[T | None, BaseException | None]:
        # Failures are carried beside the values: a job may return an exception as its value.
        async with gate:
            try:
                return await job(), None
            except Exception as exc:
                return None, exc

    outcomes = await asyncio.gather(*(one(j) for j in jobs))
    for _, error in outcomes:
        if error is not None:
            raise error
    return [cast(T, value) for value, _ in outcomes]


def per_member(actions: Action | Sequence[Action] | Callable[[int], Action], n: int) -> list[Action]:
    """One action for each of ``n`` members: the same for all, one each, or ``actions(i)``."""
    if isinstance(actions, str | Command | Code):
        return [actions] * n
    if callable(actions):
        return [actions(i) for i in range(n)]
    if len(actions) != n:
        raise ValueError(f"{len(actions)} actions for {n} members")
    return list(actions)
