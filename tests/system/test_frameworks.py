"""The agent and RL frameworks that build on E2B, unchanged, against a real ``forkyard serve``
(issue 24), each with its own published package and no LLM:

* mini-swe-agent (PyPI ``mini-swe-agent``; SkyRL and NeMo-Gym run it): its ``DefaultAgent``
  driven by its ``DeterministicModel`` in our environment class
  (``forkyard_rl.integrations.minisweagent.E2BEnvironment``, an OCI image built into a template on
  first use) to a submitted answer; and a GRPO-shaped group: one prepared environment forked
  into 8, 8 different actions, isolated results.
* slime's sandbox convention (``slime/agent/sandbox.py``; slime is not on PyPI): the SDK's
  ``AsyncSandbox.create`` with no template and the image in metadata under the node's
  configured key.
* Harbor (PyPI ``harbor``; SkyRL runs it): ``harbor run`` with its E2B environment on a local task
  (Dockerfile -> template, oracle agent, verifier, reward), from its own venv (.venv-harbor:
  Python >= 3.12, tests/requirements-harbor.txt, installed by scripts/bootstrap.sh --test).

Images come from a local registry seeded with the base root (tests/support/base_image_registry.py):
Docker Hub is not reachable here. One server with a templates directory of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, Template

from forkyard_rl import advantages
from tests.support import REPO, SHARED_TEMPLATES, base_template_missing
from tests.support.base_image_registry import BaseImageRegistry, base_image_registry
from tests.support.server import ServerProcess, serve

pytestmark = pytest.mark.requires_root("the frameworks run gVisor sandboxes and template builds")

ENV_CLASS = "forkyard_rl.integrations.minisweagent.E2BEnvironment"
#: The node's image key (not the default, to show it is a setting), as slime's
#: ``SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY`` would be set.
IMAGE_KEY = "swe.image"
#: A build from the registry image (pull, provision, snapshot) takes ~20-60 s here; a create from
#: the built template restores its snapshot.
FAST_CREATE_SECONDS = 10.0


@pytest.fixture(scope="module")
def registry() -> Iterator[BaseImageRegistry]:
    reason = base_template_missing()
    if reason:
        pytest.skip(reason)
    with base_image_registry(tags=("latest", "slime", "slime-concurrent")) as reg:
        print(f"\nseeding the registry: {reg.seconds:.1f} s")
        yield reg


@pytest.fixture(scope="module")
def server(registry: BaseImageRegistry) -> Iterator[ServerProcess]:
    templates = Path(tempfile.mkdtemp(prefix="forkyard-tpl-", dir="/tmp"))
    (templates / "base").symlink_to(SHARED_TEMPLATES / "base")
    env = {"FORKYARD_TEMPLATES_PATH": str(templates), "FORKYARD_SANDBOX_IMAGE_METADATA_KEY": IMAGE_KEY}
    try:
        with (
            serve(prefix="forkyard-fw-", extra_env=env) as srv,
            pytest.MonkeyPatch.context() as mp,
        ):
            for key, value in srv.sdk_env.items():
                mp.setenv(key, value)
            # mini-swe-agent prints a banner and writes its global config at import.
            mp.setenv("MSWEA_SILENT_STARTUP", "1")
            mp.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(srv.data_dir / "mswea"))
            yield srv
    finally:
        shutil.rmtree(templates, ignore_errors=True)


def _sandboxes(server: ServerProcess) -> list[dict[str, Any]]:
    resp = httpx.get(f"{server.url}/v2/sandboxes", headers=server.headers, timeout=30)
    resp.raise_for_status()
    listed: list[dict[str, Any]] = resp.json()
    return listed


# -- mini-swe-agent ----------------------------------------------------------------------------


def _agent(env: Any, commands: list[str]) -> Any:
    """mini-swe-agent's DefaultAgent with its default config, its DeterministicModel answering
    ``commands`` in turn (one action each)."""
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.models.test_models import DeterministicModel, make_output

    config = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())
    outputs = [make_output(f"step {i}", [{"command": c}]) for i, c in enumerate(commands)]
    agent_config = {**config["agent"], "step_limit": len(commands) + 1, "cost_limit": 0}
    return DefaultAgent(DeterministicModel(outputs=outputs), env, **agent_config)


def test_minisweagent_deterministic_model_submits(server: ServerProcess, registry: BaseImageRegistry) -> None:
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel

    from forkyard_rl.integrations.minisweagent import template_name

    image = registry.image("latest")
    assert not Template.exists(template_name(image, "/testbed"))
    spec = {"environment_class": ENV_CLASS, "image": image, "cwd": "/testbed", "timeout": 20}
    started = time.monotonic()
    env = get_environment(spec)
    print(f"\nfirst environment (template built from the image): {time.monotonic() - started:.1f} s")
    try:
        agent = _agent(
            env,
            [
                "pwd && whoami && cat /etc/debian_version",
                "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && python3 -B -c 'import calc'",
                "sed -i 's/a - b/a + b/' calc.py && python3 -c 'import calc; print(calc.add(2, 3))'",
                "ls /nonexistent",
                "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py",
            ],
        )
        result = agent.run("Fix calc.add")
        assert result["exit_status"] == "Submitted", agent.messages[-3:]
        assert result["submission"] == "def add(a, b):\n    return a + b\n"
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert "<returncode>0</returncode>" in observations[0]
        # As root in the configured cwd, in the image (Debian, as the registry's image is).
        assert "<output>\n/testbed\nroot\n12." in observations[0], observations[0]
        assert "<output>\n5\n</output>" in observations[2], observations[2]
        assert "<returncode>2</returncode>" in observations[3] and "No such file" in observations[3]
        assert isinstance(agent.model, DeterministicModel)
    finally:
        env.cleanup()
    # The image's template is cached: the next environment only creates a sandbox.
    assert Template.exists(template_name(image, "/testbed"))
    started = time.monotonic()
    again = get_environment(spec)
    seconds = time.monotonic() - started
    try:
        print(f"second environment (cached template): {seconds:.2f} s")
        assert seconds < FAST_CREATE_SECONDS
        out = again.execute({"command": "test -e calc.py; echo $?"})
        assert out["output"] == "1\n"  # a fresh sandbox: nothing of the first run
        timed_out = again.execute({"command": "sleep 30"}, timeout=1)
        assert timed_out["returncode"] == -1 and timed_out["exception_info"]
    finally:
        again.cleanup()
    assert not [s for s in _sandboxes(server) if s["sandboxID"] in {env.sandbox.sandbox_id}]


def test_minisweagent_grpo_group_of_8_forks(server: ServerProcess, registry: BaseImageRegistry) -> None:
    """One prepared environment (a repo and a running process) forked into 8; each fork gets its
    own agent with a different action; every result is its own, the parent is untouched."""
    from forkyard_rl.integrations.minisweagent import E2BEnvironment

    prepared = E2BEnvironment(image=registry.image("latest"), cwd="/testbed", timeout=20)
    forks: list[E2BEnvironment] = []
    try:
        setup = _agent(
            prepared,
            [
                "printf 'def f(x):\\n    return x\\n' > task.py && (sleep 600 & echo $! > sleeper.pid)",
                "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && ls",
            ],
        )
        assert setup.run("prepare")["exit_status"] == "Submitted"
        started = time.monotonic()
        forks = prepared.fork(8, sandbox_timeout=300)
        print(f"\nfork into 8: {time.monotonic() - started:.2f} s")
        assert len({f.sandbox.sandbox_id for f in forks}) == 8
        assert prepared.sandbox.sandbox_id not in {f.sandbox.sandbox_id for f in forks}

        def rollout(i: int) -> dict[str, Any]:
            # Different actions per member: member i makes f return x * i, then submits.
            agent = _agent(
                forks[i],
                [
                    f"sed -i 's/return x$/return x * {i}/' task.py && echo {i} > mine-{i}.txt",
                    "kill -0 $(cat sleeper.pid) && echo parent-process-alive",
                    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
                    " && python3 -B -c 'import task; print(task.f(7))' && ls",
                ],
            )
            return dict(agent.run(f"rollout {i}")) | {"observations": agent.messages}

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:  # the group's rollouts run at once
            results = list(pool.map(rollout, range(8)))
        print(f"8 rollouts: {time.monotonic() - started:.2f} s")
        for i, result in enumerate(results):
            assert result["exit_status"] == "Submitted"
            value, *files = result["submission"].split()
            assert int(value) == 7 * i
            # Its own file only: no other member's write reached it.
            assert sorted(files) == sorted(["task.py", "sleeper.pid", f"mine-{i}.txt"]), files
            assert any("parent-process-alive" in str(m.get("content")) for m in result["observations"])
        rewards = [1.0 if int(r["submission"].split()[0]) > 20 else 0.0 for r in results]
        assert advantages(rewards)[0] < 0 < advantages(rewards)[7]
        # The prepared state is as it was.
        assert prepared.execute({"command": "cat task.py && ls"})["output"] == (
            "def f(x):\n    return x\nsleeper.pid\ntask.py\n"
        )
    finally:
        for env in forks:
            env.cleanup()
        prepared.cleanup()
    alive = {s["sandboxID"] for s in _sandboxes(server)}
    assert not alive & {prepared.sandbox.sandbox_id, *(f.sandbox.sandbox_id for f in forks)}


# -- slime's convention: the image in metadata ---------------------------------------------------


async def _slime_create(image: str, key: str = IMAGE_KEY) -> AsyncSandbox:
    """What slime's ``E2BSandbox.__aenter__`` does (``slime/agent/sandbox.py``)."""
    return await AsyncSandbox.create(timeout=600, metadata={key: image})


