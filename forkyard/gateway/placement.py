"""Where a new sandbox goes (docs/CLUSTER.md "Placement"): pure functions of the ``nodes`` rows.

1. Candidates: nodes ``up`` whose heartbeat is fresh, with the room the sandbox needs (free
   memory and a free slot, after what this gateway placed there since the node's heartbeat).
2. Order: most free memory first, then most free slots. Nodes within :data:`NEAR_BEST` of the
   best free memory count as equally roomy: among them, one holding a copy of the snapshot or
   template snapshot the sandbox is restored from comes first, then one with a warm pool of the
   template, then the least loaded (fewest sandboxes, so equal nodes take turns).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

#: Nodes within this fraction of the best free memory are treated as equally roomy.
NEAR_BEST = 0.10
#: What a sandbox is assumed to need when the request does not say (E2B's default sandbox).
DEFAULT_MEMORY_MIB = 512


@dataclass(frozen=True)
class NodeInfo:
    """One row of ``nodes``, as placement reads it."""

    node_id: str
    url: str
    state: str
    heartbeat_at: float
    memory_free_mib: int
    slots_free: int
    vcpus_free: int = 0
    sandboxes_running: int = 0
    runtime: str = ""
    warm_templates: frozenset[str] = frozenset()

    @classmethod
    def from_row(cls, row: Mapping[str, object]) -> NodeInfo:
        warm = row.get("warm_templates") or "[]"
        try:
            templates = frozenset(str(t) for t in json.loads(str(warm)))
        except ValueError:
            templates = frozenset()
        return cls(
            node_id=str(row["node_id"]),
            url=str(row["url"]),
            state=str(row["state"]),
            heartbeat_at=float(row["heartbeat_at"]),  # type: ignore[arg-type]
            memory_free_mib=int(row.get("memory_free_mib") or 0),  # type: ignore[call-overload]
            slots_free=int(row.get("slots_free") or 0),  # type: ignore[call-overload]
            vcpus_free=int(row.get("vcpus_free") or 0),  # type: ignore[call-overload]
            sandboxes_running=int(row.get("sandboxes_running") or 0),  # type: ignore[call-overload]
            runtime=str(row.get("runtime") or ""),
            warm_templates=templates,
        )


@dataclass(frozen=True)
class Need:
    """What the sandbox to place needs and what it is made from."""

    memory_mib: int = DEFAULT_MEMORY_MIB
    #: The template (id or alias) whose warm pool would serve it.
    template: str | None = None
    #: Nodes holding a copy of the snapshot (or template snapshot) it is restored from.
    cached_on: frozenset[str] = frozenset()


@dataclass
class Placed:
    """What this gateway placed on a node since it last heartbeated (the row does not show it yet)."""

    memory_mib: int = 0
    sandboxes: int = 0
    at: list[float] = field(default_factory=list)


def fresh(node: NodeInfo, now: float, fresh_within: float) -> bool:
    return node.state == "up" and now - node.heartbeat_at <= fresh_within


@dataclass
class HeartbeatClock:
    """The time a node's heartbeat age is judged at (placement's ``now``): while the registry is
    out of reach, and for ``fresh_within`` after it answers again, no node could write its
    heartbeat, so the outage does not age them: during it, time stands at the registry's last
    answer; after it, ``now`` less the outage's length. Without this a create right after a
    PostgreSQL restart longer than ``fresh_within`` found no node fresh ("no node has room")."""

    fresh_within: float
    #: Wall times: the registry's last answer; since when it fails (None: it answers); the last
    #: outage, (its last answer before, its first answer after).
    answered_at: float | None = None
    failing_since: float | None = None
    outage: tuple[float, float] | None = None

    def answered(self, at: float) -> None:
        if self.failing_since is not None and self.answered_at is not None:
            self.outage = (self.answered_at, at)
        self.failing_since = None
        self.answered_at = at

    @property
    def failing(self) -> bool:
        """Whether the registry's last answer was a failure (the node list is from before it)."""
        return self.failing_since is not None

    def failed(self, at: float) -> None:
        if self.failing_since is None:
            self.failing_since = at

    def now(self, at: float) -> float:
        if self.failing and self.answered_at is not None:
            return self.answered_at
        if self.outage is not None and at - self.outage[1] < self.fresh_within:
            return at - (self.outage[1] - self.outage[0])
        return at


