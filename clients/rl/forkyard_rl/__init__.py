"""The RL-native client: rollout groups, fork trees, rollback and gym-style environments on top
of the official ``e2b`` SDK, against any E2B-compatible API (ours adds rollback in place).

Async first (``asyncio``); :mod:`forkyard_rl.sync` has the few wrappers that are cheap.
A client of the server, never part of it: it imports none of the server's layers (an
import-linter contract in pyproject.toml), and needs the ``e2b`` SDK at run time::

    pip install forkyard-rl           # e2b==2.63.0 (or 'forkyard[rl]' beside the server)

Where the SDK reads its connection (``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY``), so
does this module; :class:`Connection` passes them explicitly instead.

* :class:`SandboxGroup` - N sandboxes from a template or snapshot, one action in all of them
  concurrently (bounded by a semaphore), per-member results, killed on exit; each member has a
  server-side timeout, the backstop when the trainer dies before it can kill them.
* :class:`ForkTree` - fork k children from a node (running or paused), again from each; node ->
  parent and snapshot kept; prune a branch; :func:`grpo_step` is one prompt state -> n forks ->
  act -> reward, each child's rollout starting the moment it is up.
* :func:`fork_stream`, :func:`from_snapshot` - a fork's children, or N sandboxes from a stored
  snapshot in one call, each as soon as it is up (our streaming calls; the SDK's against E2B);
  :meth:`SandboxGroup.fork` / :meth:`SandboxGroup.from_snapshot` make groups of them.
* :func:`rollback` - a sandbox back to a snapshot in place (same id): our API extension.
* :class:`SandboxEnv` - ``reset()`` restores the task's snapshot, ``step(action)`` acts and
  returns ``(observation, reward, done, info)``; the reward function is pluggable.
* :class:`Trajectory` - every action, output and timing per member, as JSON lines.
"""

from forkyard_rl.actions import Action, Code, Command, RunResult, run_action
from forkyard_rl.api import Connection, RollbackError, rollback
from forkyard_rl.env import SandboxEnv, StepResult, reward_tests_pass
from forkyard_rl.group import GroupError, SandboxGroup, as_they_come
from forkyard_rl.stream import Started, StreamError, fork_stream, from_snapshot
from forkyard_rl.trajectory import Step, Trajectory
from forkyard_rl.tree import ForkTree, GroupOutcome, Node, advantages, grpo_step

__all__ = [
    "Action",
    "Code",
    "Command",
    "Connection",
    "ForkTree",
    "GroupError",
    "GroupOutcome",
    "Node",
    "RollbackError",
    "RunResult",
    "SandboxEnv",
    "SandboxGroup",
    "Started",
    "Step",
    "StepResult",
    "StreamError",
    "Trajectory",
    "advantages",
    "as_they_come",
    "fork_stream",
    "from_snapshot",
    "grpo_step",
    "reward_tests_pass",
    "rollback",
    "run_action",
]
