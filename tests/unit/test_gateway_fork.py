"""Fork spill-over's pure parts (forkyard/gateway/fork.py, placement.room/spread): how many
children the parent's node takes, where the others go, which fork bodies the gateway plans."""

from __future__ import annotations

from forkyard.gateway.fork import ForkRequest
from forkyard.gateway.placement import Need, NodeInfo, Placed, note_placed, room, spread

NOW = 1_000_000.0


def node(node_id: str, memory: int = 8000, slots: int = 10) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        url=f"http://{node_id}",
        state="up",
        heartbeat_at=NOW - 1,
        memory_free_mib=memory,
        slots_free=slots,
    )


def test_room_is_the_free_slots_within_free_memory_less_what_was_placed_since() -> None:
    assert room(node("a", memory=8000, slots=3), {}) == 3
    assert room(node("a", memory=1100, slots=3), {}) == 2  # 512 MiB each
    placed: dict[str, Placed] = {}
    note_placed(placed, "a", 512, NOW)
    assert room(node("a", slots=3), placed) == 2
    assert room(node("a", slots=0), placed) == 0


def test_spread_counts_each_child_before_placing_the_next() -> None:
    placed: dict[str, Placed] = {}
    plan = spread([node("b", slots=2), node("c", slots=1)], 4, Need(), NOW, 15.0, placed)
    assert sorted(n.node_id if n else "-" for n in plan) == ["-", "b", "b", "c"]
    assert plan[-1] is None  # the fourth finds no room left
    assert placed["b"].sandboxes == 2 and placed["c"].sandboxes == 1


def test_fork_requests_the_gateway_plans_and_those_it_leaves_to_the_node() -> None:
    assert ForkRequest.parse(b"") == ForkRequest(1, 15, {})
    parsed = ForkRequest.parse(b'{"count": 3, "timeout": 60}')
    assert parsed is not None and (parsed.count, parsed.timeout) == (3, 60)
    for bad in (b"[1]", b"{", b'{"count": 0}', b'{"count": 101}', b'{"count": "2"}', b'{"timeout": 1.5}'):
        assert ForkRequest.parse(bad) is None, bad  # the node answers its own 400
