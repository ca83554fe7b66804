"""The deployment files (Dockerfile, deploy/compose, deploy/k8s, deploy/systemd) are checked, not
deployed: there is no Docker engine or Kubernetes cluster here. Each check reads a tree, so the
same checks that pass on the repository are shown to fail on a deliberately broken copy of it.

* Kubernetes manifests against the Kubernetes schema (``kubernetes-validate``, schemas bundled,
  no network; strict: unknown fields fail), kustomizations resolve and their patches apply.
* The compose file against the compose-spec JSON schema (the copy ``check-jsonschema`` vendors,
  Apache-2.0, licence in its ``builtin_schemas/vendor/licenses/LICENSE.compose-spec``).
* systemd units with ``systemd-analyze verify`` (any diagnostic fails).
* The Dockerfile parsed (``dockerfile-parse``): its apt packages exist in Debian's index, its
  runsc pin is bootstrap's, its pip lock agrees with pyproject.toml's pins.
* Every ``FORKYARD_*`` variable any of them sets is a real :class:`forkyard.config.Settings`
  field, and the values parse (catches drift between the manifests and the code).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import jsonschema
import kubernetes_validate
import pydantic
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from forkyard.config import Settings
from tests.support import free_port

REPO = Path(__file__).resolve().parents[2]
#: Oldest and newest Kubernetes releases the manifests are checked against.
K8S_VERSIONS = ("1.29", "1.37")
#: Where the units expect the repository (they name /opt/forkyard/.venv/bin/forkyard).
UNIT_PREFIX = "/opt/forkyard"
#: bootstrap.sh packages the image leaves out: build- and test-only (make proto, test helpers,
#: the tests' own PostgreSQL server: a cluster uses its own).
NOT_IN_IMAGE_APT = {"gcc", "libc6-dev", "protobuf-compiler", "postgresql-15"}
#: Stand-ins for values the orchestrator fills in (Kubernetes downward API).
DOWNWARD_API = {"status.podIP": "10.0.0.7", "spec.nodeName": "worker-1"}

Problems = list[str]


# -- Settings drift ------------------------------------------------------------------------------


def settings_problems(env: dict[str, str], where: str) -> Problems:
    """Every FORKYARD_ name must be a Settings field (pydantic-settings ignores unknown ones
    silently) and the values, as the process would see them, must parse."""
    problems = [f"{where}: {name} is no Settings field" for name in env if not _is_field(name)]
    with _environment({k: v for k, v in env.items() if k.startswith("FORKYARD_")}):
        try:
            Settings()
        except pydantic.ValidationError as exc:
            problems.append(f"{where}: settings do not parse: {exc}")
    return problems


def _is_field(name: str) -> bool:
    if not name.startswith("FORKYARD_"):
        return True  # not ours (POSTGRES_PASSWORD, K8S_NODE_NAME, ...)
    top, _, nested = name.removeprefix("FORKYARD_").lower().partition("__")
    field = Settings.model_fields.get(top)
    if field is None:
        return False
    if not nested:
        return True
    model = field.annotation
    return isinstance(model, type) and issubclass(model, pydantic.BaseModel) and nested in model.model_fields


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("FORKYARD_")}
    for key in saved:
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(saved)


# -- Kubernetes ----------------------------------------------------------------------------------


def k8s_documents(root: Path) -> dict[Path, list[dict[str, Any]]]:
    """The resources of every manifest under deploy/k8s (kustomizations are not resources)."""
    files = sorted(p for p in (root / "deploy/k8s").rglob("*.yaml") if p.name != "kustomization.yaml")
    return {p: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in files}


def k8s_schema_problems(root: Path) -> Problems:
    problems: Problems = []
    for path, docs in k8s_documents(root).items():
        for doc in docs:
            problems += _validate_resource(doc, f"{path.relative_to(root)}: {_kind_name(doc)}")
    return problems


def _validate_resource(doc: dict[str, Any], where: str) -> Problems:
    problems: Problems = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{where} (Kubernetes {version}): {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{where}: no schema for {doc.get('apiVersion')}/{doc.get('kind')}")
    return problems


def _kind_name(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def kustomize_problems(root: Path) -> Problems:
    """Every resource a kustomization names exists, every manifest is named by one, and every
    JSON 6902 patch applies to its target and leaves it valid."""
    problems: Problems = []
    named: set[Path] = set()
    for kfile in sorted((root / "deploy/k8s").rglob("kustomization.yaml")):
        kust = yaml.safe_load(kfile.read_text())
        for entry in kust.get("resources", []):
            target = (kfile.parent / entry).resolve()
            if not target.exists():
                problems.append(f"{kfile.relative_to(root)}: resource {entry} does not exist")
            named.add(target)
        problems += _patch_problems(kfile, kust, root)
    for path in k8s_documents(root):
        if path.resolve() not in named:
            problems.append(f"{path.relative_to(root)}: named by no kustomization.yaml")
    return problems


def _patch_problems(kfile: Path, kust: dict[str, Any], root: Path) -> Problems:
    problems: Problems = []
    resources = _kustomize_resources(kfile.parent)
    for patch in kust.get("patches", []):
        target = patch["target"]
        matches = [
            d for d in resources if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]
        ]
        where = f"{kfile.relative_to(root)}: patch of {target['kind']}/{target['name']}"
        if len(matches) != 1:
            problems.append(f"{where}: targets {len(matches)} resources")
            continue
        try:
            patched = jsonpatch.apply_patch(matches[0], yaml.safe_load(patch["patch"]))
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            problems.append(f"{where}: does not apply: {exc}")
            continue
        problems += _validate_resource(patched, where)
    return problems


def _kustomize_resources(directory: Path) -> list[dict[str, Any]]:
    """The resources a kustomization directory gathers (its files and those of the bases)."""
    docs: list[dict[str, Any]] = []
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    for entry in kust.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs += _kustomize_resources(path)
        elif path.exists():
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def k8s_env_problems(root: Path) -> Problems:
    """The environment each container of the base would get, checked against Settings."""
    base_dir = root / "deploy/k8s/base"
    base = [d for path, ds in k8s_documents(root).items() if path.parent == base_dir for d in ds]
    config = {d["metadata"]["name"]: d.get("data", {}) for d in base if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"]: d.get("stringData", {}) for d in base if d["kind"] == "Secret"}
    problems: Problems = []
    for doc in base:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            where = f"{_kind_name(doc)} container {container['name']}"
            try:
                env = _container_env(container, config, secrets)
            except KeyError as exc:
                problems.append(f"{where}: refers to a missing ConfigMap/Secret key {exc}")
                continue
            problems += settings_problems(env, where)
    return problems


def _container_env(
    container: dict[str, Any], config: dict[str, dict[str, str]], secrets: dict[str, dict[str, str]]
) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        env[var["name"]] = _env_value(var, config, secrets, env)
    return env


def _env_value(
    var: dict[str, Any],
    config: dict[str, dict[str, str]],
    secrets: dict[str, dict[str, str]],
    env: dict[str, str],
) -> str:
    if "value" in var:  # $(NAME) expands earlier variables, as the kubelet does
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], str(var["value"]))
    ref = var["valueFrom"]
    if "fieldRef" in ref:
        return DOWNWARD_API[ref["fieldRef"]["fieldPath"]]
    if "secretKeyRef" in ref:
        return secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
    return config[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]


# -- Compose -------------------------------------------------------------------------------------

COMPOSE_FILE = "deploy/compose/docker-compose.yml"


def compose_schema() -> dict[str, Any]:
    vendored = importlib.resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    schema: dict[str, Any] = json.loads(vendored.read_text())
    return schema


def compose_problems(root: Path) -> Problems:
    compose = yaml.safe_load((root / COMPOSE_FILE).read_text())
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    problems = [
        f"{COMPOSE_FILE}: {e.message} at {list(e.absolute_path)}" for e in validator.iter_errors(compose)
    ]
    if problems:
        return problems
    services = compose["services"]
    for name, service in services.items():
        env = {k: _interpolate(str(v)) for k, v in (service.get("environment") or {}).items()}
        problems += settings_problems(env, f"{COMPOSE_FILE} service {name}")
        problems += _compose_url_problems(name, env, set(services))
    for required in ("gateway", "node-a", "node-b", "postgres", "s3"):
        if required not in services:
            problems.append(f"{COMPOSE_FILE}: no service {required}")
    return problems


def _interpolate(value: str) -> str:
    """Compose's ``${NAME:-default}`` with nothing set (the defaults apply), ``$$`` -> ``$``."""
    value = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", value)
    return value.replace("$$", "$")


