"""The groups of sandbox states are named once (forkyard/types.py) and agree with each other and
with the state machine's edges."""

from __future__ import annotations

from forkyard.orchestrator.lifecycle import EDGES
from forkyard.types import (
    ADMITTED_STATES,
    HELD_STATES,
    KEPT_BY_RECOVERY,
    LISTED_STATES,
    LIVE_STATES,
    REACHABLE_STATES,
    SandboxState,
)

S = SandboxState


def test_held_is_every_state_but_killed_and_live_is_held_but_paused() -> None:
    assert set(HELD_STATES) == set(S) - {S.KILLED}
    assert set(LIVE_STATES) == set(HELD_STATES) - {S.PAUSED}


def test_the_groups_nest() -> None:
    assert set(LISTED_STATES) <= set(REACHABLE_STATES) <= set(HELD_STATES)
    assert set(ADMITTED_STATES) <= set(LIVE_STATES)
    assert set(KEPT_BY_RECOVERY) <= set(HELD_STATES)
    assert S.KILLING not in REACHABLE_STATES  # a kill under way answers 404, as a killed one


def test_every_held_state_can_end_killed() -> None:
    for state in HELD_STATES:
        seen, todo = {state}, [state]
        while todo:
            for nxt in EDGES[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert S.KILLED in seen, state
