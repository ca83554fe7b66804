#!/bin/bash
# The whole suite for `make test`, in three pytest sessions:
#   - the main one: everything but the two suites below (~30 min);
#   - beside it, the emulated KVM host's Firecracker suite (~10 min, most of it waiting on one emulated
#     CPU, QEMU TCG): CI's wall time is the longer of the two, not their sum;
#   - after both, alone, the Compose cluster suite (Docker images, the cluster, its faults under load:
#     README "Cluster"; ~5 min). Its fault tests judge hung calls and recovery times: beside the main
#     session's own sandboxes on 2 cores, creates took over a minute (the SDK's timeout), so it waits.
# Each session's host leak check tells its own processes apart (tests/support/leaks.py): the KVM host
# and Compose sessions look only at processes they surely started (FORKYARD_TEST_HOST_CHECK=processes),
# and the Compose cluster's sandboxes run in Docker containers, which no host session counts as its own.
# With arguments (`make test PYTEST_ARGS=...`) one session runs exactly what was asked.
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
KVMHOST_SUITE=tests/system/test_firecracker_kvmhost.py
COMPOSE_SUITE=tests/system/test_compose_cluster.py

if [ $# -gt 0 ]; then
    exec $PY -m pytest -rs --durations=40 --ignore="$COMPOSE_SUITE" "$@"
fi

log=$(mktemp /tmp/forkyard-kvmhost-suite.XXXXXX.log)
started=$SECONDS
FORKYARD_TEST_HOST_CHECK=processes $PY -m pytest -rs --durations=10 -p no:cacheprovider "$KVMHOST_SUITE" \
    >"$log" 2>&1 &
kvmhost=$!
# The KVM host suite is stopped with the main session (Ctrl-C, CI's limit).
trap 'kill $kvmhost 2>/dev/null' INT TERM

$PY -m pytest -rs --durations=40 --ignore="$COMPOSE_SUITE" --ignore="$KVMHOST_SUITE"
main=$?
wait $kvmhost
kvmhost_rc=$?
echo "================ the emulated KVM host's suite, run beside the main session ($log) ================"
cat "$log"
echo "emulated KVM host suite: exit $kvmhost_rc; both sessions: $((SECONDS - started)) s"

echo "================ the Compose cluster suite, alone ================"
# -s: the fault tests print their figures (FAULT lines and README's table).
FORKYARD_TEST_HOST_CHECK=processes $PY -m pytest -rs -s --durations=10 -p no:cacheprovider "$COMPOSE_SUITE"
compose_rc=$?
echo "main session: exit $main; emulated KVM host: exit $kvmhost_rc; Compose cluster: exit $compose_rc"
echo "make test: $((SECONDS - started)) s"
[ $main -eq 0 ] && [ $kvmhost_rc -eq 0 ] && [ $compose_rc -eq 0 ]
