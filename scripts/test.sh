#!/bin/bash
# The whole suite for `make test`. Two pytest sessions run side by side, so that CI's wall time is the
# longer of the two, not their sum:
#   - the main one: everything but the two suites below (~35 min);
#   - the side slot, one after the other: the emulated KVM host's Firecracker suite (~10 min waiting on
#     one emulated CPU, QEMU TCG) and then the Compose cluster suite (Docker images, the cluster, its
#     faults under load: README "Cluster"), each its own session.
# Each session's host leak check tells its own processes apart (tests/support/leaks.py): the side
# sessions look only at processes they surely started (FORKYARD_TEST_HOST_CHECK=processes), and the
# Compose cluster's sandboxes run in Docker containers, which no host session counts as its own.
# With arguments (`make test PYTEST_ARGS=...`) one session runs exactly what was asked.
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
KVMHOST_SUITE=tests/system/test_firecracker_kvmhost.py
COMPOSE_SUITE=tests/system/test_compose_cluster.py

if [ $# -gt 0 ]; then
    exec $PY -m pytest -rs --durations=40 --ignore="$COMPOSE_SUITE" "$@"
fi

log=$(mktemp /tmp/forkyard-side-suites.XXXXXX.log)
side_slot() {
    local started=$SECONDS kvmhost_rc compose_rc
    FORKYARD_TEST_HOST_CHECK=processes $PY -m pytest -rs --durations=10 -p no:cacheprovider "$KVMHOST_SUITE"
    kvmhost_rc=$?
    echo "emulated KVM host suite: exit $kvmhost_rc after $((SECONDS - started)) s"
    # -s: the fault tests print their figures (FAULT lines and README's table).
    FORKYARD_TEST_HOST_CHECK=processes $PY -m pytest -rs -s --durations=10 -p no:cacheprovider "$COMPOSE_SUITE"
    compose_rc=$?
    echo "Compose cluster suite: exit $compose_rc; side slot: $((SECONDS - started)) s"
    [ $kvmhost_rc -eq 0 ] && [ $compose_rc -eq 0 ]
}
side_slot >"$log" 2>&1 &
side=$!
# The side slot is stopped with the main session (Ctrl-C, CI's limit): the pytest it runs (a child of
# that subshell), then the subshell. pytest ends on SIGTERM without its teardown: a Compose cluster it
# had up stays (`docker ps -a`; `docker-compose -p fytest... down -v` takes it away).
trap 'pkill -TERM -P $side 2>/dev/null; kill $side 2>/dev/null' INT TERM

$PY -m pytest -rs --durations=40 --ignore="$COMPOSE_SUITE" --ignore="$KVMHOST_SUITE"
main=$?
wait $side
side_rc=$?
echo "================ the side slot: emulated KVM host, then Compose cluster suites ($log) ================"
cat "$log"
echo "main session: exit $main; side slot (KVM host, Compose cluster): exit $side_rc"
[ $main -eq 0 ] && [ $side_rc -eq 0 ]