def test_slime_image_in_metadata_built_once_then_cached(
    server: ServerProcess, registry: BaseImageRegistry
) -> None:
    image = registry.image("slime")

    async def scenario() -> None:
        started = time.monotonic()
        first = await _slime_create(image)
        print(f"\nfirst create (image pulled and built): {time.monotonic() - started:.1f} s")
        try:
            # slime's exec: as root, in the image (Debian, as the registry's image is).
            res = await first.commands.run("id -u && cat /etc/debian_version", user="root")
            assert res.stdout.startswith("0\n12.")
            await first.files.write("/root/mark.txt", "first", user="root")
            info = await first.get_info()
            assert info.metadata == {IMAGE_KEY: image}
            assert info.template_id.startswith("img-")
        finally:
            await first.kill()
        started = time.monotonic()
        second = await _slime_create(image)
        seconds = time.monotonic() - started
        print(f"second create (cached): {seconds:.2f} s")
        try:
            assert seconds < FAST_CREATE_SECONDS
            assert (await second.get_info()).template_id == info.template_id
            assert (await second.commands.run("test -e /root/mark.txt; echo $?", user="root")).stdout == "1\n"
        finally:
            await second.kill()

    asyncio.run(scenario())


def test_slime_concurrent_first_creates_share_one_build(
    server: ServerProcess, registry: BaseImageRegistry
) -> None:
    image = registry.image("slime-concurrent")

    async def scenario() -> list[str]:
        made = await asyncio.gather(*(_slime_create(image) for _ in range(3)))
        try:
            return [(await s.get_info()).template_id for s in made]
        finally:
            await asyncio.gather(*(s.kill() for s in made))

    templates = asyncio.run(scenario())
    assert len(set(templates)) == 1
    builds = httpx.get(f"{server.url}/templates/{templates[0]}", headers=server.headers, timeout=30).json()
    assert len(builds["builds"]) == 1, builds


