"""The frameworks' pieces that need no server: which creates ask for an image by metadata (slime's
convention, forkyard/api/image_sandboxes.py) and the mini-swe-agent environment's names and
submission check (forkyard_rl.integrations.minisweagent). End to end: tests/system/test_frameworks.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkyard.api.image_sandboxes import image_template_name, requested_image
from forkyard.config import Settings
from forkyard.errors import Invalid
from forkyard.storage.templates import split_name
from forkyard_rl.integrations import minisweagent

KEY = "swe.image"


def _settings(key: str = KEY) -> Settings:
    return Settings(sandbox_image_metadata_key=key)


def test_only_a_default_create_with_the_key_asks_for_an_image() -> None:
    image = "registry.example.com/swe/task:1"
    assert requested_image("base", {KEY: image}, _settings()) == image
    assert requested_image("base", {"other": image}, _settings()) is None
    assert requested_image("base", None, _settings()) is None
    # The setting empty: metadata is only metadata.
    assert requested_image("base", {KEY: image}, _settings("")) is None
    assert Settings().sandbox_image_metadata_key == "forkyard.image"


def test_ambiguous_or_malformed_image_requests_are_refused() -> None:
    with pytest.raises(Invalid, match="leave the template unset"):
        requested_image("my-template", {KEY: "img:1"}, _settings())
    for bad in ("", "  ", "two words"):
        with pytest.raises(Invalid, match="OCI image reference"):
            requested_image("base", {KEY: bad}, _settings())


def test_image_template_names_are_stable_valid_and_distinct() -> None:
    a, b = image_template_name("reg/x:1"), image_template_name("reg/x:2")
    assert a == image_template_name("reg/x:1") and a != b
    assert split_name(a) == (a, None) and a.startswith("img-")


def test_minisweagent_template_names_depend_on_image_and_cwd() -> None:
    name = minisweagent.template_name("reg/x:1", "/testbed")
    assert name.startswith("mswea-") and split_name(name) == (name, None)
    assert name != minisweagent.template_name("reg/x:1", "/")
    assert name != minisweagent.template_name("reg/x:2", "/testbed")


def test_minisweagent_submission_marker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # mini-swe-agent prints a banner and makes its global config directory at import.
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path))
    from minisweagent.exceptions import Submitted

    # Not the first line, or a failing command: no submission.
    minisweagent.E2BEnvironment._check_finished(
        {"output": "x\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", "returncode": 0}
    )
    minisweagent.E2BEnvironment._check_finished(
        {"output": "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", "returncode": 1}
    )
    with pytest.raises(Submitted) as raised:
        minisweagent.E2BEnvironment._check_finished(
            {"output": "\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\nthe answer\n", "returncode": 0}
        )
    assert raised.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "the answer\n"}


def test_minisweagent_config_needs_one_source() -> None:
    with pytest.raises(ValueError, match="exactly one of image, template and sandbox_id"):
        minisweagent.E2BEnvironment(image="a", template="b")
    config = minisweagent.E2BEnvironmentConfig(image="a")
    assert config.model_dump()["user"] == "root" and config.model_dump(mode="json")["cwd"] == "/"
