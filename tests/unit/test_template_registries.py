"""Pulling a build's image from a registry that wants credentials: ``from_image(username=,
password=)``, ``from_gcp_registry`` (``_json_key``) and ``from_aws_registry`` (an access key
exchanged for a registry token through ECR's ``GetAuthorizationToken``, served by moto).

The registry (tests/support/auth_registry.py) is Debian's ``docker-registry`` on loopback with
htpasswd authentication, its users the three ways in: ``alice``, Google's ``_json_key`` with a
service account key, and ECR's ``AWS`` user with the token moto's ECR hands out. The image is a
static busybox, so a pull takes about a second. No sandbox and no ``forkyard serve`` here: the
SDK's JSON for these calls goes through ``routes_templates.build_spec`` (the last test), and
tests/system/test_template_cache.py builds from the registry through the SDK.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2b import Template

from forkyard.api.routes_templates import build_spec
from forkyard.api.schemas import TemplateBuildStartV2
from forkyard.config import Settings
from forkyard.errors import Invalid
from forkyard.orchestrator.builder import BuildSpec, RegistryAuth, TemplateBuilder, registry_credentials
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.storage import images
from tests.support import free_port
from tests.support.auth_registry import (
    ECR_TOKEN,
    ECR_USER,
    HELLO,
    PASSWORD,
    SERVICE_ACCOUNT,
    AuthRegistry,
    auth_registry,
)
from tests.support.loopback import LoopbackRuntime
from tests.support.s3 import s3_server


@pytest.fixture(scope="module")
def registry() -> Iterator[AuthRegistry]:
    with auth_registry() as reg:
        yield reg


def _pull(registry: AuthRegistry, auth: RegistryAuth | None, tmp_path: Path) -> images.OciImageConfig:
    username, password = registry_credentials(auth)
    rootfs = tmp_path / "rootfs"
    config = images.pull_image_rootfs(
        registry.image, rootfs, tmp_path / "pull", username=username, password=password
    )
    assert (rootfs / "hello.txt").read_text() == HELLO
    assert not (tmp_path / "pull").exists()  # the auth file went with the pull's work dir
    return config


def test_username_and_password(registry: AuthRegistry, tmp_path: Path) -> None:
    config = _pull(registry, RegistryAuth("registry", "alice", PASSWORD), tmp_path)
    assert config.env.get("PRIVATE_IMAGE") == "yes"


def test_without_or_with_wrong_credentials_the_pull_fails_and_shows_no_secret(
    registry: AuthRegistry, tmp_path: Path
) -> None:
    with pytest.raises(images.ImageError):
        images.pull_image_rootfs(registry.image, tmp_path / "a", tmp_path / "pa")
    wrong = "wrong-password-never-shown"
    with pytest.raises(images.ImageError) as raised:
        images.pull_image_rootfs(
            registry.image, tmp_path / "b", tmp_path / "pb", username="alice", password=wrong
        )
    assert wrong not in raised.value.message and "unauthorized" in raised.value.message.lower()
    assert not (tmp_path / "pb" / "auth.json").exists()


def test_gcp_service_account_is_the_json_key_user(registry: AuthRegistry, tmp_path: Path) -> None:
    auth = RegistryAuth("gcp", service_account_json=json.dumps(SERVICE_ACCOUNT))
    assert registry_credentials(auth) == ("_json_key", json.dumps(SERVICE_ACCOUNT))
    _pull(registry, auth, tmp_path)


def test_aws_access_key_is_exchanged_for_an_ecr_token(
    registry: AuthRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with s3_server() as moto:  # moto's server speaks ECR too
        monkeypatch.setenv("AWS_ENDPOINT_URL_ECR", moto.endpoint)
        auth = RegistryAuth(
            "aws", aws_access_key_id="AKIDFORKYARD", aws_secret_access_key="secret", aws_region="eu-west-1"
        )
        assert registry_credentials(auth) == (ECR_USER, ECR_TOKEN)
        _pull(registry, auth, tmp_path)


def test_aws_without_a_reachable_ecr_is_an_image_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_ECR", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    secret = "aws-secret-never-shown"
    auth = RegistryAuth("aws", aws_access_key_id="A", aws_secret_access_key=secret, aws_region="us-east-1")
    with pytest.raises(images.ImageError) as raised:
        registry_credentials(auth)
    assert secret not in raised.value.message and "ECR" in raised.value.message


def test_registry_specs_need_their_fields(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    builder = TemplateBuilder(settings, RuntimeSet(settings, LoopbackRuntime(settings)), None)
    for good in (
        RegistryAuth("registry", "u", "p"),
        RegistryAuth("aws", aws_access_key_id="a", aws_secret_access_key="s", aws_region="r"),
        RegistryAuth("gcp", service_account_json="{}"),
    ):
        builder.check_spec(BuildSpec(from_image="x/y", registry=good))
    for bad in (
        RegistryAuth("aws", aws_access_key_id="a"),
        RegistryAuth("gcp", service_account_json="not json"),
        RegistryAuth("azure", "u", "p"),
    ):
        with pytest.raises(Invalid):
            builder.check_spec(BuildSpec(from_image="x/y", registry=bad))
    assert "pw-secret" not in repr(RegistryAuth("registry", "u", "pw-secret"))


def _spec_of(template: Any) -> BuildSpec:
    """What the API makes of the JSON the official SDK sends for ``template``."""
    return build_spec(TemplateBuildStartV2.model_validate_json(Template.to_json(template)))


def test_the_sdks_registry_calls_map_to_their_credentials() -> None:
    aws = _spec_of(
        Template().from_aws_registry(
            "123456789012.dkr.ecr.eu-west-1.amazonaws.com/app:1",
            access_key_id="AKID",
            secret_access_key="SECRET",
            region="eu-west-1",
        )
    ).registry
    assert aws is not None and aws.type == "aws"
    assert (aws.aws_access_key_id, aws.aws_secret_access_key, aws.aws_region) == (
        "AKID",
        "SECRET",
        "eu-west-1",
    )
    gcp = _spec_of(
        Template().from_gcp_registry("gcr.io/p/app:1", service_account_json=SERVICE_ACCOUNT)
    ).registry
    assert gcp is not None and registry_credentials(gcp) == ("_json_key", json.dumps(SERVICE_ACCOUNT))
    basic = _spec_of(Template().from_image("reg.example/app:1", username="u", password="p")).registry
    assert basic is not None and registry_credentials(basic) == ("u", "p")
