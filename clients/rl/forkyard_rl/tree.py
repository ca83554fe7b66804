"""Fork trees: fork k children from one sandbox, again from each; the tree is kept.

    async with await ForkTree.create("base") as tree:
        await tree.run([tree.root], "git clone ... && pip install -e .")   # the prompt state
        kids = await tree.fork(tree.root, 4)                              # 4 copies of it
        grandkids = await tree.fork_each(kids, 2)                         # 2 more from each
        await tree.prune(kids[0])                                         # kid 0 and its subtree

Each :class:`Node` knows its parent and the snapshot it was restored from (the checkpoint of
its fork, as the server reports it); :meth:`ForkTree.checkpoint` takes a durable snapshot of a
node that :meth:`ForkTree.rollback` puts it back to in place. Forks stream their children
(:mod:`forkyard_rl.stream`: our fork call that answers each child as it is up; the SDK's
``fork``, 20 per call, against a server without it), and a paused node forks without being
resumed. :func:`grpo_step` is one GRPO step in one call: one prompt state -> n forks -> act ->
reward -> group advantages, each child's rollout starting the moment that child is up.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any

from forkyard_rl.actions import Action, RunResult, bounded, per_member, run_action
from forkyard_rl.api import Connection, rollback
from forkyard_rl.group import DEFAULT_CONCURRENCY, as_they_come, kill_quietly
from forkyard_rl.stream import Started, fork_stream
from forkyard_rl.trajectory import Trajectory

if TYPE_CHECKING:
    from e2b import AsyncSandbox

#: ``reward(sandbox, result)``: how good a member's result is (may look into the sandbox).
RewardFn = Callable[["AsyncSandbox", RunResult], Awaitable[float]]


@dataclass
class Node:
    node_id: str
    sandbox: AsyncSandbox | None
    parent_id: str | None
    depth: int
    #: The snapshot this node was restored from: its fork's checkpoint (the server's template
    #: id of a fork child), None for a root.
    origin_snapshot_id: str | None = None
    #: A durable snapshot of this node (:meth:`ForkTree.checkpoint`), the target of a rollback.
    snapshot_id: str | None = None
    children: list[str] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)

    @property
    def alive(self) -> bool:
        return self.sandbox is not None

    def live(self) -> AsyncSandbox:
        if self.sandbox is None:
            raise ValueError(f"node {self.node_id} was pruned")
        return self.sandbox

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "parent_id": self.parent_id,
            "depth": self.depth,
            "origin_snapshot_id": self.origin_snapshot_id,
            "snapshot_id": self.snapshot_id,
            "children": list(self.children),
            "alive": self.alive,
            "created_at": self.created_at,
        }


class ForkTree:
    def __init__(
        self,
        root: AsyncSandbox,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        trajectory: Trajectory | None = None,
        owns_root: bool = True,
    ) -> None:
        self.root = Node(root.sandbox_id, root, None, 0)
        self.nodes: dict[str, Node] = {self.root.node_id: self.root}
        self.concurrency = concurrency
        self.trajectory = trajectory or Trajectory(f"tree:{self.root.node_id}")
        self.owns_root = owns_root
        self._snapshots: list[str] = []
        # For class-level calls (deleting checkpoints) once the root may be gone.
        config = root.connection_config
        self._opts = Connection(api_key=config.api_key, api_url=config.api_url).opts()

    @classmethod
    async def create(
        cls,
        template: str,
        *,
        lifetime: int = 300,
        connection: Connection | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        metadata: dict[str, str] | None = None,
    ) -> ForkTree:
        """A tree whose root is a new sandbox of ``template`` (``lifetime``: its server-side timeout, s)."""
        from e2b import AsyncSandbox

        opts = (connection or Connection()).opts()
        root = await AsyncSandbox.create(template, timeout=lifetime, metadata=metadata, **opts)
        return cls(root, concurrency=concurrency)

    # -- growing -------------------------------------------------------------------------------

    async def fork(
        self,
        node: Node,
        k: int,
        *,
        lifetime: int = 300,
        each: Callable[[int, Node], Awaitable[Any]] | None = None,
    ) -> list[Node]:
        """``k`` children of ``node`` (running, or paused: it stays paused) with its memory,
        processes and disk, in the order they came up; ``lifetime``: their server-side timeout in
        seconds. ``each(i, child)`` starts for every child the moment it is up (at most
        :attr:`concurrency` at a time), not when the last one is. All or nothing: if a child
        fails, ``each`` is stopped and the others are killed (:class:`GroupError`)."""
        if k < 1:
            raise ValueError("fork at least one child")
        parent = node.live()
        made: dict[str, Node] = {}

        async def arrivals() -> AsyncIterator[Started]:
            async for started in fork_stream(parent, k, lifetime=lifetime):
                if started.sandbox is not None:
                    child = started.sandbox
                    made[child.sandbox_id] = Node(
                        child.sandbox_id, child, node.node_id, node.depth + 1, started.template_id
                    )
                yield started

        async def each_node(i: int, sandbox: AsyncSandbox) -> Any:
            assert each is not None
            return await each(i, made[sandbox.sandbox_id])

        arrived = await as_they_come(arrivals(), each_node if each else None, concurrency=self.concurrency)
        nodes = [made[m.sandbox_id] for m in arrived.members]
        for child in nodes:
            self.nodes[child.node_id] = child
            node.children.append(child.node_id)
        return nodes

    async def fork_each(self, nodes: Sequence[Node], k: int, *, lifetime: int = 300) -> list[list[Node]]:
        """``k`` children of each node (their forks run concurrently)."""
        return await bounded(self.concurrency, [partial(self.fork, n, k, lifetime=lifetime) for n in nodes])

    # -- acting --------------------------------------------------------------------------------

    async def run(
        self,
        nodes: Sequence[Node],
        actions: Action | Sequence[Action] | Callable[[int], Action],
        *,
        command_timeout: float = 60.0,
    ) -> list[RunResult]:
        """An action in each node, concurrently; recorded in :attr:`trajectory` by node id."""
        todo = per_member(actions, len(nodes))

        async def one(i: int) -> RunResult:
            result = await run_action(nodes[i].live(), todo[i], command_timeout=command_timeout)
            self.trajectory.record(nodes[i].node_id, todo[i], result, parent=nodes[i].parent_id)
            return result

        return await bounded(self.concurrency, [partial(one, i) for i in range(len(nodes))])

    async def checkpoint(self, node: Node, name: str | None = None) -> str:
        """Take a durable snapshot of ``node`` (it keeps running); returns its id. The tree
        deletes the snapshots it took when it closes."""
        info = await node.live().create_snapshot(name=name)
        node.snapshot_id = info.snapshot_id
        self._snapshots.append(info.snapshot_id)
        return info.snapshot_id

    async def rollback(self, node: Node, snapshot_id: str | None = None) -> None:
        """Put ``node`` back to ``snapshot_id`` (default: its own checkpoint) in place."""
        target = snapshot_id or node.snapshot_id
        if target is None:
            raise ValueError(f"node {node.node_id} has no checkpoint to roll back to")
        await rollback(node.live(), target)

    # -- shape ---------------------------------------------------------------------------------

    def parent(self, node: Node) -> Node | None:
        return self.nodes.get(node.parent_id) if node.parent_id else None

    def lineage(self, node: Node) -> list[Node]:
        """``node`` and its ancestors, up to the root."""
        path = [node]
        while (up := self.parent(path[-1])) is not None:
            path.append(up)
        return path

    def subtree(self, node: Node) -> list[Node]:
        """``node`` and its descendants, parents before children."""
        out, todo = [], [node]
        while todo:
            current = todo.pop(0)
            out.append(current)
            todo += [self.nodes[c] for c in current.children]
        return out

    def leaves(self) -> list[Node]:
        return [
            n for n in self.nodes.values() if n.alive and not any(self.nodes[c].alive for c in n.children)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root.node_id, "nodes": [n.to_dict() for n in self.nodes.values()]}

    # -- ending --------------------------------------------------------------------------------

    async def prune(self, node: Node) -> list[str]:
        """Kill ``node``'s subtree (the node too); the nodes stay in the tree, not alive.
        Returns the killed sandbox ids."""
        doomed = [n for n in reversed(self.subtree(node)) if n.sandbox is not None]
        killed = await bounded(self.concurrency, [partial(kill_quietly, n.live()) for n in doomed])
        for n in doomed:
            n.sandbox = None
        return [n.node_id for n, k in zip(doomed, killed, strict=True) if k]

    async def prune_all(self, nodes: Sequence[Node]) -> list[str]:
        """:meth:`prune` of each node, concurrently."""
        killed = await bounded(self.concurrency, [partial(self.prune, n) for n in nodes])
        return [sandbox_id for ids in killed for sandbox_id in ids]

    async def close(self) -> None:
        """Kill every live node (the root only if the tree made it) and delete its checkpoints."""
        if self.owns_root:
            await self.prune(self.root)
        else:
            await self.prune_all([self.nodes[c] for c in self.root.children])
        await self._delete_snapshots()

    async def _delete_snapshots(self) -> None:
        from e2b import AsyncSandbox

        for snapshot_id in self._snapshots:
            with contextlib.suppress(Exception):  # gone already: nothing to free
                await AsyncSandbox.delete_snapshot(snapshot_id, **self._opts)
        self._snapshots = []

    async def __aenter__(self) -> ForkTree:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


# -- GRPO ----------------------------------------------------------------------------------------


def advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's group-relative advantages: ``(r - mean) / std`` (population std); all zeros when
    every reward is the same (nothing to prefer)."""
    if not rewards:
        return []
    mean = statistics.fmean(rewards)
    std = math.sqrt(statistics.fmean([(r - mean) ** 2 for r in rewards]))
    if std < 1e-12:
        return [0.0] * len(rewards)
    return [(r - mean) / std for r in rewards]


