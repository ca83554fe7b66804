#!/usr/bin/env bash
# Installs everything forkyard needs on a fresh Debian 12 machine. Idempotent: a second run
# only checks. Usage: scripts/bootstrap.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(debootstrap iproute2 iptables busybox-static qemu-system-x86 xfsprogs e2fsprogs
  erofs-utils cpio zstd protobuf-compiler procps psmisc util-linux kmod patchelf binutils gcc libc6-dev
  skopeo umoci postgresql-15 libnss-myhostname)

# libnss-myhostname: glibc then resolves every `*.localhost` name to loopback (its postinst adds
# `myhostname` to /etc/nsswitch.conf), so sandbox URLs (`<port>-<id>.forkyard.localhost`) resolve
# for any client on the host with no DNS set-up (a stock Debian 12 has no systemd-resolved).
SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO=sudo
die() { echo "bootstrap: $*" >&2; exit 1; }
apt_updated=0
apt_update() { ((apt_updated)) || $SUDO apt-get update -qq; apt_updated=1; }

# gVisor from Debian, one exact build: gVisor is sensitive to the Go runtime it was built with (sid's
# build of the same release panics at start) and the runtime relies on this release's flags
# (forkyard/runtime/gvisor/runsc.py, MIN_RELEASE). Debian 12 has it in bookworm-backports; a pin
# keeps `apt-get upgrade` on it. Upgrades (or downgrades) whatever runsc is installed.
declare -A RUNSC_PIN=([bookworm]="0.0~20240729.0-4~bpo12+2" [trixie]="0.0~20240729.0-4+b7")
declare -A RUNSC_SUITE=([bookworm]="bookworm-backports" [trixie]="trixie")
install_runsc() {
  local codename version suite pin=/etc/apt/preferences.d/forkyard-runsc pin_text
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  version=${RUNSC_PIN[$codename]:-} suite=${RUNSC_SUITE[$codename]:-}
  [[ -n $version ]] || die "no pinned runsc for Debian '${codename:-unknown}' (pins for: ${!RUNSC_PIN[*]})"
  if [[ $suite == *-backports ]] && ! grep -rqs "^[^#]*$suite" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "bootstrap: adding the $suite apt source"
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
      "$suite" /usr/share/keyrings/debian-archive-keyring.gpg |
      $SUDO tee "/etc/apt/sources.list.d/forkyard-$suite.sources" >/dev/null
  fi
  pin_text=$(printf 'Package: runsc\nPin: version %s\nPin-Priority: 1001' "$version")
  [[ "$(cat "$pin" 2>/dev/null)" == "$pin_text" ]] || echo "$pin_text" | $SUDO tee "$pin" >/dev/null
  [[ "$(dpkg-query -W -f='${Version}' runsc 2>/dev/null)" != "$version" ]] || return 0
  apt_update
  apt-cache madison runsc | grep -qF "| $version |" ||
    die "runsc $version (pinned) cannot be had from $suite; apt offers: $(apt-cache madison runsc | awk '{print $3}' | xargs)"
  echo "bootstrap: installing runsc $version from $suite"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends --allow-downgrades \
    "runsc=$version" >/dev/null
  [[ "$(dpkg-query -W -f='${Version}' runsc)" == "$version" ]] || die "runsc is not $version after installing it"
}
install_runsc

need=()
want=("${APT_PACKAGES[@]}")
# The template-build tests serve an OCI registry of their own on loopback.
[[ "${1:-}" != "--test" ]] || want+=(docker-registry)
# The image and Compose cluster tests (tests/system/test_compose_cluster.py): Debian's engine and
# docker-compose 1.29 (`make cluster-up` needs them too: scripts/docker.sh checks).
[[ "${1:-}" != "--test" && "${1:-}" != "--docker" ]] || want+=(docker.io docker-compose)
# The console tests drive Debian's headless chromium through its chromedriver (nothing downloaded).
[[ "${1:-}" != "--test" ]] || want+=(chromium chromium-driver fonts-liberation)
# nodejs/npm may already come from elsewhere on the machine (not dpkg): never fight an existing node.
if [[ "${1:-}" == "--test" ]] && ! { command -v node && command -v npm; } >/dev/null; then
  want+=(nodejs npm)
fi
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  echo "bootstrap: installing Debian packages: ${need[*]}"
  apt_update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "bootstrap: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.forkyard-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp || clients/rl/pyproject.toml -nt $stamp ]]; then
  echo "bootstrap: installing Python packages"
  .venv/bin/pip install -q --disable-pip-version-check -e ./clients/rl -e ".[test,dev]"
  touch "$stamp"
fi
if [[ "${1:-}" == "--test" && ! ( -d tests/js/node_modules/e2b && -d tests/js/node_modules/@e2b/cli && -d tests/js/node_modules/@e2b/code-interpreter ) ]]; then
  echo "bootstrap: installing the e2b JS SDK for tests"
  (cd tests/js && npm install --no-audit --no-fund --silent)
fi
# Harbor needs Python >= 3.12 (Debian 12 has 3.11): its own venv, from a pyenv build's python.
harbor_stamp=.venv-harbor/.forkyard-installed
if [[ "${1:-}" == "--test" && ( ! -f $harbor_stamp || tests/requirements-harbor.txt -nt $harbor_stamp ) ]]; then
  py312=${FORKYARD_HARBOR_PYTHON:-}
  if [[ -z $py312 ]]; then
    for candidate in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.1[2-9]*/bin/python3; do
      [[ -x $candidate ]] && py312=$candidate && break
    done
  fi
  [[ -n $py312 ]] || die "Harbor's tests need Python >= 3.12: set FORKYARD_HARBOR_PYTHON"
  echo "bootstrap: installing Harbor into .venv-harbor ($py312)"
  [[ -x .venv-harbor/bin/python ]] || "$py312" -m venv .venv-harbor
  .venv-harbor/bin/pip install -q --disable-pip-version-check -r tests/requirements-harbor.txt
  touch "$harbor_stamp"
fi
# The OpenAI Agents SDK with its E2B extra (tests/system/test_code_interpreter_frameworks.py): its own
# venv, as the extra pins older E2B SDKs and the SDK wants websockets<17 (the project pins 17.4).
agents_stamp=.venv-agents/.forkyard-installed
if [[ "${1:-}" == "--test" && ( ! -f $agents_stamp || tests/requirements-openai-agents.txt -nt $agents_stamp ) ]]; then
  echo "bootstrap: installing the OpenAI Agents SDK into .venv-agents"
  [[ -x .venv-agents/bin/python ]] || "$PY" -m venv .venv-agents
  .venv-agents/bin/pip install -q --disable-pip-version-check -r tests/requirements-openai-agents.txt
  touch "$agents_stamp"
fi
