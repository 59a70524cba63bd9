# kvplan developer entry points. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/kvplan/v1/*.proto)

.PHONY: install run test lint proto proto-check unit conformance bench bench-rpc clean vllm-venvs wheel

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,dev]'
	touch $(STAMP)

install: $(STAMP)

## Start the service on its embedded defaults (gRPC :50051, metrics :9464).
run: $(STAMP)
	$(BIN)/kvplan serve

## Regenerate the protobuf / gRPC stubs under kvplan/v1.
proto: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH scripts/gen-proto kvplan/v1

## Fail when the committed stubs differ from what the .proto files generate.
proto-check: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH scripts/gen-proto --check kvplan/v1

lint: $(STAMP)
	$(BIN)/ruff check kvplan client server tests bench scripts conformance
	$(BIN)/ruff format --check kvplan client server tests bench conformance
	$(BIN)/mypy kvplan tests bench
	cd proto && ../$(BIN)/buf lint

unit: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider

## The whole suite: stubs up to date, lint, type checks, tests.
test: $(STAMP) proto-check lint vllm-venvs
	bash scripts/run-tests $(BIN)

## The wheel (thin client + vLLM plugin + server) into dist/, for engine hosts:
## `pip install --no-deps dist/kvplan-*.whl` next to vLLM (see docs/vllm.md).
wheel: $(STAMP)
	$(PY) -m pip wheel -q --no-deps -w dist .

## The CPU venvs of the vLLM releases the plugin supports (cached in
## ~/.cache/kvplan; the plugin tests run vLLM's engine core in them).
VLLM_RELEASES ?= 0.33 0.34
vllm-venvs:
	for v in $(VLLM_RELEASES); do bash scripts/vllm-venv $$v || exit 1; done

## Differential check against vLLM 0.33.0's own planner (separate venv).
conformance: $(STAMP)
	bash conformance/run

## In-process planning time; with vLLM 0.33 timed alongside when its venv exists
## (`make conformance` creates it).
VLLM_VENV ?= $(HOME)/.cache/kvplan/vllm-0.33/venv
bench: $(STAMP)
	if [ -f $(VLLM_VENV)/.kvplan-vllm-ready ]; then \
		PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python -m bench.plan_core; \
	else \
		$(PY) -m bench.plan_core; \
	fi

## The gRPC service under load: throughput vs Echo, rendezvous, cold start, RSS.
bench-rpc: $(STAMP)
	$(PY) -m bench.rpc_bench

## The service image (Dockerfile; see docs/deployment.md). Needs a Docker engine.
.PHONY: docker
docker:
	docker build -t kvplan .

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