def _compose_url_problems(service: str, env: dict[str, str], services: set[str]) -> Problems:
    """URLs between containers must name a service of the file (its DNS name on the network)."""
    problems: Problems = []
    for key in ("FORKYARD_DATABASE_URL", "FORKYARD_NODE_URL", "FORKYARD_S3__ENDPOINT_URL"):
        if key in env:
            host = re.sub(r"^[a-z+]+://(?:[^@/]*@)?([^:/]+).*$", r"\1", env[key])
            if host not in services:
                problems.append(f"{COMPOSE_FILE} service {service}: {key} names host {host}, no service")
    return problems


# -- systemd -------------------------------------------------------------------------------------


def systemd_problems(root: Path, scratch: Path) -> Problems:
    """``systemd-analyze verify`` on the units as installed from a checkout at ``root`` (it checks
    that ExecStart's binary exists); it exits 0 on unknown keys and bad values, so any output fails."""
    units = sorted((root / "deploy/systemd").glob("*.service"))
    scratch.mkdir(parents=True, exist_ok=True)
    for unit in units:
        (scratch / unit.name).write_text(unit.read_text().replace(UNIT_PREFIX, str(REPO)))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(str(scratch / u.name) for u in units)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = (result.stdout + result.stderr).strip()
    problems = [f"systemd-analyze verify: {line}" for line in output.splitlines()]
    if result.returncode != 0 and not problems:
        problems.append(f"systemd-analyze verify exited {result.returncode}")
    return problems + _unit_env_problems(root, units)


