# Conveyor: the two commands a new user types are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev

.PHONY: run test deps lint typecheck unit venv bench-log clean

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Conveyor needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(STAMP)

## Start a broker with the embedded defaults (./conveyor-data, tcp://127.0.0.1:5555, metrics on :9100).
run: $(STAMP)
	$(VENV)/bin/conveyor broker

## Install what the tests need, lint, type-check and run the whole suite.
test: $(STAMP) deps lint typecheck unit

## promtool and prometheus (Debian's prometheus package): the monitoring tests run them.
deps:
	@command -v promtool >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus)

lint: $(STAMP)
	$(VENV)/bin/ruff check broker consumers decorators monitoring benchmarks tests
	$(VENV)/bin/ruff format --check broker consumers decorators monitoring

typecheck: $(STAMP)
	$(VENV)/bin/mypy broker consumers decorators monitoring

unit: $(STAMP) deps
	$(PY) -m pytest -q

## Append/read throughput of the topic log under each fsync policy.
bench-log: $(STAMP)
	$(PY) -m benchmarks.log_bench

clean:
	rm -rf $(VENV) conveyor-data .pytest_cache .mypy_cache .ruff_cache