def test_slime_bad_image_and_ambiguous_requests_get_e2b_errors(
    server: ServerProcess, registry: BaseImageRegistry
) -> None:
    before = {s["sandboxID"] for s in _sandboxes(server)}
    missing = f"{registry.host}/forkyard/no-such-image:v1"
    with pytest.raises(Exception, match="no-such-image"):
        asyncio.run(_slime_create(missing))
    resp = httpx.post(
        f"{server.url}/sandboxes",
        json={"templateID": "base", "metadata": {IMAGE_KEY: missing}},
        headers=server.headers,
        timeout=120,
    )
    assert resp.status_code == 400 and "could not be made into a sandbox template" in resp.json()["message"]
    # An explicit template and an image key: refused, not guessed.
    with pytest.raises(Exception, match="leave the template unset"):
        Sandbox.create("code-interpreter-v1", metadata={IMAGE_KEY: registry.image("latest")})
    resp = httpx.post(
        f"{server.url}/sandboxes",
        json={"templateID": "base", "metadata": {IMAGE_KEY: "has space"}},
        headers=server.headers,
        timeout=60,
    )
    assert resp.status_code == 400 and resp.json()["code"] == 400
    # Other metadata keys stay metadata: a plain create of base.
    plain = Sandbox.create(metadata={"image": registry.image("latest")})
    try:
        assert plain.get_info().template_id == "base"
    finally:
        plain.kill()
    assert {s["sandboxID"] for s in _sandboxes(server)} == before


