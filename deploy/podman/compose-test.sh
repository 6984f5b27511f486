#!/bin/bash
# `make compose-test`: the repository's compose.yaml for real, with podman-compose on a machine without a
# Docker daemon or registry access. Builds the image (image.sh) and stand-ins for the Prometheus and etcd
# images, tagged with the names compose.yaml uses. Brings up broker + consumer + Prometheus under a project
# of its own on free host ports and runs compose_check.py (publish and consume through the published port,
# the example consumer handles a message, Prometheus scrapes broker and runner and evaluates every rule);
# then the `cluster` profile (etcd, n1..n3: three nodes alive, a replicated topic written and read back,
# Prometheus finds the nodes). Tears it all down whatever happened; exits non-zero on any failure.
# Grafana is not started: no image can be had here (tests/deploy/test_container_files.py checks it statically).
set -eu
cd "$(dirname "$0")/../.."

PROJECT="${COMPOSE_PROJECT:-conveyor-compose-test}"
SERVICES=(broker consumer prometheus)
CLUSTER_SERVICES=(etcd n1 n2 n3)             # the `cluster` profile (podman-compose 1.0 names them explicitly)
export IMAGE=conveyor:latest   # the name compose.yaml gives the image it builds

bash deploy/podman/image.sh
prometheus_image=$(sed -n 's/^ *image: *\(prom\/prometheus:[^ ]*\) *$/\1/p' compose.yaml)
[ -n "$prometheus_image" ] || { echo "compose-test: no prom/prometheus image in compose.yaml" >&2; exit 1; }
bash deploy/podman/prometheus-standin.sh "$prometheus_image"
etcd_image=$(sed -n 's/^ *image: *\([^ ]*\/etcd:[^ ]*\) *$/\1/p' compose.yaml)
[ -n "$etcd_image" ] || { echo "compose-test: no etcd image in compose.yaml" >&2; exit 1; }
bash deploy/podman/etcd-standin.sh "$etcd_image"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
BROKER_PORT=$(free_port) BROKER_METRICS_PORT=$(free_port) RUNNER_METRICS_PORT=$(free_port) PROMETHEUS_PORT=$(free_port)
export BROKER_PORT BROKER_METRICS_PORT RUNNER_METRICS_PORT PROMETHEUS_PORT

compose() { podman-compose --project-name "$PROJECT" --file compose.yaml "$@"; }
teardown() {
    status=$?
    if [ "$status" != 0 ]; then
        for service in "${SERVICES[@]}" "${CLUSTER_SERVICES[@]}"; do
            echo "--- logs of $service"; podman logs --tail 40 "${PROJECT}_${service}_1" 2>&1 || true
        done
    fi
    # By name first, with --volumes: the consumer's data volume is the image's anonymous one. The brokers
    # go before etcd: a cluster node stopping without etcd waits for it.
    for service in n3 n2 n1 etcd "${SERVICES[@]}"; do
        podman rm --force --volumes --ignore --time 5 "${PROJECT}_${service}_1" >/dev/null 2>&1 || true
    done
    compose down --volumes >/dev/null 2>&1 || true
    podman pod rm --force --ignore "pod_${PROJECT}" >/dev/null 2>&1 || true
    podman network rm --force "${PROJECT}_default" >/dev/null 2>&1 || true
    echo "compose-test: torn down (exit $status)"
    exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM

compose down --volumes >/dev/null 2>&1 || true   # a previous run killed before its teardown
compose up --detach --no-build "${SERVICES[@]}"
check() {
    python3 deploy/podman/compose_check.py \
        --image "$IMAGE" --broker-port "$BROKER_PORT" --runner-container "${PROJECT}_consumer_1" \
        --broker-container "${PROJECT}_broker_1" --prometheus "http://127.0.0.1:$PROMETHEUS_PORT" \
        --rules monitoring/alerts.yml "$@"
}
check
if [ "${COMPOSE_TEST_CLUSTER:-1}" = 1 ]; then   # COMPOSE_TEST_CLUSTER=0 skips the cluster profile
    compose up --detach --no-build "${CLUSTER_SERVICES[@]}"
    check --cluster-network "${PROJECT}_default"
fi
echo "compose-test: passed"