def _effective(node: NodeInfo, placed: Mapping[str, Placed]) -> tuple[int, int, int]:
    """(free memory, free slots, sandboxes) counting placements newer than the heartbeat."""
    extra = placed.get(node.node_id)
    if extra is None:
        return node.memory_free_mib, node.slots_free, node.sandboxes_running
    return (
        node.memory_free_mib - extra.memory_mib,
        node.slots_free - extra.sandboxes,
        node.sandboxes_running + extra.sandboxes,
    )


def candidates(
    nodes: Sequence[NodeInfo],
    need: Need,
    now: float,
    fresh_within: float,
    placed: Mapping[str, Placed] | None = None,
) -> list[NodeInfo]:
    """The nodes that can take the sandbox, best first (see the module's docstring)."""
    placed = placed or {}
    roomy = []
    for node in nodes:
        memory, slots, _ = _effective(node, placed)
        if fresh(node, now, fresh_within) and memory >= need.memory_mib and slots >= 1:
            roomy.append(node)
    if not roomy:
        return []
    by_room = sorted(roomy, key=lambda n: (-_effective(n, placed)[0], -_effective(n, placed)[1], n.node_id))
    best_memory = _effective(by_room[0], placed)[0]
    near = [n for n in by_room if _effective(n, placed)[0] >= best_memory * (1 - NEAR_BEST)]
    rest = [n for n in by_room if n not in near]

    def preference(node: NodeInfo) -> tuple[int, int, int, int, int, str]:
        memory, slots, sandboxes = _effective(node, placed)
        cached = node.node_id in need.cached_on
        warm = need.template is not None and need.template in node.warm_templates
        return (0 if cached else 1, 0 if warm else 1, sandboxes, -memory, -slots, node.node_id)

    return sorted(near, key=preference) + rest


def note_placed(placed: dict[str, Placed], node_id: str, memory_mib: int, at: float) -> None:
    entry = placed.setdefault(node_id, Placed())
    entry.memory_mib += memory_mib
    entry.sandboxes += 1
    entry.at.append(at)


def forget_seen(placed: dict[str, Placed], nodes: Collection[NodeInfo], memory_mib: int) -> None:
    """Drop the placements a node's newer heartbeat already counts."""
    for node in nodes:
        entry = placed.get(node.node_id)
        if entry is None:
            continue
        entry.at = [t for t in entry.at if t > node.heartbeat_at]
        entry.sandboxes = len(entry.at)
        entry.memory_mib = len(entry.at) * memory_mib
        if not entry.at:
            del placed[node.node_id]


def room(node: NodeInfo, placed: Mapping[str, Placed]) -> int:
    """How many more default-sized sandboxes ``node`` takes (its free slots, within its free
    memory), after what this gateway placed there since its heartbeat."""
    memory, slots, _ = _effective(node, placed)
    return max(0, min(slots, memory // DEFAULT_MEMORY_MIB))


def spread(
    nodes: Sequence[NodeInfo],
    count: int,
    need: Need,
    now: float,
    fresh_within: float,
    placed: dict[str, Placed],
) -> list[NodeInfo | None]:
    """Where ``count`` sandboxes go, one by one (each counted before the next is placed);
    None for one no node has room for."""
    plan: list[NodeInfo | None] = []
    for _ in range(count):
        ranked = candidates(nodes, need, now, fresh_within, placed)
        plan.append(ranked[0] if ranked else None)
        if ranked:
            note_placed(placed, ranked[0].node_id, need.memory_mib, now)
    return plan
