"""4 prompts x 16 forks on the ``base`` template: one GRPO step each, end to end.

Every prompt is a small coding task. Its prompt state is prepared once in a sandbox (the task
statement and its checker on disk); ``grpo_step`` forks 16 copies of that state, has each
"policy sample" write a solution, scores it by running the checker inside the fork (reward 1.0
when it passes), computes the group's advantages and kills the forks. The policy here is a toy
(it picks one of a few candidate solutions at random) so that the script needs no model; a
trainer would put its sampled completions there. All four prompts run concurrently.

    export E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000
    export E2B_API_KEY=$(cat /var/lib/forkyard/api-key)
    python examples/grpo.py --out /tmp/grpo.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from e2b import AsyncSandbox

from forkyard_rl import ForkTree, RunResult, grpo_step, run_action


@dataclass(frozen=True)
class Task:
    name: str
    statement: str
    check: str  # Python run in the fork after the action; exit 0 = solved
    candidates: tuple[str, ...]  # what the toy policy may answer (some right, some wrong)


TASKS = (
    Task(
        "add",
        "Write solution.py with add(a, b) returning the sum.",
        "from solution import add; assert add(2, 3) == 5 and add(-1, 1) == 0",
        (
            "def add(a, b):\n    return a + b\n",
            "def add(a, b):\n    return a - b\n",
            "def add(a, b):\n    return a * b\n",
        ),
    ),
    Task(
        "reverse",
        "Write solution.py with rev(s) returning s reversed.",
        "from solution import rev; assert rev('abc') == 'cba' and rev('') == ''",
        (
            "def rev(s):\n    return s[::-1]\n",
            "def rev(s):\n    return ''.join(sorted(s))\n",
            "def rev(s):\n    return s\n",
        ),
    ),
    Task(
        "fib",
        "Write solution.py with fib(n), fib(0) = 0, fib(1) = 1.",
        "from solution import fib; assert [fib(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]",
        (
            "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
            "def fib(n):\n    return n\n",
            "def fib(n):\n    return fib(n - 1) + fib(n - 2) if n > 1 else 1\n",
        ),
    ),
    Task(
        "count",
        "Write solution.py with vowels(s) counting a, e, i, o, u.",
        "from solution import vowels; assert vowels('education') == 5 and vowels('xyz') == 0",
        ("def vowels(s):\n    return sum(c in 'aeiou' for c in s)\n", "def vowels(s):\n    return len(s)\n"),
    ),
)


def prepare(task: Task) -> str:
    """The prompt state: the statement and the checker in the home directory."""
    return (
        f"mkdir -p /home/user/task && cd /home/user/task && "
        f"printf '%s\\n' {shlex.quote(task.statement)} > PROMPT && "
        f"printf '%s\\n' {shlex.quote(task.check)} > check.py"
    )


def policy(task: Task, seed: int) -> str:
    """The toy policy: sample i writes one of the candidates (a trainer's completion)."""
    rng = random.Random(f"{task.name}-{seed}")
    solution = rng.choice(task.candidates)
    return f"cd /home/user/task && cat > solution.py <<'EOF'\n{solution}EOF"


async def reward(sandbox: AsyncSandbox, _: RunResult) -> float:
    """1.0 when the task's checker passes in this fork."""
    check = await run_action(sandbox, "cd /home/user/task && python3 check.py", command_timeout=30)
    return 1.0 if check.ok else 0.0


async def one_prompt(task: Task, forks: int, out: list[str]) -> dict[str, object]:
    started = time.monotonic()
    async with await ForkTree.create("base", lifetime=900, concurrency=forks) as tree:
        prepared = (await tree.run([tree.root], prepare(task)))[0]
        if not prepared.ok:
            raise RuntimeError(f"preparing {task.name} failed: {prepared.stderr or prepared.error}")
        ready = time.monotonic()
        outcome = await grpo_step(tree, tree.root, lambda i: policy(task, i), reward, n=forks, lifetime=300)
        out.append(tree.trajectory.to_jsonl())
    return {
        "task": task.name,
        "forks": len(outcome.nodes),
        "mean_reward": round(sum(outcome.rewards) / len(outcome.rewards), 3),
        "rewards": outcome.rewards,
        "advantages": [round(a, 3) for a in outcome.advantages],
        "prepare_s": round(ready - started, 2),
        "grpo_step_s": round(outcome.duration_s, 2),
    }


async def run(prompts: int, forks: int) -> tuple[list[dict[str, object]], list[str]]:
    """Every prompt's GRPO step at once; their summaries and trajectories (JSON lines)."""
    trajectories: list[str] = []
    summaries = await asyncio.gather(*(one_prompt(t, forks, trajectories) for t in TASKS[:prompts]))
    return list(summaries), trajectories


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--prompts", type=int, default=len(TASKS), help="how many of the 4 tasks")
    parser.add_argument("--forks", type=int, default=16, help="forks per prompt (the GRPO group size)")
    parser.add_argument("--out", default="/tmp/grpo-trajectories.jsonl", help="trajectories, JSON lines")
    args = parser.parse_args()
    started = time.monotonic()
    summaries, trajectories = asyncio.run(run(args.prompts, args.forks))
    wall = time.monotonic() - started
    Path(args.out).write_text("".join(trajectories), encoding="utf-8")
    for summary in summaries:
        print(json.dumps(summary))
    steps = sum(len(t.splitlines()) for t in trajectories)
    total = {"prompts": len(summaries), "forks": args.forks, "wall_s": round(wall, 2), "steps": steps}
    print(json.dumps({**total, "out": args.out}))


if __name__ == "__main__":
    main()