def _unit_env_problems(root: Path, units: list[Path]) -> Problems:
    """``Environment=`` of each unit plus the example EnvironmentFile it names, as Settings."""
    problems: Problems = []
    for unit in units:
        text = unit.read_text()
        env = dict(re.findall(r"^Environment=([A-Z0-9_]+)=(.*)$", text, re.M))
        for env_file in re.findall(r"^EnvironmentFile=-?/etc/forkyard/(\S+)\.env$", text, re.M):
            example = root / "deploy/systemd" / f"{env_file}.env.example"
            if not example.exists():
                problems.append(f"{unit.name}: no example {example.relative_to(root)}")
                continue
            env.update(_read_env_file(example))
        problems += settings_problems(env, unit.name)
    return problems


def _read_env_file(path: Path) -> dict[str, str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


# -- Dockerfile ----------------------------------------------------------------------------------


def dockerfile_instructions(root: Path) -> list[dict[str, Any]]:
    parser = DockerfileParser(str(root / "Dockerfile"))
    return [i for i in parser.structure if i["instruction"] != "COMMENT"]


def dockerfile_apt_packages(root: Path) -> dict[str, str | None]:
    """Package -> pinned version (None: any) of every ``apt-get install`` in a RUN."""
    instructions = dockerfile_instructions(root)
    args = {
        k: v for i in instructions if i["instruction"] == "ARG" for k, _, v in [i["value"].partition("=")]
    }
    packages: dict[str, str | None] = {}
    for run in (i["value"] for i in instructions if i["instruction"] == "RUN"):
        for command in re.split(r"&&|;", run):
            words = command.split()
            if words[:1] == ["DEBIAN_FRONTEND=noninteractive"]:
                words = words[1:]
            if words[:2] != ["apt-get", "install"]:
                continue
            for word in (w.strip("\"'") for w in words[2:] if not w.startswith("-")):
                name, _, version = re.sub(r"\$(\w+)", lambda m: args.get(m.group(1), ""), word).partition("=")
                packages[name] = version or None
    return packages


def apt_problems(root: Path) -> Problems:
    """Each package (at its pinned version) in Debian's index: one ``apt-cache show`` for all
    (it prints what it finds and complains about the rest)."""
    packages = dockerfile_apt_packages(root)
    if not packages:
        return ["Dockerfile: installs no apt packages"]
    specs = [f"{name}={version}" if version else name for name, version in packages.items()]
    result = subprocess.run(["apt-cache", "show", *specs], capture_output=True, text=True, timeout=120)
    found = {_stanza_id(stanza) for stanza in result.stdout.split("\n\n") if stanza.strip()}
    names = {name for name, _ in found}
    return [
        f"Dockerfile: {name}{'=' + version if version else ''} is not in Debian's index"
        for name, version in packages.items()
        if (name, version) not in found and (version or name not in names)
    ]


def _stanza_id(stanza: str) -> tuple[str, str]:
    fields = dict(re.findall(r"^(Package|Version): (\S+)$", stanza, re.M))
    return fields.get("Package", ""), fields.get("Version", "")


def bootstrap_problems(root: Path) -> Problems:
    """The image installs what bootstrap.sh installs for running, and bootstrap's runsc build."""
    packages = dockerfile_apt_packages(root)
    bootstrap = (root / "scripts/bootstrap.sh").read_text()
    listed = re.search(r"APT_PACKAGES=\(([^)]*)\)", bootstrap)
    runtime = set(listed.group(1).split() if listed else []) - NOT_IN_IMAGE_APT
    problems = [
        f"Dockerfile: bootstrap.sh installs {p}, the image does not" for p in sorted(runtime - set(packages))
    ]
    pin = re.search(r'\[bookworm\]="([^"]+)"', bootstrap)
    if pin is None or packages.get("runsc") != pin.group(1):
        problems.append(f"Dockerfile: runsc={packages.get('runsc')}, bootstrap pins {pin and pin.group(1)}")
    return problems


def dockerfile_problems(root: Path) -> Problems:
    instructions = dockerfile_instructions(root)
    values = {i["instruction"]: i["value"] for i in instructions}
    problems: Problems = []
    base = values.get("FROM", "")
    if base == "${BASE_IMAGE}":  # the default of the ARG before FROM
        base = dict(_arg_pairs(instructions)).get("BASE_IMAGE", base)
    if not base.startswith("debian:12"):
        problems.append(f"Dockerfile: base {base} is not Debian 12")
    if json.loads(values.get("ENTRYPOINT", "null")) != ["forkyard"]:
        problems.append(f"Dockerfile: ENTRYPOINT {values.get('ENTRYPOINT')} is not forkyard")
    if json.loads(values.get("CMD", "null")) != ["serve", "--host", "0.0.0.0"]:
        problems.append(f"Dockerfile: CMD {values.get('CMD')} is not serve --host 0.0.0.0")
    for copy in (i["value"].split() for i in instructions if i["instruction"] == "COPY"):
        problems += [
            f"Dockerfile: COPY source {src} does not exist" for src in copy[:-1] if not (root / src).exists()
        ]
    lines = (root / ".dockerignore").read_text().splitlines()
    ignored = {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}
    for copy in (i["value"].split() for i in instructions if i["instruction"] == "COPY"):
        problems += [
            f".dockerignore excludes {src}, which the Dockerfile copies"
            for src in copy[:-1]
            if src in ignored
        ]
    return problems + settings_problems(_dockerfile_env(instructions), "Dockerfile ENV")


def _arg_pairs(instructions: list[dict[str, Any]]) -> list[tuple[str, str]]:
    args = (i["value"] for i in instructions if i["instruction"] == "ARG")
    return [(name, default) for name, _, default in (a.partition("=") for a in args)]


def _dockerfile_env(instructions: list[dict[str, Any]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in (i["value"] for i in instructions if i["instruction"] == "ENV"):
        env.update(pair.split("=", 1) for pair in value.split())
    return env


def lock_problems(root: Path) -> Problems:
    """The image installs with ``-c requirements.lock``: a direct pin the lock contradicts fails
    the build, one it lacks is unpinned below (deploy/docker/update-lock.sh regenerates it)."""
    lines = (root / "deploy/docker/requirements.lock").read_text().splitlines()
    lock = {_norm(n): v for n, _, v in (ln.partition("==") for ln in lines if ln and not ln.startswith("#"))}
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    problems: Problems = []
    for dep in deps:
        name, _, version = re.sub(r"\[.*\]", "", dep).partition("==")
        if not version:
            problems.append(f"pyproject.toml: {dep} is not pinned exactly")
        elif lock.get(_norm(name)) != version:
            problems.append(
                f"requirements.lock: {name}=={lock.get(_norm(name))}, pyproject.toml pins {version}"
                " (run deploy/docker/update-lock.sh)"
            )
    return problems


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- the tests -----------------------------------------------------------------------------------


def test_kubernetes_manifests_validate_against_the_schema() -> None:
    documents = k8s_documents(REPO)
    kinds = {_kind_name(d) for ds in documents.values() for d in ds}
    assert {"DaemonSet/forkyard-node", "Deployment/forkyard-gateway", "Service/forkyard-gateway"} <= kinds
    assert {"Secret/forkyard-secrets", "Namespace/forkyard", "ConfigMap/forkyard-config"} <= kinds
    assert k8s_schema_problems(REPO) == []


def test_kustomizations_resolve_and_their_patches_apply() -> None:
    assert kustomize_problems(REPO) == []


def test_kubernetes_environment_is_made_of_settings() -> None:
    assert k8s_env_problems(REPO) == []


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed here")
def test_kustomize_renders_every_variant_into_valid_resources() -> None:
    """The real kustomize (kubectl's), where a kubectl is installed: not part of the project."""
    for variant in ("deploy/k8s", "deploy/k8s/overlays/kvm", "deploy/k8s/overlays/dev"):
        rendered = subprocess.run(
            ["kubectl", "kustomize", str(REPO / variant)], capture_output=True, text=True, timeout=60
        )
        assert rendered.returncode == 0, rendered.stderr
        docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
        problems = [p for d in docs for p in _validate_resource(d, f"{variant}: {_kind_name(d)}")]
        assert problems == []
        assert all(d["metadata"].get("namespace", "forkyard") == "forkyard" for d in docs)


def test_compose_file_validates_and_its_environment_is_made_of_settings() -> None:
    assert compose_problems(REPO) == []


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path: Path) -> None:
    units = {p.name for p in (REPO / "deploy/systemd").glob("*.service")}
    assert units == {"forkyard.service", "forkyard-node.service", "forkyard-gateway.service"}
    assert systemd_problems(REPO, tmp_path / "units") == []


def test_dockerfile_parses_and_matches_bootstrap() -> None:
    assert dockerfile_problems(REPO) == []
    assert bootstrap_problems(REPO) == []
    assert lock_problems(REPO) == []


@pytest.mark.skipif(shutil.which("apt-cache") is None, reason="apt-cache is not installed (not Debian)")
def test_dockerfile_apt_packages_exist_in_debian() -> None:
    if not any(Path("/var/lib/apt/lists").glob("*_Packages*")):
        pytest.skip("no apt lists here: run apt-get update (scripts/bootstrap.sh does when it installs)")
    assert apt_problems(REPO) == []


def test_the_images_install_carries_the_whole_package(tmp_path: Path) -> None:
    """The image installs a wheel (not an editable checkout): every file of forkyard/ but docs must
    be in it (package data such as the Alembic migrations' template is easily missed)."""
    src = tmp_path / "src"  # what the Dockerfile copies
    shutil.copytree(
        REPO / "forkyard", src / "forkyard", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
    ]
    built = subprocess.run(
        [*pip, "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("forkyard-*.whl")
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("forkyard/")}
    in_tree = {p.relative_to(src).as_posix() for p in (src / "forkyard").rglob("*") if p.is_file()}
    assert sorted(f for f in in_tree - in_wheel if not f.endswith(".md")) == []


#: The gateway Deployment's securityContext, reproduced: a private mount namespace whose root is
#: read-only and /tmp a fresh tmpfs (readOnlyRootFilesystem + the emptyDir), then no capability
#: at all and no_new_privs (capabilities drop ALL, allowPrivilegeEscalation false).
CONSTRAINED = (
    "mount --make-rprivate / && mount -t tmpfs -o size=64m tmpfs /tmp && mount -o remount,bind,ro / "
    '&& exec setpriv --no-new-privs --bounding-set=-all --inh-caps=-all "$@"'
)


@pytest.mark.requires_root("unshare --mount, mount: a read-only root for the gateway")
def test_the_gateway_runs_as_its_deployment_confines_it(postgres: Any) -> None:
    """The gateway needs no capability, no writable root file system and no privilege gain (what
    the gateway Deployment and forkyard-gateway.service grant it): started so against a real
    PostgreSQL it migrates the registry, answers /health and serves the API."""
    port, key = free_port(), "e2b_" + secrets.token_hex(8)
    env = {
        "PATH": os.environ["PATH"],
        "FORKYARD_DATABASE_URL": postgres.new_database(),
        "FORKYARD_NODE_SECRETS": json.dumps([secrets.token_hex(16)]),
        "FORKYARD_API_KEYS": json.dumps([key]),
        "FORKYARD_DATA_DIR": "/tmp/forkyard",  # as in the Deployment
    }
    gateway = [
        sys.executable,
        "-m",
        "forkyard.cli.main",
        "gateway",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(
        ["unshare", "--mount", "sh", "-c", CONSTRAINED, "sh", *gateway],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        assert _wait_for_health(url, proc) == 204
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status
        mounts = [line.split() for line in Path(f"/proc/{proc.pid}/mountinfo").read_text().splitlines()]
        assert [m[5].split(",")[0] for m in mounts if m[4] == "/"] == ["ro"]
        assert httpx.get(f"{url}/v2/sandboxes", headers={"X-API-Key": key}, timeout=10).json() == []
        assert httpx.get(f"{url}/v2/sandboxes", timeout=10).status_code == 401
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    assert "Running upgrade" in output, output  # it migrated the fresh database


def _wait_for_health(url: str, proc: subprocess.Popen[str], timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited {proc.returncode}: {proc.communicate()[0]}")
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(f"{url}/health", timeout=1).status_code
        time.sleep(0.2)
    raise AssertionError(f"the gateway did not answer /health in {timeout:.0f} s")


# -- each check fails on a broken copy -----------------------------------------------------------


def _edit(relative: str, old: str, new: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / relative
        text = path.read_text()
        assert old in text, f"{relative} no longer contains {old!r}: update this test"
        path.write_text(text.replace(old, new, 1))

    return apply


BREAKAGES: dict[str, tuple[Callable[[Path], None], Callable[[Path, Path], Problems], str]] = {
    "k8s unknown field": (
        _edit("deploy/k8s/base/node-daemonset.yaml", "imagePullPolicy:", "imagePullPolicyy:"),
        lambda root, _: k8s_schema_problems(root),
        "imagePullPolicyy",
    ),
    "k8s wrong type": (
        _edit("deploy/k8s/base/gateway-deployment.yaml", "replicas: 2", "replicas: two"),
        lambda root, _: k8s_schema_problems(root),
        "'two' is not of type 'integer'",
    ),
    "k8s setting renamed": (
        _edit("deploy/k8s/base/configmap.yaml", "FORKYARD_NODE_HEARTBEAT_SECONDS", "FORKYARD_NODE_HEARTBEAT"),
        lambda root, _: k8s_env_problems(root),
        "FORKYARD_NODE_HEARTBEAT is no Settings field",
    ),
    "k8s secret key missing": (
        _edit("deploy/k8s/base/secret.yaml", "  node-secrets:", "  node-secret:"),
        lambda root, _: k8s_env_problems(root),
        "missing ConfigMap/Secret key 'node-secrets'",
    ),
    "k8s patch path gone": (
        _edit(
            "deploy/k8s/overlays/kvm/kustomization.yaml",
            "/containers/0/volumeMounts/-",
            "/containers/1/volumeMounts/-",
        ),
        lambda root, _: kustomize_problems(root),
        "does not apply",
    ),
    "compose schema": (
        _edit(COMPOSE_FILE, "stop_grace_period: 60s", "stop_grace_period: [60s]"),
        lambda root, _: compose_problems(root),
        "stop_grace_period",
    ),
    "compose setting renamed": (
        _edit(COMPOSE_FILE, "FORKYARD_NODE_SECRETS:", "FORKYARD_NODE_SECRET:"),
        lambda root, _: compose_problems(root),
        "FORKYARD_NODE_SECRET is no Settings field",
    ),
    "compose bad value": (
        _edit(
            COMPOSE_FILE, 'FORKYARD_NODE_LOST_AFTER_SECONDS: "30"', 'FORKYARD_NODE_LOST_AFTER_SECONDS: "soon"'
        ),
        lambda root, _: compose_problems(root),
        "node_lost_after_seconds",
    ),
    "compose unknown host": (
        _edit(COMPOSE_FILE, '"http://node-b:3000"', '"http://node-c:3000"'),
        lambda root, _: compose_problems(root),
        "names host node-c",
    ),
    "systemd bad value": (
        _edit("deploy/systemd/forkyard-node.service", "KillMode=process", "KillMode=sometimes"),
        systemd_problems,
        "kill mode",
    ),
    "systemd unknown key": (
        _edit("deploy/systemd/forkyard.service", "TasksMax=infinity", "TaskMax=infinity"),
        systemd_problems,
        "Unknown key 'TaskMax'",
    ),
    "systemd env example drift": (
        _edit("deploy/systemd/gateway.env.example", "FORKYARD_API_KEYS=", "FORKYARD_APIKEYS="),
        systemd_problems,
        "FORKYARD_APIKEYS is no Settings field",
    ),
    "dockerfile entrypoint": (
        _edit("Dockerfile", 'ENTRYPOINT ["forkyard"]', 'ENTRYPOINT ["/bin/sh"]'),
        lambda root, _: dockerfile_problems(root),
        "ENTRYPOINT",
    ),
    "runsc pin drift": (
        _edit("Dockerfile", "RUNSC_VERSION=0.0~20240729.0-4~bpo12+2", "RUNSC_VERSION=0.0~20221219.0-2+b3"),
        lambda root, _: bootstrap_problems(root),
        "bootstrap pins 0.0~20240729.0-4~bpo12+2",
    ),
    "bootstrap package not in the image": (
        _edit("scripts/bootstrap.sh", "skopeo umoci", "skopeo umoci socat"),
        lambda root, _: bootstrap_problems(root),
        "bootstrap.sh installs socat, the image does not",
    ),
    "dockerfile lock drift": (
        _edit("deploy/docker/requirements.lock", "fastapi==", "fastapi==0.0.1\n#"),
        lambda root, _: lock_problems(root),
        "requirements.lock: fastapi==0.0.1",
    ),
}

APT_BREAKAGES = {
    "apt package misspelt": (
        _edit("Dockerfile", " skopeo ", " skopeoo "),
        "skopeoo is not in Debian's index",
    ),
    "apt version absent": (
        _edit("Dockerfile", "RUNSC_VERSION=0.0~20240729.0-4~bpo12+2", "RUNSC_VERSION=0.0~20240729.0-9"),
        "runsc=0.0~20240729.0-9 is not in Debian's index",
    ),
}


def broken_copy(tmp_path: Path, breakage: Callable[[Path], None]) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(REPO / "deploy", root / "deploy")
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts/bootstrap.sh", root / "scripts/bootstrap.sh")
    (root / "forkyard").mkdir()
    breakage(root)
    return root


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_a_broken_copy_is_caught(case: str, tmp_path: Path) -> None:
    breakage, check, expected = BREAKAGES[case]
    if check is systemd_problems and shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    problems = check(broken_copy(tmp_path, breakage), tmp_path / "units")

    assert any(expected in p for p in problems), problems


@pytest.mark.skipif(shutil.which("apt-cache") is None, reason="apt-cache is not installed (not Debian)")
@pytest.mark.parametrize("case", sorted(APT_BREAKAGES))
def test_a_broken_dockerfile_is_caught_by_the_apt_check(case: str, tmp_path: Path) -> None:
    if not any(Path("/var/lib/apt/lists").glob("*_Packages*")):
        pytest.skip("no apt lists here: run apt-get update")
    breakage, expected = APT_BREAKAGES[case]

    problems = apt_problems(broken_copy(tmp_path, breakage))

    assert any(expected in p for p in problems), problems
