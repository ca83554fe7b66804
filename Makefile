# The two set-up commands: `make run` and `make test`. Both install whatever is missing.
PY := .venv/bin/python
AGENTENV := .venv/bin/agentenv

.PHONY: run test bench bootstrap lint proto template clean

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	$(AGENTENV) template build base
	$(AGENTENV) serve

test:
	@scripts/bootstrap.sh --test
	$(AGENTENV) template build base
	.venv/bin/ruff check agentenv tests bench
	.venv/bin/mypy agentenv
	$(PY) -m pytest -rs $(PYTEST_ARGS)

bench: bootstrap
	$(AGENTENV) template build base
	$(PY) -m bench $(BENCH_ARGS)

lint: bootstrap
	.venv/bin/ruff check agentenv tests bench
	.venv/bin/mypy agentenv

# Regenerate the envd protobuf messages from the shared E2B protos.
proto: bootstrap
	PATH=$(CURDIR)/.venv/bin:$$PATH protoc -I ../shared/e2b-spec --py_out=agentenv/envd/proto \
	  process.proto filesystem.proto