# -- Harbor ------------------------------------------------------------------------------------

HARBOR = REPO / ".venv-harbor" / "bin" / "harbor"
TASK_TOML = """schema_version = "1.4"

[metadata]

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 600.0
"""


def _harbor_task(root: Path, image: str) -> Path:
    """A local Harbor task: a Dockerfile from the registry's image, an oracle solution, a verifier
    that writes the reward."""
    task = root / "add-numbers"
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "task.toml").write_text(TASK_TOML)
    (task / "instruction.md").write_text(
        "Write the sum of the numbers in /app/input.txt to /app/answer.txt.\n"
    )
    (task / "environment" / "Dockerfile").write_text(
        f"FROM {image}\nRUN mkdir -p /app && echo '2 3' > /app/input.txt\nWORKDIR /app\n"
    )
    (task / "solution" / "solve.sh").write_text(
        "#!/bin/bash\nset -e\npython3 -c \"print(sum(map(int, open('/app/input.txt').read().split())))\""
        " > /app/answer.txt\n"
    )
    (task / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif [ "$(cat /app/answer.txt 2>/dev/null)" = 5 ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n"
    )
    return task


def _harbor_run(server: ServerProcess, task: Path, jobs: Path, agent: str) -> dict[str, Any]:
    """``harbor run`` (its own CLI, its own Python) with its E2B environment; the trial's result."""
    env = {**os.environ, **server.sdk_env, "HOME": str(jobs)}
    cmd = [str(HARBOR), "run", "-p", str(task), "-e", "e2b", "-a", agent, "-o", str(jobs)]
    cmd += ["--job-name", agent, "-n", "1", "-y", "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=jobs)
    results = [
        json.loads(p.read_text())
        for p in (jobs / agent).glob("*/result.json")
        if "verifier_result" in json.loads(p.read_text())
    ]
    assert results, (
        f"harbor run ({proc.returncode}) left no trial result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return results[0]


def test_harbor_e2b_environment_oracle_and_verifier(
    server: ServerProcess, registry: BaseImageRegistry
) -> None:
    if not HARBOR.exists():
        pytest.fail(f"{HARBOR} is missing (scripts/bootstrap.sh --test installs Harbor, Python >= 3.12)")
    root = Path(tempfile.mkdtemp(prefix="forkyard-harbor-"))
    try:
        task = _harbor_task(root, registry.image("latest"))
        started = time.monotonic()
        oracle = _harbor_run(server, task, root, "oracle")
        print(f"\nharbor run, oracle (template build included): {time.monotonic() - started:.1f} s")
        assert oracle["exception_info"] is None, oracle["exception_info"]
        assert oracle["verifier_result"]["rewards"] == {"reward": 1}
        # The do-nothing agent on the same task: the verifier really judges (reward 0).
        started = time.monotonic()
        nop = _harbor_run(server, task, root, "nop")
        print(f"harbor run, nop (template reused): {time.monotonic() - started:.1f} s")
        assert nop["verifier_result"]["rewards"] == {"reward": 0}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert not _sandboxes(server)
