"""The Compose cluster of deploy/compose run for real on this host's Docker engine (Debian's
docker.io and docker-compose 1.29): the images built on a Debian base made here
(``scripts/docker.sh images``), ``docker-compose.yml`` + ``docker-compose.local.yml`` (PostgreSQL
and the S3 server from local images) + a test override written here (the host's template cache
mounted, short heartbeats, a free gateway port, node b's data on a small tmpfs so its
disk can be filled).

    with compose_cluster() as cluster:
        Sandbox.create(**cluster.sdk)

Waits are on Docker's events (``docker events``), not sleeps. On the way out everything is
taken down (``down -v``) and what it left on the host is returned by :func:`host_footprint`.
No pytest here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support import REPO, SHARED_TEMPLATES, free_port

DOCKER = "/usr/bin/docker"  # Debian's client: the machine image may carry another on PATH
COMPOSE = "/usr/bin/docker-compose"
COMPOSE_DIR = REPO / "deploy/compose"
API_KEY = "e2b_compose0000000000000000000000000000000"
NODE_SECRET = "compose-test-node-secret-0123456789"
POSTGRES_PASSWORD = "compose-test-pg"
HEARTBEAT_S = 1
LOST_AFTER_S = 6
#: Node a's room (a fork of its sandbox spills onto b); node b's data dir (a tmpfs volume).
A_MAX_SANDBOXES = 2
B_DISK = "2g"
#: runsc's container id is the sandbox id behind this prefix (forkyard.runtime.network's NETNS_PREFIX).
RUNSC_ID_PREFIX = "ae-"
SERVICES = ("gateway", "node-a", "node-b", "postgres", "s3")


def docker_missing() -> str | None:
    """Why the Compose cluster cannot run here (None: it can)."""
    for tool in (DOCKER, COMPOSE, "/usr/sbin/dockerd"):
        if not Path(tool).is_file():
            return f"{tool} is missing (scripts/bootstrap.sh --test installs docker.io and docker-compose)"
    if not (SHARED_TEMPLATES / "base" / ".complete").is_file():
        return f"the base template is not built in {SHARED_TEMPLATES}"
    return None


def engine_refused() -> str | None:
    """Start Debian's engine unless one answers (``scripts/docker.sh daemon-up``); why it cannot
    run on this machine (None: it runs), e.g. in a container without the rights dockerd needs."""
    done = subprocess.run(
        [str(REPO / "scripts/docker.sh"), "daemon-up"], capture_output=True, text=True, timeout=180
    )
    if done.returncode != 0:
        return f"Docker's engine cannot run here: {done.stderr.strip()[-600:]}"
    return None


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done


def build_images() -> float:
    """``scripts/docker.sh images`` (dockerd started if none answers, the base made once, layers
    cached); returns its wall time in seconds."""
    started = time.monotonic()
    done = subprocess.run(
        [str(REPO / "scripts/docker.sh"), "images"], capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(f"scripts/docker.sh images failed:\n{done.stderr[-4000:]}")
    return time.monotonic() - started


def test_override(gateway_port: int) -> dict[str, object]:
    """What the tests change of the cluster: no template build (the host's cache),
    short heartbeats, a's room, b's small disk, no warm pools (the machine is shared)."""
    common = {
        "FORKYARD_NODE_HEARTBEAT_SECONDS": str(HEARTBEAT_S),
        "FORKYARD_NODE_LOST_AFTER_SECONDS": str(LOST_AFTER_S),
    }
    node_env = {
        **common,
        "FORKYARD_TEMPLATES_PATH": "/templates",
        "FORKYARD_WARM_POOL_HIGH": "0",
        "FORKYARD_SNAPSHOT_STANDBYS": "0",
        "FORKYARD_S3__REGION": "us-east-1",
        "FORKYARD_S3__UPLOAD_TEMPLATES": "false",
    }
    serve = ["forkyard-node-init", "forkyard", "node", "serve", "--host", "0.0.0.0", "--port", "3000"]
    # The shared cache, as every test server uses it (its lock files and sweeps need it writable).
    templates = f"{SHARED_TEMPLATES}:/templates"

    def node(extra: dict[str, str], data: str) -> dict[str, object]:
        return {
            "entrypoint": serve,
            "environment": {**node_env, **extra},
            "volumes": [templates, f"{data}:/var/lib/forkyard"],
            "healthcheck": {"interval": "2s", "start_period": "120s"},
        }

    return {
        "services": {
            "gateway": {"environment": common, "healthcheck": {"interval": "2s"}},
            "node-a": node({"FORKYARD_MAX_SANDBOXES": str(A_MAX_SANDBOXES)}, "node-a-data"),
            "node-b": node({}, "node-b-data"),
            "postgres": {"healthcheck": {"interval": "1s"}},
            "s3": {"healthcheck": {"interval": "1s"}},
        },
        "volumes": {
            "node-b-data": {"driver_opts": {"type": "tmpfs", "device": "tmpfs", "o": f"size={B_DISK}"}}
        },
    }


@dataclass
class ComposeCluster:
    project: str
    files: list[Path]
    gateway_port: int

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "FORKYARD_GATEWAY_PORT": str(self.gateway_port),
            "E2B_API_KEY": API_KEY,
            "FORKYARD_NODE_SECRET": NODE_SECRET,
            "POSTGRES_PASSWORD": POSTGRES_PASSWORD,
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def sdk(self) -> dict[str, str]:
        return {"api_key": API_KEY, "api_url": self.url, "sandbox_url": self.url}

    def compose(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [COMPOSE, "-p", self.project, *(a for f in self.files for a in ("-f", str(f))), *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(args)}: {done.stderr.strip()[-4000:]}")
        return done

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def sql(self, query: str) -> list[list[str]]:
        """Rows of ``query`` on the registry, through psql in the postgres container."""
        argv = ["exec", self.container("postgres"), "psql", "-U", "forkyard", "-d", "forkyard"]
        done = docker(*argv, "-AtF", "\t", "-c", query, timeout=60)
        return [line.split("\t") for line in done.stdout.splitlines() if line]

    def owner(self, sandbox_id: str) -> str:
        found = self.sql(f"SELECT node_id FROM sandboxes WHERE sandbox_id = '{sandbox_id}'")
        assert found, f"{sandbox_id} has no registry row"
        return found[0][0]

    def health(self, service: str) -> str:
        fmt = "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}"
        return docker("inspect", "-f", fmt, self.container(service), check=False).stdout.strip()

    def wait_healthy(self, services: tuple[str, ...], since: float, timeout: float = 600) -> None:
        """Until every service's container reports healthy: Docker's health_status events since
        ``since`` (a Unix time before the start), so none is missed between start and watch."""
        names = {self.container(s): s for s in services}
        waiting = {c for c in names if self.health(names[c]) != "healthy"}
        if not waiting:
            return
        argv = [DOCKER, "events", "--since", str(int(since) - 1), "--format", "{{json .}}"]
        argv += [
            "--filter",
            "event=health_status",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
        ]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as events:
            assert events.stdout is not None
            deadline = time.monotonic() + timeout
            try:
                with _alarm(timeout, events):
                    for line in events.stdout:
                        attrs = json.loads(line).get("Actor", {}).get("Attributes", {})
                        if json.loads(line).get("status", "").endswith(": healthy"):
                            waiting.discard(attrs.get("name", ""))
                        if not waiting or time.monotonic() > deadline:
                            break
            finally:
                events.kill()
        assert not waiting, f"not healthy in {timeout} s: {sorted(waiting)}\n{self.logs()}"

    def logs(self, *services: str, tail: int = 60) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), *services, check=False).stdout

    def sandboxes_in(self, service: str) -> set[str]:
        """Sandbox ids runsc runs in a node's container (its ``runsc-sandbox`` processes)."""
        done = docker("exec", self.container(service), "ps", "-eo", "args", "--no-headers", check=False)
        ids = set()
        for line in done.stdout.splitlines():
            words = line.split()
            if words and words[0].endswith("runsc-sandbox") and "boot" in words:
                ids.add(words[-1].removeprefix(RUNSC_ID_PREFIX))
        return ids


@contextlib.contextmanager
def _alarm(seconds: float, proc: subprocess.Popen[str]) -> Iterator[None]:
    """Ends ``proc`` after ``seconds`` (its output loop then ends): a wait on events never hangs."""
    import threading

    timer = threading.Timer(seconds, proc.kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def compose_cluster() -> Iterator[ComposeCluster]:
    project = "fytest" + secrets.token_hex(3)
    workdir = Path(tempfile.mkdtemp(prefix="fy-compose-"))
    override = workdir / "docker-compose.test.yml"
    port = free_port()
    override.write_text(yaml.safe_dump(test_override(port)))
    files = [COMPOSE_DIR / "docker-compose.yml", COMPOSE_DIR / "docker-compose.local.yml", override]
    cluster = ComposeCluster(project, files, port)
    try:
        since = time.time()
        cluster.compose("up", "-d", "--no-build", timeout=900)
        cluster.wait_healthy(("gateway", "node-a", "node-b"), since)
        yield cluster
    finally:
        cluster.compose("down", "-v", "--remove-orphans", "--timeout", "60", timeout=600, check=False)
        override.unlink()
        workdir.rmdir()


def daemon_down() -> list[str]:
    """Stop the dockerd ``scripts/docker.sh`` started (none other) and remove the iptables chains
    it leaves; returns Docker chains still on the host after that (none when it stopped ours)."""
    subprocess.run([str(REPO / "scripts/docker.sh"), "daemon-down"], check=True, timeout=180)
    if (
        subprocess.run([DOCKER, "version", "--format", "{{.Server.Version}}"], capture_output=True).returncode
        == 0
    ):
        return []  # someone else's engine runs: its chains are its own
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    return [line for line in rules.splitlines() if "DOCKER" in line or "docker0" in line]


def host_footprint(project: str) -> list[str]:
    """What a project left on the host: containers, networks, volumes (by Compose's project
    label), mounts of its volumes, processes of its containers."""
    label = f"label=com.docker.compose.project={project}"
    left = [f"container {c}" for c in docker("ps", "-aq", "--filter", label).stdout.split()]
    left += [f"network {n}" for n in docker("network", "ls", "-q", "--filter", label).stdout.split()]
    left += [f"volume {v}" for v in docker("volume", "ls", "-q", "--filter", label).stdout.split()]
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    left += [f"mount {m.split()[4]}" for m in mounts if f"/{project}_" in m]
    return left
