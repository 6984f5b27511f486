# Conveyor: the two commands a new user types are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev
BASE   := $(VENV)/.installed

.PHONY: run example test deps etcd cluster lint typecheck unit venv bench-log bench-e2e bench-failover soak clean

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Conveyor needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The broker alone: what `make run` needs (no pyspark, no test tools).
$(BASE): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e .
	touch $@

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev,spark,cluster,pydantic,msgspec,otel]'
	touch $(BASE) $@

venv: $(STAMP)

## Start a broker with the embedded defaults (./conveyor-data, tcp://127.0.0.1:5555, metrics on :9100).
run: $(BASE)
	$(VENV)/bin/conveyor broker

## The example service (examples/shop) with one command: a broker in a temporary directory, the runner,
## orders placed, their invoices and dead letters shown, everything stopped (README, "Example service").
## Tracing needs the otel extra and the OpenTelemetry SDK (its console exporter); nothing else beyond `make run`'s.
EXAMPLE_STAMP := $(VENV)/.installed-example
$(EXAMPLE_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[otel]' 'opentelemetry-sdk>=1.20'
	touch $(BASE) $@

example: $(EXAMPLE_STAMP)
	$(PY) -m examples.shop.demo

## Install what the tests need, lint, type-check and run the whole suite.
test: $(STAMP) deps lint typecheck unit

## promtool and prometheus (Debian's prometheus package): the monitoring tests run them;
## etcd (Debian's etcd-server package): the cluster tests start it.
deps: etcd
	@command -v promtool >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus)

etcd:
	@command -v etcd >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends etcd-server)

## A local cluster: etcd and three brokers with their data in ./conveyor-cluster; prints the bootstrap list.
## Ctrl-C stops them all; running it again restarts the same cluster. NODES=5 runs five (docs/cluster.md).
CLUSTER_STAMP := $(VENV)/.installed-cluster
$(CLUSTER_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[cluster]'
	touch $(BASE) $@

cluster: $(CLUSTER_STAMP) etcd
	$(VENV)/bin/conveyor cluster local --dir ./conveyor-cluster $(if $(NODES),--nodes $(NODES))

lint: $(STAMP)
	$(VENV)/bin/ruff check conveyor broker consumers decorators monitoring benchmarks pipeline tests examples
	$(PY) tests/architecture/layers.py
	$(VENV)/bin/ruff format --check conveyor broker consumers decorators monitoring pipeline benchmarks tests examples

# mypy reads the package as it installs: .typecheck/conveyor links each folder under its installed name,
# so `conveyor.broker.x` resolves to broker/x.py and a wrong import of Conveyor's own modules is an error.
TYPECHECK := .typecheck
typecheck: $(STAMP)
	@rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/conveyor
	@for f in conveyor/*; do ln -s $(CURDIR)/$$f $(TYPECHECK)/conveyor/; done
	@for d in broker consumers decorators monitoring pipeline; do ln -s $(CURDIR)/$$d $(TYPECHECK)/conveyor/$$d; done
	MYPYPATH=$(TYPECHECK) $(VENV)/bin/mypy -p conveyor

## Two workers: most of the suite waits on brokers, etcd and Spark rather than computing, so
## two pytest processes on two cores take about 60 % of the serial time. TEST_WORKERS=0 runs serially.
## A folder that shares one session fixture (Spark, the built wheel) stays on one worker (tests/conftest.py).
TEST_WORKERS ?= 2
unit: $(STAMP) deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

## The long fault runs (kill -9 loops, power-loss cycles, the model-based test): about SOAK_SECONDS in all.
SOAK_SECONDS ?= 540
soak: $(STAMP)
	CONVEYOR_SOAK_SECONDS=$(SOAK_SECONDS) timeout $$(( $(SOAK_SECONDS) * 2 + 300 )) \
		$(PY) -m pytest -m soak tests/faults tests/replicated -q -s --timeout $$(( $(SOAK_SECONDS) + 300 ))

## Append/read throughput of the topic log under each fsync policy.
bench-log: $(STAMP)
	$(PY) -m conveyor.benchmarks.log_bench

## Failover of a replicated topic: kill -9 of its leader 20 times under load; p50 and max to the next confirm.
bench-failover: $(STAMP)
	$(PY) -m conveyor.benchmarks.failover_bench --kills 20

## End to end: broker, 1 producer and 2 consumers as processes; throughput, latency, CPU per process.
bench-e2e: $(STAMP)
	$(PY) -m conveyor.benchmarks.e2e_bench

clean:
	rm -rf $(VENV) conveyor-data conveyor-cluster .pytest_cache .mypy_cache .ruff_cache $(TYPECHECK)

## `conveyor bench` peers: Redis (redis-server + the redis client) always; `bench-peers` adds NATS and RabbitMQ.
.PHONY: bench-deps bench-peers bench bench-cluster bench-scale-out
bench-deps: $(STAMP)
	@command -v redis-server >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server)
	$(PY) -m pip install --quiet 'redis>=5' 'py-spy>=0.3'

bench-peers: bench-deps
	@command -v nats-server >/dev/null && test -x /usr/lib/rabbitmq/bin/rabbitmq-server || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nats-server rabbitmq-server)
	$(PY) -m pip install --quiet 'nats-py>=2.6' 'pika>=1.3'

## The default scenarios against every installed peer: an HTML report and JSON (about 6 minutes on 2 cores).
bench: bench-deps
	$(VENV)/bin/conveyor bench --config benchmarks/default.json --report bench-report.html --json bench-results.json

## Replicated topics against one node and NATS JetStream R3 on three local nats-servers (benchmarks/cluster.json).
bench-cluster: $(STAMP)
	@command -v nats-server >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nats-server)
	$(PY) -m pip install --quiet 'nats-py>=2.6'
	$(VENV)/bin/conveyor bench --config benchmarks/cluster.json --report bench-cluster.html --json bench-cluster.json

## Scale-out: 1, 2 and 4 partitions on as many brokers; CPU per stored message per broker, and a projection
## for 8 and 32 cores (benchmarks/README.md). Run it on a quiet machine: other processes' CPU is in the numbers.
bench-scale-out: $(STAMP) etcd
	$(VENV)/bin/conveyor bench --scale-out --repeat 3 --report bench-scale-out.html --json bench-scale-out.json

## The container image (Dockerfile) built with podman: installs podman, debootstrap and Debian's prometheus
## when missing, builds a local python:3.11-slim stand-in once (no registry here), then the image
## (deploy/podman/image.sh; docs/operations.md, "Deploy: container and compose"). Not part of `make test`.
.PHONY: image compose-test
image:
	bash deploy/podman/image.sh

## compose.yaml for real: broker + example consumer + Prometheus under podman-compose; publish and consume
## through the published port, Prometheus scrapes both and evaluates monitoring/alerts.yml; torn down after.
compose-test:
	bash deploy/podman/compose-test.sh
