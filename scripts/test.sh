#!/bin/bash
# The whole suite for `make test`. The emulated KVM host's Firecracker suite spends ~10 minutes
# waiting on one emulated CPU (QEMU TCG) while this host's pytest sits idle, so it runs as a second
# pytest session beside the rest instead of after it: CI's wall time is the longer of the two, not
# their sum. Each session's host leak check tells its own processes apart (tests/support/leaks.py).
# With arguments (`make test PYTEST_ARGS=...`) one session runs exactly what was asked.
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
KVMHOST_SUITE=tests/system/test_firecracker_kvmhost.py

if [ $# -gt 0 ]; then
    exec $PY -m pytest -rs --durations=40 --ignore=tests/system/test_compose_cluster.py "$@"
fi

log=$(mktemp /tmp/forkyard-kvmhost-suite.XXXXXX.log)
FORKYARD_TEST_HOST_CHECK=processes $PY -m pytest -rs --durations=10 -p no:cacheprovider \
    "$KVMHOST_SUITE" >"$log" 2>&1 &
kvmhost=$!
# The KVM host suite is killed with the main one (Ctrl-C, CI's limit).
trap 'kill $kvmhost 2>/dev/null' INT TERM

$PY -m pytest -rs --durations=40 --ignore=tests/system/test_compose_cluster.py --ignore="$KVMHOST_SUITE"
main=$?
wait $kvmhost
kvmhost_rc=$?
echo "================ the emulated KVM host's suite, run beside the rest ($log) ================"
cat "$log"
echo "main session: exit $main; emulated KVM host session: exit $kvmhost_rc"
[ $main -eq 0 ] && [ $kvmhost_rc -eq 0 ]
