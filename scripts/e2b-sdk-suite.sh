#!/bin/bash
# E2B's own Python SDK test suite against a forkyard node (issue 24's acceptance: it fails only
# where it needs E2B's cloud or the public internet). Not part of `make test`: the suite lives in
# E2B's GitHub repository, which CI cannot reach. Usage, as root from the checkout:
#
#   scripts/e2b-sdk-suite.sh E2B_REPO [SDK_VERSION] [pytest args...]
#
# E2B_REPO is a clone of github.com/e2b-dev/E2B (a bare git directory works too); its
# packages/python-sdk/tests as tagged for SDK_VERSION (default: its newest python-sdk tag) run with
# the published `e2b==SDK_VERSION` in a venv of their own, against a `forkyard serve` started here on a
# free port with a data dir and a templates directory of its own (the shared cache's templates
# linked in). The JUnit report and the
# server's log are left in $OUT (default /tmp/e2b-sdk-suite); docs/E2B-SUITES.md reads them.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=${1:?usage: scripts/e2b-sdk-suite.sh E2B_REPO [SDK_VERSION] [pytest args...]}
shift
OUT=${OUT:-/tmp/e2b-sdk-suite}
rm -rf "$OUT" && mkdir -p "$OUT/tests"

# The suite as released with that SDK (its tag), so tests and SDK agree.
version=${1:-$(git -C "$repo" tag --list '@e2b/python-sdk@*' --sort=-v:refname | head -1 | sed 's/.*@//')}
[ $# -gt 0 ] && shift
ref="@e2b/python-sdk@$version"
git -C "$repo" rev-parse -q --verify "$ref" >/dev/null || ref=HEAD
git -C "$repo" archive "$ref" packages/python-sdk/tests packages/python-sdk/pytest.ini \
    | tar -x -C "$OUT/tests" --strip-components=2

venv=/var/cache/forkyard/e2b-sdk-suite/venv-$version
if [ ! -x "$venv/bin/pytest" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "e2b==$version" "pytest>=9.0.3,<10" \
        "pytest-xdist>=3.3.1,<4" "python-dotenv>=1.0.0,<2" "pytest-dotenv>=0.5.2,<0.6" \
        "pytest-asyncio>=1.3.0,<2" "pytest-timeout>=2.4.0,<3"
fi

port=$(.venv/bin/python -c 'from tests.support import free_port; print(free_port())')
tls_port=$(.venv/bin/python -c 'from tests.support import free_port; print(free_port())')
key="e2b_$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')"
# Templates the suite builds stay in $OUT: the shared cache lends only what exists.
mkdir -p "$OUT/templates"
for t in /var/lib/forkyard/templates/*; do ln -s "$t" "$OUT/templates/"; done
FORKYARD_DATA_DIR="$OUT/data" FORKYARD_TLS_PORT="$tls_port" FORKYARD_TEMPLATES_PATH="$OUT/templates" \
    FORKYARD_API_KEYS="[\"$key\"]" .venv/bin/forkyard serve --port "$port" >"$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 0.5
done

cd "$OUT/tests"
# Sandbox URLs (`get_host`) are HTTPS with the node's own CA: trusted as README says.
export SSL_CERT_FILE="$OUT/data/tls/ca-bundle.pem" NODE_EXTRA_CA_CERTS="$OUT/data/tls/ca.pem"
# The SDK's own tests of its URL defaults assume no E2B_SANDBOX_URL: run apart, without it.
defaults="tests/test_connection_config.py tests/test_sandbox_urls.py"
defaults+=" tests/sync/sandbox_sync/test_config_propagation.py tests/async/sandbox_async/test_config_propagation.py"
ignores=$(for f in $defaults; do [ -e "$f" ] && echo "--ignore=$f"; done)
set +e
E2B_API_URL="http://127.0.0.1:$port" E2B_SANDBOX_URL="http://127.0.0.1:$port" E2B_API_KEY="$key" \
    "$venv/bin/pytest" -q -rfE -p no:cacheprovider --junitxml="$OUT/junit.xml" $ignores "$@" tests
rc=$?
present=$(for f in $defaults; do [ -e "$f" ] && echo "$f"; done)
if [ -n "$present" ]; then
    E2B_API_URL="http://127.0.0.1:$port" E2B_API_KEY="$key" \
        "$venv/bin/pytest" -q -rfE -p no:cacheprovider --junitxml="$OUT/junit-defaults.xml" $present
    rc=$((rc | $?))
fi
set -e
echo "e2b==$version suite ($ref): exit $rc; JUnit in $OUT/junit*.xml, server log in $OUT/server.log"
exit $rc
