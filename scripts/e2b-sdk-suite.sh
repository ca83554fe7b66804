#!/bin/bash
# E2B's own SDK test suites against a forkyard node (issue 24's acceptance: they fail only where
# they need E2B's cloud or the public internet). Not part of `make test`: the suites live in E2B's
# GitHub repository, which CI cannot reach. Usage, as root from the checkout:
#
#   scripts/e2b-sdk-suite.sh [--js] E2B_REPO [SDK_VERSION] [pytest or vitest args...]
#
# E2B_REPO is a clone of github.com/e2b-dev/E2B (a bare git directory works too).
# Python (the default): its packages/python-sdk/tests as tagged for SDK_VERSION (default: its newest
# `@e2b/python-sdk@` tag) run with the published `e2b==SDK_VERSION` in a venv of their own.
# --js: its packages/js-sdk as tagged `e2b@SDK_VERSION` (default: the newest tag that npm has
# published), with the dev dependencies of that release's pnpm lockfile from npm, run by vitest
# (projects unit, template and connectionConfig; `browser` needs Playwright's own Chromium
# download). The tests import the SDK's source (`../src`, and modules the published bundle does not
# export), so the SDK under test is the tag's source, which vitest compiles: the same source as
# the published `e2b@SDK_VERSION`.
# Both run against a `forkyard serve` started here on a free port with a data dir and a templates
# directory of its own (the shared cache's templates linked in). The JUnit report and the server's
# log are left in $OUT (default /tmp/e2b-sdk-suite, /tmp/e2b-js-sdk-suite); docs/E2B-SUITES.md
# reads them.
set -euo pipefail
cd "$(dirname "$0")/.."
lang=python
if [ "${1:-}" = --js ]; then
    lang=js
    shift
fi
repo=${1:?usage: scripts/e2b-sdk-suite.sh [--js] E2B_REPO [SDK_VERSION] [pytest or vitest args...]}
shift
cache=/var/cache/forkyard/e2b-sdk-suite

