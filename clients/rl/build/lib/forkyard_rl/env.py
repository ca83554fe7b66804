"""A gym-style environment on one sandbox: ``reset()`` restores the task's snapshot,
``step(action)`` runs the agent's command or code and scores it.

    env = await SandboxEnv.from_setup("base", "git clone ... /repo", reward_tests_pass("pytest -q /repo"))
    obs = await env.reset()
    obs, reward, done, info = await env.step("sed -i 's/bug/fix/' /repo/x.py")
    await env.close()

The first ``reset()`` creates the sandbox from the task's snapshot; every later one rolls it
back to that snapshot in place (our API extension: same sandbox id, its files, processes and
memory those of the snapshot). The reward function is ``reward(sandbox, result)`` returning a
float, or ``(reward, done)``; :func:`reward_tests_pass` scores 1.0 and ends the episode when a
test command succeeds. Steps are recorded in :attr:`SandboxEnv.trajectory` (member: ``episode-N``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from forkyard_rl.actions import Action, RunResult, run_action
from forkyard_rl.api import Connection, RollbackError, rollback
from forkyard_rl.group import kill_quietly
from forkyard_rl.trajectory import Trajectory

if TYPE_CHECKING:
    from e2b import AsyncSandbox

#: ``reward(sandbox, result)`` -> reward, or (reward, done).
EnvRewardFn = Callable[["AsyncSandbox", RunResult], Awaitable[float | tuple[float, bool]]]


class StepResult(NamedTuple):
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


def reward_tests_pass(command: Action, *, command_timeout: float = 120.0) -> EnvRewardFn:
    """A reward: run ``command`` (the task's tests) after the agent's action; 1.0 and the
    episode ends when it exits 0, else 0.0."""

    async def reward(sandbox: AsyncSandbox, _: RunResult) -> tuple[float, bool]:
        tests = await run_action(sandbox, command, command_timeout=command_timeout)
        return (1.0, True) if tests.ok else (0.0, False)

    return reward


class SandboxEnv:
    def __init__(
        self,
        task_snapshot_id: str,
        reward: EnvRewardFn,
        *,
        observe: Action | None = None,
        max_steps: int = 20,
        step_timeout: float = 60.0,
        lifetime: int = 600,
        connection: Connection | None = None,
        owns_snapshot: bool = False,
    ) -> None:
        """``task_snapshot_id``: the state every episode starts from. ``observe``: an action
        whose output is the observation ``reset()`` returns (else ""). ``lifetime``: the
        sandbox's server-side timeout in seconds, renewed at every reset."""
        self.task_snapshot_id = task_snapshot_id
        self.reward = reward
        self.observe = observe
        self.max_steps = max_steps
        self.step_timeout = step_timeout
        self.lifetime = lifetime
        self.connection = connection or Connection()
        self.owns_snapshot = owns_snapshot
        self.sandbox: AsyncSandbox | None = None
        self.episode = -1
        self.steps = 0
        self.trajectory = Trajectory(f"env:{task_snapshot_id}")

    @classmethod
    async def from_setup(
        cls,
        template: str,
        setup: Action,
        reward: EnvRewardFn,
        *,
        setup_timeout: float = 600.0,
        connection: Connection | None = None,
        **kwargs: Any,
    ) -> SandboxEnv:
        """Prepare the task once (``setup`` in a sandbox of ``template``), snapshot it, and use
        that sandbox as the environment's; the snapshot is deleted by :meth:`close`."""
        from e2b import AsyncSandbox

        connection = connection or Connection()
        sandbox = await AsyncSandbox.create(template, timeout=int(setup_timeout) + 60, **connection.opts())
        try:
            prepared = await run_action(sandbox, setup, command_timeout=setup_timeout)
            if not prepared.ok:
                raise RuntimeError(
                    f"task set-up failed ({prepared.exit_code}, {prepared.error}): {prepared.stderr[-2000:]}"
                )
            snapshot = await sandbox.create_snapshot()
        except BaseException:
            await kill_quietly(sandbox)
            raise
        env = cls(snapshot.snapshot_id, reward, connection=connection, owns_snapshot=True, **kwargs)
        env.sandbox = sandbox  # already in the task's state: the first reset rolls it back anyway
        return env

    async def reset(self) -> str:
        """Start an episode in the task's state; returns the observation (``observe``'s output)."""
        from e2b import AsyncSandbox

        if self.sandbox is not None:
            try:
                await rollback(self.sandbox, self.task_snapshot_id)
                await self.sandbox.set_timeout(self.lifetime)
            except RollbackError as exc:
                if exc.code != 404:
                    raise
                self.sandbox = None  # it ended (its timeout, a kill): start from a new one
        if self.sandbox is None:
            self.sandbox = await AsyncSandbox.create(
                self.task_snapshot_id, timeout=self.lifetime, **self.connection.opts()
            )
        self.episode += 1
        self.steps = 0
        if self.observe is None:
            return ""
        return (await run_action(self.sandbox, self.observe, command_timeout=self.step_timeout)).output

    async def step(self, action: Action) -> StepResult:
        """Run ``action``; returns ``(observation, reward, done, info)``. ``done`` when the reward
        function says so or after ``max_steps`` steps (``info["truncated"]``)."""
        if self.sandbox is None:
            raise RuntimeError("call reset() before step()")
        result = await run_action(self.sandbox, action, command_timeout=self.step_timeout)
        reward, done = await self._score(result)
        self.steps += 1
        truncated = not done and self.steps >= self.max_steps
        info: dict[str, Any] = {
            "exit_code": result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr,
            "error": result.error,
            "duration_s": result.duration_s,
            "episode": self.episode,
            "step": self.steps,
            "sandbox_id": self.sandbox.sandbox_id,
            "truncated": truncated,
        }
        self.trajectory.record(
            f"episode-{self.episode}", action, result, reward=reward, done=done or truncated
        )
        return StepResult(result.output, reward, done or truncated, info)

    async def _score(self, result: RunResult) -> tuple[float, bool]:
        assert self.sandbox is not None
        if result.error is not None:  # timed out or the sandbox is gone: no reward, episode over
            return 0.0, True
        scored = await self.reward(self.sandbox, result)
        if isinstance(scored, tuple):
            return float(scored[0]), bool(scored[1])
        return float(scored), False

    async def close(self) -> None:
        """Kill the sandbox; delete the task snapshot if this environment made it."""
        from e2b import AsyncSandbox

        if self.sandbox is not None:
            await kill_quietly(self.sandbox)
            self.sandbox = None
        if self.owns_snapshot:
            with contextlib.suppress(Exception):
                await AsyncSandbox.delete_snapshot(self.task_snapshot_id, **self.connection.opts())

    async def __aenter__(self) -> SandboxEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
