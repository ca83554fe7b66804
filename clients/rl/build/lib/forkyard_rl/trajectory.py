"""Trajectories: every action, its output and timing, per member, exportable as JSON lines.

A :class:`Trajectory` is an append-only list of :class:`Step` records shared by whatever
produced them (a group, a fork tree, an environment); ``member`` says whose step it was (a
group's index, a tree's node id, an environment's episode). One JSON object per line, so a
trainer can stream them into its own data pipeline.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkyard_rl.actions import Action, RunResult, describe


@dataclass(frozen=True)
class Step:
    source: str
    member: str
    sandbox_id: str
    index: int
    kind: str
    action: str
    exit_code: int | None
    stdout: str
    stderr: str
    error: str | None
    started_at: float
    duration_s: float
    reward: float | None = None
    parent: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


class Trajectory:
    def __init__(self, source: str = "forkyard_rl") -> None:
        self.source = source
        self.steps: list[Step] = []
        self._counts: dict[str, int] = {}

    def record(
        self,
        member: str,
        action: Action,
        result: RunResult,
        *,
        reward: float | None = None,
        parent: str | None = None,
        **info: Any,
    ) -> Step:
        """Append the step ``result`` of ``action`` by ``member`` (its steps are numbered from 0)."""
        index = self._counts.get(member, 0)
        self._counts[member] = index + 1
        kind, text = describe(action)
        step = Step(
            source=self.source,
            member=member,
            sandbox_id=result.sandbox_id,
            index=index,
            kind=kind,
            action=text,
            exit_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
            error=result.error,
            started_at=result.started_at,
            duration_s=round(result.duration_s, 6),
            reward=reward,
            parent=parent,
            info=info,
        )
        self.steps.append(step)
        return step

    def set_reward(self, step: Step, reward: float) -> Step:
        """The same step with its reward (rewards often come after the action's result)."""
        new = dataclasses.replace(step, reward=reward)
        for i in range(len(self.steps) - 1, -1, -1):  # the step is usually among the last
            if self.steps[i] is step:
                self.steps[i] = new
                return new
        raise ValueError("the step is not in this trajectory")

    def members(self) -> list[str]:
        return list(dict.fromkeys(s.member for s in self.steps))

    def of(self, member: str) -> list[Step]:
        return [s for s in self.steps if s.member == member]

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def to_jsonl(self) -> str:
        return "".join(s.to_json() + "\n" for s in self.steps)

    def write_jsonl(self, path: str | Path) -> Path:
        """Append the steps to ``path`` (JSON lines); returns the path."""
        path = Path(path)
        with path.open("a", encoding="utf-8") as out:
            out.write(self.to_jsonl())
        return path

    @staticmethod
    def read_jsonl(text: str) -> list[Step]:
        return [Step(**json.loads(line)) for line in text.splitlines() if line.strip()]
