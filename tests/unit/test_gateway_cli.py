"""The cluster roles refuse to start without their shared settings, saying which are missing."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from forkyard.cli.main import app


@pytest.mark.parametrize("command", [["gateway"], ["node", "serve"]])
def test_cluster_roles_need_a_database_and_a_secret(
    command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("FORKYARD_DATABASE_URL", "FORKYARD_NODE_SECRETS"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    assert "FORKYARD_DATABASE_URL" in result.output and "FORKYARD_NODE_SECRETS" in result.output

    monkeypatch.setenv("FORKYARD_DATABASE_URL", "postgresql+asyncpg://forkyard@127.0.0.1:1/x")
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2 and "FORKYARD_NODE_SECRETS" in result.output
    assert "FORKYARD_DATABASE_URL" not in result.output
