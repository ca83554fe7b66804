"""Placement (forkyard/gateway/placement.py): who is a candidate and in which order."""

from __future__ import annotations

from forkyard.gateway.placement import (
    HeartbeatClock,
    Need,
    NodeInfo,
    Placed,
    candidates,
    forget_seen,
    note_placed,
)

NOW = 1_000_000.0


def node(
    node_id: str,
    memory: int = 8000,
    slots: int = 10,
    *,
    state: str = "up",
    age: float = 1.0,
    running: int = 0,
    warm: frozenset[str] = frozenset(),
) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        url=f"http://{node_id}",
        state=state,
        heartbeat_at=NOW - age,
        memory_free_mib=memory,
        slots_free=slots,
        sandboxes_running=running,
        warm_templates=warm,
    )


def order(
    nodes: list[NodeInfo], need: Need | None = None, placed: dict[str, Placed] | None = None
) -> list[str]:
    return [n.node_id for n in candidates(nodes, need or Need(), NOW, fresh_within=15.0, placed=placed)]


def test_only_fresh_up_nodes_with_room_are_candidates() -> None:
    nodes = [
        node("ok"),
        node("stale", age=60),
        node("lost", state="lost"),
        node("draining", state="draining"),
        node("full", memory=100),
        node("no-slots", slots=0),
    ]
    assert order(nodes) == ["ok"]
    assert order([node("stale", age=60)]) == []


def test_most_free_memory_first_then_slots() -> None:
    nodes = [node("small", memory=2000), node("big", memory=8000), node("mid", memory=5000)]
    assert order(nodes) == ["big", "mid", "small"]
    assert order([node("a", memory=1000, slots=2), node("b", memory=1000, slots=5)]) == ["b", "a"]


def test_within_ten_percent_a_cached_copy_then_a_warm_pool_wins() -> None:
    nodes = [node("best", memory=8000), node("cached", memory=7500), node("far", memory=4000)]
    assert order(nodes, Need(cached_on=frozenset({"cached"}))) == ["cached", "best", "far"]
    # Beyond 10 % of the best, capacity wins over the cache.
    assert order(nodes, Need(cached_on=frozenset({"far"}))) == ["best", "cached", "far"]
    warm = [node("best", memory=8000), node("warm", memory=7400, warm=frozenset({"base"}))]
    assert order(warm, Need(template="base")) == ["warm", "best"]
    assert order(warm, Need(template="other")) == ["best", "warm"]
    both = [node("warm", memory=8000, warm=frozenset({"base"})), node("cached", memory=8000)]
    assert order(both, Need(template="base", cached_on=frozenset({"cached"}))) == ["cached", "warm"]


def test_equal_nodes_take_turns_by_what_was_placed_since_their_heartbeat() -> None:
    nodes = [node("a", running=0), node("b", running=0)]
    placed: dict[str, Placed] = {}
    picks = []
    for i in range(4):
        first = order(nodes, placed=placed)[0]
        picks.append(first)
        note_placed(placed, first, 512, NOW + i)
    assert sorted(picks) == ["a", "a", "b", "b"] and picks[0] != picks[1]
    # A heartbeat newer than the placements counts them itself: they are forgotten.
    forget_seen(placed, [node("a", age=-10), node("b", age=-10)], 512)
    assert placed == {}


def test_placements_count_against_room() -> None:
    nodes = [node("a", memory=1000, slots=1)]
    placed: dict[str, Placed] = {}
    note_placed(placed, "a", 512, NOW)
    assert order(nodes, placed=placed) == []


def test_a_registry_outage_does_not_age_heartbeats() -> None:
    """No node can write its heartbeat while the registry is out of reach: placement judges
    heartbeats as of the registry's last answer meanwhile, and the outage's length less afterwards
    (a create right after a PostgreSQL restart longer than ``fresh_within`` found no node)."""
    clock = HeartbeatClock(fresh_within=3.0)
    node = NodeInfo(
        node_id="a", url="http://a", state="up", heartbeat_at=100.0, memory_free_mib=4096, slots_free=4
    )
    clock.answered(100.0)
    assert clock.now(102.0) == 102.0
    clock.failed(101.0)
    clock.failed(103.0)  # still the same outage
    assert clock.now(108.0) == 100.0  # time stands at the last answer
    assert candidates([node], Need(), clock.now(108.0), 3.0) == [node]
    clock.answered(109.0)  # back after 9 s: the node's next heartbeat is on its way
    assert clock.now(110.0) == 101.0
    assert candidates([node], Need(), clock.now(110.0), 3.0) == [node]
    assert clock.now(111.0) == 102.0
    assert clock.now(112.5) == 112.5  # fresh_within after it: the node has written a new one
    assert clock.now(200.0) == 200.0  # an outage long past ages nothing
    assert candidates([node], Need(), clock.now(200.0), 3.0) == []
