# The two set-up commands: `make run` and `make test`. Both install whatever is missing.
# Without root: `make test-unit` (the unit tests only; no apt, no runsc, no template).
PY := .venv/bin/python
FORKYARD := .venv/bin/forkyard

.PHONY: run test test-unit test-cluster cluster-up cluster-down bench bootstrap template code-interpreter lint proto clean kvm-host

# One lint recipe for `make lint` and `make test`.
define LINT
.venv/bin/ruff check forkyard clients tests bench
.venv/bin/ruff format --check forkyard clients tests bench
.venv/bin/mypy forkyard clients/rl/forkyard_rl
.venv/bin/lint-imports --no-cache
endef

bootstrap:
	@scripts/bootstrap.sh

# The `base` template in the shared cache (/var/lib/forkyard/templates): minutes once (again when its
# recipe changes: forkyard/storage/templates.py, recipe_digest), then instant.
template: bootstrap
	$(FORKYARD) template build base

# E2B's code interpreter (its system tests and bench rows): about 10-20 min once, then instant.
# `make run` does not wait for it: `forkyard serve` builds it in the background when missing.
code-interpreter: template
	$(FORKYARD) template build code-interpreter-v1

run: template
	FORKYARD_BUILD_CODE_INTERPRETER=true $(FORKYARD) serve

# The whole suite: unit and system tests (root; system tests need runsc, QEMU, the template).
test: template code-interpreter
	@scripts/bootstrap.sh --test
	$(LINT)
	scripts/test.sh $(PYTEST_ARGS)

# tests/unit only: any user, about a minute. Uses the existing .venv; creates it (pip only, no
# apt) when there is none.
test-unit: | $(PY)
	$(PY) -m pytest -rs tests/unit $(PYTEST_ARGS)

$(PY):
	python3 -m venv .venv
	.venv/bin/pip install -q --disable-pip-version-check -e ./clients/rl -e ".[test,dev]"
	touch .venv/.forkyard-installed

# An emulated KVM host (QEMU TCG with AMD SVM, Debian's kernel with kvm_amd) running the node with
# real Firecracker microVMs; its API on a loopback port (printed). Root; Ctrl-C stops it. docs/KVM.md.
kvm-host: template
	PYTHONPATH=$(CURDIR) $(PY) -m tests.support.kvmhost


# The Compose cluster on this machine's Docker (README "Cluster"): Debian's docker.io and
# docker-compose, a Debian base image made here, the images built on it, the cluster up (a node's
# first start builds its base template: minutes once). `make cluster-down` takes it all away
# again (containers, networks, volumes, and the engine if scripts/docker.sh started it).
COMPOSE := cd deploy/compose && /usr/bin/docker-compose -p forkyard -f docker-compose.yml -f docker-compose.local.yml

cluster-up:
	@scripts/bootstrap.sh --docker
	scripts/docker.sh images
	$(COMPOSE) up -d --no-build
	@echo "gateway: http://127.0.0.1:$${FORKYARD_GATEWAY_PORT:-3000} (E2B_API_KEY: deploy/compose/.env, else the dev default)"

cluster-down:
	-$(COMPOSE) down -v --remove-orphans
	scripts/docker.sh daemon-down

# The image and Compose cluster tests alone (`make test` runs them too, alone after the rest and the
# emulated KVM host's suite: scripts/test.sh). The first image builds take minutes once, then seconds.
test-cluster: template
	@scripts/bootstrap.sh --test
	$(PY) -m pytest -rs -s tests/system/test_compose_cluster.py $(PYTEST_ARGS)

bench: template code-interpreter
	$(PY) -m bench $(BENCH_ARGS)

lint: bootstrap
	$(LINT)

# Regenerate the envd protobuf messages from the shared E2B protos.
proto: bootstrap
	PATH=$(CURDIR)/.venv/bin:$$PATH protoc -I ../shared/e2b-spec --py_out=forkyard/envd/proto \
	  process.proto filesystem.proto

# Caches and build output of the tools (pytest, mypy, ruff, setuptools, __pycache__). Keeps the
# .venv, tests/js/node_modules, bench/results and the template cache; never touches /tmp.
clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache build
	find . -path ./.venv -prune -o -path ./tests/js/node_modules -prune -o \
	  -type d -name __pycache__ -print0 | xargs -0 -r rm -rf