@dataclass(frozen=True)
class GroupOutcome:
    prompt_id: str
    nodes: list[Node]
    results: list[RunResult]
    rewards: list[float]
    advantages: list[float]
    duration_s: float


async def grpo_step(
    tree: ForkTree,
    prompt: Node,
    actions: Action | Sequence[Action] | Callable[[int], Action],
    reward: RewardFn,
    *,
    n: int = 16,
    command_timeout: float = 60.0,
    lifetime: int = 300,
    keep: bool = False,
) -> GroupOutcome:
    """One GRPO step from the prompt state ``prompt``: fork ``n`` children, run action ``i`` in
    child ``i`` (``i`` in the order the children come up) and score it with ``reward`` the moment
    that child is up, then compute the group's advantages. The children are pruned afterwards
    unless ``keep`` (then they stay in the tree for the next step)."""
    started = time.monotonic()
    todo = per_member(actions, n)
    results: dict[int, RunResult] = {}
    scores: dict[int, float] = {}

    async def rollout(i: int, child: Node) -> None:
        result = await run_action(child.live(), todo[i], command_timeout=command_timeout)
        tree.trajectory.record(child.node_id, todo[i], result, parent=child.parent_id)
        results[i] = result
        scores[i] = await _score(reward, child, result)

    children: list[Node] = []
    try:
        children = await tree.fork(prompt, n, lifetime=lifetime, each=rollout)
        ordered = [scores[i] for i in range(n)]
        _record_rewards(tree.trajectory, children, ordered)
    finally:
        if not keep:
            await tree.prune_all(children)
    return GroupOutcome(
        prompt.node_id,
        children,
        [results[i] for i in range(n)],
        ordered,
        advantages(ordered),
        time.monotonic() - started,
    )


async def _score(reward: RewardFn, node: Node, result: RunResult) -> float:
    """A failed action scores 0 without asking ``reward`` (its sandbox may be gone)."""
    if result.error is not None:
        return 0.0
    return float(await reward(node.live(), result))


def _record_rewards(trajectory: Trajectory, nodes: Sequence[Node], scores: Sequence[float]) -> None:
    """Attach each child's reward to its latest step."""
    for node, score in zip(nodes, scores, strict=True):
        steps = trajectory.of(node.node_id)
        if steps:
            trajectory.set_reward(steps[-1], score)
