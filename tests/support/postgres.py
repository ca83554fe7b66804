"""A real PostgreSQL for the registry tests and benchmarks: Debian's ``postgresql-15`` binaries
(scripts/bootstrap.sh installs them), a throwaway cluster in a temporary directory on a free
loopback port, its unix socket in that directory too, trust authentication for one role.

    with postgres_cluster() as pg:
        url = pg.new_database()     # postgresql+asyncpg://forkyard@127.0.0.1:<port>/<name>

PostgreSQL refuses to run as root: as root the cluster belongs to the ``postgres`` system user.
The ``postgres`` fixture (session-scoped, a pytest plugin of tests/conftest.py) shares one cluster
per test run and skips, saying why, where the binaries are missing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import free_port

BIN = Path(os.environ.get("FORKYARD_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
ROLE = "forkyard"


def missing() -> str | None:
    """Why no cluster can be made here (None: it can)."""
    for tool in ("initdb", "pg_ctl", "postgres", "createdb"):
        if not (BIN / tool).is_file():
            return f"PostgreSQL binaries missing: no {BIN / tool} (apt-get install postgresql-15)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run PostgreSQL as"
    return None


@dataclass
class PostgresCluster:
    port: int
    socket_dir: Path
    log_path: Path
    data_dir: Path | None = None
    #: ``postgres`` options the cluster was started with (``start`` starts it with them again).
    options: str = ""

    def url(self, database: str = ROLE) -> str:
        return f"postgresql+asyncpg://{ROLE}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        """Stop the server as an operator's restart does (``-m fast``: sessions are terminated)."""
        assert self.data_dir is not None
        _run([str(BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop"])

    def start(self) -> None:
        assert self.data_dir is not None
        _start(self.data_dir, self.log_path, self.options)

    def new_database(self) -> str:
        """A new, empty database's URL (tests that need their own registry)."""
        name = f"t_{secrets.token_hex(6)}"
        _run([str(BIN / "createdb"), "-h", str(self.socket_dir), "-p", str(self.port), "-U", ROLE, name])
        return self.url(name)


def _as_postgres() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _run(argv: list[str]) -> None:
    done = subprocess.run([*_as_postgres(), *argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{argv[0]} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
        )


@contextlib.contextmanager
def postgres_cluster(*, durable: bool = False) -> Iterator[PostgresCluster]:
    """Start a cluster, yield it, stop and remove it. ``durable``: keep fsync on (benchmarks);
    tests turn it off, a crash of the test cluster loses nothing of value."""
    reason = missing()
    if reason:
        raise RuntimeError(reason)
    root = Path(tempfile.mkdtemp(prefix="forkyard-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, log_path, port = root / "data", root / "postgres.log", free_port()
    try:
        _run([str(BIN / "initdb"), "-D", str(data), "-U", ROLE, "--auth=trust", "-E", "UTF8", "--no-sync"])
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        _start(data, log_path, options)
        try:
            cluster = PostgresCluster(port, root, log_path, data, options)
            _run([str(BIN / "createdb"), "-h", str(root), "-p", str(port), "-U", ROLE, ROLE])
            yield cluster
        finally:
            _run([str(BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _start(data: Path, log_path: Path, options: str) -> None:
    pg_ctl = [str(BIN / "pg_ctl"), "-D", str(data), "-l", str(log_path), "-o", options]
    _run([*pg_ctl, "-w", "-t", "60", "start"])


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    with postgres_cluster() as cluster:
        yield cluster


#: The registry backends store tests run against.
BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty registry database's URL: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'registry.sqlite3'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres")
    return cluster.new_database()


@pytest.fixture(params=BACKENDS)
def registry_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every ``Settings`` the test makes uses this backend: the default SQLite file, or a new
    PostgreSQL database (``FORKYARD_DATABASE_URL``). Use with ``pytest.mark.usefixtures``."""
    if request.param == "postgresql":
        cluster: PostgresCluster = request.getfixturevalue("postgres")
        monkeypatch.setenv("FORKYARD_DATABASE_URL", cluster.new_database())
    else:
        monkeypatch.delenv("FORKYARD_DATABASE_URL", raising=False)
    return str(request.param)
