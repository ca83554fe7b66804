#!/usr/bin/env bash
# Installs everything agentenv needs on a fresh Debian 12 machine. Idempotent: a second run
# only checks. Usage: scripts/bootstrap.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(runsc debootstrap iproute2 iptables busybox-static qemu-system-x86 xfsprogs e2fsprogs
  erofs-utils cpio zstd protobuf-compiler procps psmisc util-linux kmod patchelf binutils gcc libc6-dev)

need=()
want=("${APT_PACKAGES[@]}")
# nodejs/npm may already come from elsewhere on the machine (not dpkg): never fight an existing node.
if [[ "${1:-}" == "--test" ]] && ! { command -v node && command -v npm; } >/dev/null; then
  want+=(nodejs npm)
fi
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  echo "bootstrap: installing Debian packages: ${need[*]}"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "bootstrap: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.agentenv-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  echo "bootstrap: installing Python packages"
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test,dev]"
  touch "$stamp"
fi
if [[ "${1:-}" == "--test" && ! -d tests/js/node_modules/e2b ]]; then
  echo "bootstrap: installing the e2b JS SDK for tests"
  (cd tests/js && npm install --no-audit --no-fund --silent)
fi