if [ "$lang" = python ]; then
    OUT=${OUT:-/tmp/e2b-sdk-suite}
    rm -rf "$OUT" && mkdir -p "$OUT/tests"
    # The suite as released with that SDK (its tag), so tests and SDK agree.
    version=${1:-$(git -C "$repo" tag --list '@e2b/python-sdk@*' --sort=-v:refname | head -1 | sed 's/.*@//')}
    [ $# -gt 0 ] && shift
    ref="@e2b/python-sdk@$version"
    git -C "$repo" rev-parse -q --verify "$ref" >/dev/null || ref=HEAD
    git -C "$repo" archive "$ref" packages/python-sdk/tests packages/python-sdk/pytest.ini \
        | tar -x -C "$OUT/tests" --strip-components=2
    venv=$cache/venv-$version
    if [ ! -x "$venv/bin/pytest" ]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check "e2b==$version" "pytest>=9.0.3,<10" \
            "pytest-xdist>=3.3.1,<4" "python-dotenv>=1.0.0,<2" "pytest-dotenv>=0.5.2,<0.6" \
            "pytest-asyncio>=1.3.0,<2" "pytest-timeout>=2.4.0,<3"
    fi
else
    OUT=${OUT:-/tmp/e2b-js-sdk-suite}
    rm -rf "$OUT" && mkdir -p "$OUT"
    published=$(npm view e2b versions --json)
    version=${1:-}
    [ $# -gt 0 ] && shift
    if [ -z "$version" ]; then
        for tag in $(git -C "$repo" tag --list 'e2b@*' --sort=-v:refname); do
            v=${tag#e2b@}
            if grep -q "\"$v\"" <<<"$published"; then version=$v; break; fi
        done
    fi
    grep -q "\"$version\"" <<<"$published" || { echo "e2b@$version is not on npm" >&2; exit 2; }
    ref="e2b@$version"
    git -C "$repo" rev-parse -q --verify "$ref" >/dev/null || { echo "no tag $ref in $repo" >&2; exit 2; }
    # The workspace's manifests and lockfile, and the SDK's package, as tagged; its dependencies
    # installed once per version as the lockfile pins them (E2B's CI runs Node 22: engine-strict
    # off lets Node 20 install tsdown, the build tool, which the tests do not run).
    js=$cache/js-$version
    mkdir -p "$js"
    rm -rf "$js/packages/js-sdk/src" "$js/packages/js-sdk/tests"
    git -C "$repo" archive "$ref" package.json pnpm-lock.yaml pnpm-workspace.yaml .npmrc \
        packages/cli/package.json packages/python-sdk/package.json packages/js-sdk | tar -x -C "$js"
    if [ ! -x "$js/packages/js-sdk/node_modules/.bin/vitest" ]; then
        pnpm=$(git -C "$repo" show "$ref:package.json" | sed -n 's/.*"packageManager": *"\(pnpm@[^"]*\)".*/\1/p')
        (cd "$js" && npx -y "${pnpm:-pnpm@10}" install --frozen-lockfile --filter e2b \
            --config.engine-strict=false --store-dir "$cache/pnpm-store")
    fi
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

# Sandbox URLs (`get_host`) are HTTPS with the node's own CA: trusted as README says.
export SSL_CERT_FILE="$OUT/data/tls/ca-bundle.pem" NODE_EXTRA_CA_CERTS="$OUT/data/tls/ca.pem"
set +e
if [ "$lang" = python ]; then
    cd "$OUT/tests"
    # The SDK's own tests of its URL defaults assume no E2B_SANDBOX_URL: run apart, without it.
    defaults="tests/test_connection_config.py tests/test_sandbox_urls.py"
    defaults+=" tests/sync/sandbox_sync/test_config_propagation.py tests/async/sandbox_async/test_config_propagation.py"
    ignores=$(for f in $defaults; do [ -e "$f" ] && echo "--ignore=$f"; done)
    E2B_API_URL="http://127.0.0.1:$port" E2B_SANDBOX_URL="http://127.0.0.1:$port" E2B_API_KEY="$key" \
        "$venv/bin/pytest" -q -rfE -p no:cacheprovider --junitxml="$OUT/junit.xml" $ignores "$@" tests
    rc=$?
    present=$(for f in $defaults; do [ -e "$f" ] && echo "$f"; done)
    if [ -n "$present" ]; then
        E2B_API_URL="http://127.0.0.1:$port" E2B_API_KEY="$key" \
            "$venv/bin/pytest" -q -rfE -p no:cacheprovider --junitxml="$OUT/junit-defaults.xml" $present
        rc=$((rc | $?))
    fi
    label="e2b==$version suite ($ref)"
else
    # Tests that mock E2B's API (msw, at `https://api.$E2B_DOMAIN`) and the SDK's own tests of
    # its URL defaults assume no E2B_API_URL and E2B_SANDBOX_URL: they run apart with E2B_DOMAIN
    # alone, E2B's CI's way, naming the node's HTTPS listener (which serves the API too), so the
    # few real calls among them (tags.test.ts's builds) reach the node as well.
    cd "$js/packages/js-sdk"
    apart=$( (grep -rlE "from '(msw|msw/node)'" tests --include='*.test.ts' --include='*.test.tsx' | grep -v '^tests/runtimes/'
        for f in tests/sandbox/urls.test.ts tests/connectionConfig.browser.test.ts; do [ -e "$f" ] && echo "$f"; done) | sort -u)
    projects=(--project unit --project template --project connectionConfig)
    # The rest by name (vitest's --exclude does not reach a project with an exclude of its own).
    rest=$(node_modules/.bin/vitest list --filesOnly "${projects[@]}" | sed 's/^\[[^]]*\] //' | sort -u \
        | grep -vxF -f <(echo "$apart"))
    vitest=(node_modules/.bin/vitest run "${projects[@]}" --reporter=default --reporter=junit)
    E2B_API_URL="http://127.0.0.1:$port" E2B_SANDBOX_URL="http://127.0.0.1:$port" E2B_API_KEY="$key" \
        "${vitest[@]}" --outputFile.junit="$OUT/junit.xml" "$@" $rest
    rc=$?
    if [ -n "$apart" ]; then
        E2B_DOMAIN="${FORKYARD_SANDBOX_DOMAIN:-forkyard.localhost}:$tls_port" E2B_API_KEY="$key" \
            "${vitest[@]}" --outputFile.junit="$OUT/junit-domain.xml" "$@" $apart
        rc=$((rc | $?))
    fi
    label="e2b@$version JS suite ($ref, node $(node --version))"
fi
set -e
echo "$label: exit $rc; JUnit in $OUT/junit*.xml, server log in $OUT/server.log"
exit $rc
