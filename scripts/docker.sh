#!/usr/bin/env bash
# Docker for the image and Compose cluster (README "Cluster"): Debian's engine and the base image
# made from Debian itself (no registry is reachable from here but Debian's).
#
#   scripts/docker.sh daemon-up     start Debian's dockerd unless one answers (no systemd needed)
#   scripts/docker.sh daemon-down   stop the dockerd this script started, and its iptables chains
#   scripts/docker.sh images        build forkyard:latest, forkyard-s3 and forkyard-postgres on that base
#   scripts/docker.sh base          print the base image's tag; debootstrap + import it unless cached
#
# Always Debian's client (/usr/bin/docker): the machine image may carry another one on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER=/usr/bin/docker
RUN_DIR=/run/forkyard-docker
PID_FILE=$RUN_DIR/dockerd.pid
LOG=$RUN_DIR/dockerd.log
die() { echo "docker.sh: $*" >&2; exit 1; }

# The base image's recipe; its hash is the image tag, so a changed recipe builds a new image and an
# unchanged one is reused from the engine's store.
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
VARIANT=minbase
INCLUDE=ca-certificates
RECIPE="suite=$SUITE mirror=$MIRROR variant=$VARIANT include=$INCLUDE sources=deb822-v1"

daemon_answers() { $DOCKER version --format '{{.Server.Version}}' >/dev/null 2>&1; }

daemon_up() {
  [[ -x $DOCKER && -x /usr/sbin/dockerd ]] || die "Debian's docker.io is not installed (scripts/bootstrap.sh --test)"
  daemon_answers && return 0
  mkdir -p "$RUN_DIR"
  # setsid: the engine outlives the shell that starts it; daemon-down stops it by its pid file.
  setsid /usr/sbin/dockerd --pidfile "$PID_FILE" >>"$LOG" 2>&1 < /dev/null &
  echo "$!" > "$RUN_DIR/started-by-us"
  for _ in $(seq 1 300); do
    daemon_answers && return 0
    kill -0 "$(cat "$RUN_DIR/started-by-us")" 2>/dev/null || die "dockerd exited: $(tail -5 "$LOG")"
    sleep 0.2
  done
  die "dockerd did not answer in 60 s: $(tail -5 "$LOG")"
}

# Chains dockerd adds to iptables and never removes when it stops (measured here).
DOCKER_FILTER_CHAINS=(DOCKER-USER DOCKER-ISOLATION-STAGE-1 DOCKER-ISOLATION-STAGE-2 DOCKER)
daemon_down() {
  [[ -f $RUN_DIR/started-by-us ]] || return 0
  local pid; pid=$(cat "$RUN_DIR/started-by-us")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  remove_docker_chains
  rm -f "$RUN_DIR/started-by-us"
}

remove_docker_chains() {
  # Rules in the built-in chains that jump to Docker's, then the chains themselves.
  local table rule chain
  for table in filter nat; do
    while read -r rule; do
      [[ -n $rule ]] || continue
      eval "iptables -t $table ${rule/-A /-D }" || true
    done < <(iptables -t "$table" -S | grep -E '^-A (FORWARD|PREROUTING|OUTPUT|POSTROUTING|INPUT) .*(-j DOCKER|-o docker0|-i docker0|docker0)' || true)
  done
  for chain in "${DOCKER_FILTER_CHAINS[@]}"; do
    iptables -t filter -F "$chain" 2>/dev/null && iptables -t filter -X "$chain" 2>/dev/null || true
  done
  iptables -t nat -F DOCKER 2>/dev/null && iptables -t nat -X DOCKER 2>/dev/null || true
  ip link del docker0 2>/dev/null || true
}

base_tag() { echo "forkyard-base:$SUITE-$(printf '%s' "$RECIPE" | sha256sum | cut -c1-12)"; }

base() {
  local tag root; tag=$(base_tag)
  if $DOCKER image inspect "$tag" >/dev/null 2>&1; then echo "$tag"; return 0; fi
  root=$(mktemp -d /var/tmp/forkyard-base.XXXXXX)
  trap 'rm -rf "$root"' RETURN
  echo "docker.sh: making $tag (debootstrap $VARIANT $SUITE)" >&2
  debootstrap --variant="$VARIANT" --include="$INCLUDE" "$SUITE" "$root" "$MIRROR" >&2 ||
    die "debootstrap failed"
  rm -f "$root/etc/apt/sources.list"
  printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\nTypes: deb\nURIs: %s-security\nSuites: %s-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$MIRROR" "$SUITE" "$SUITE" "$MIRROR" "$SUITE" > "$root/etc/apt/sources.list.d/debian.sources"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log
  tar -C "$root" --numeric-owner -c . | $DOCKER import \
    --change 'CMD ["bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - "$tag" >/dev/null
  echo "$tag"
}

# PEM text of the host's extra CAs (a TLS-intercepting egress proxy's), for pip inside builds.
extra_ca() { cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true; }

# The forkyard image and the S3 server image of the Compose test override, on the local base.
LABEL=dev.forkyard.built-by=scripts/docker.sh
images() {
  local base; base=$(base)
  $DOCKER build -q --label "$LABEL" --build-arg BASE_IMAGE="$base" --build-arg EXTRA_CA_PEM="$(extra_ca)" \
    -t forkyard:latest . >&2
  $DOCKER build -q --label "$LABEL" --build-arg BASE_IMAGE="$base" --build-arg EXTRA_CA_PEM="$(extra_ca)" \
    -t forkyard-s3:latest deploy/compose/s3 >&2
  $DOCKER build -q --label "$LABEL" --build-arg BASE_IMAGE="$base" -t forkyard-postgres:15 deploy/compose/postgres >&2
  # The images these replaced (a rebuild after a code change leaves the old one untagged).
  $DOCKER image prune -f --filter "label=$LABEL" >/dev/null
}

case "${1:-}" in
  daemon-up) daemon_up ;;
  daemon-down) daemon_down ;;
  base) daemon_up; base ;;
  base-tag) base_tag ;;
  images) daemon_up; images ;;
  *) die "usage: $0 daemon-up|daemon-down|base|base-tag" ;;
esac
