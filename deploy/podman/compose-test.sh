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

# Host ports below the kernel's ephemeral range: a test running at the same time binds port 0 and gets one
# from that range, so it cannot take these between the choice and `compose up`; each is checked free.
host_ports() {
    python3 - "$1" <<'PY'
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
chosen = []
while len(chosen) < int(sys.argv[1]):
    port = random.randrange(max(1024, low - 12000), low)
    try:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
    except OSError:
        continue
    if port not in chosen:
        chosen.append(port)
print(*chosen)
PY
}
read -r BROKER_PORT BROKER_METRICS_PORT RUNNER_METRICS_PORT PROMETHEUS_PORT < <(host_ports 4) || true
[ -n "${PROMETHEUS_PORT:-}" ] || { echo "compose-test: FAILED: no free host ports found" >&2; exit 1; }
export BROKER_PORT BROKER_METRICS_PORT RUNNER_METRICS_PORT PROMETHEUS_PORT
echo "compose-test: project $PROJECT, host ports broker $BROKER_PORT, metrics $BROKER_METRICS_PORT," \
    "runner $RUNNER_METRICS_PORT, prometheus $PROMETHEUS_PORT"

CLIENT_LABEL="org.conveyor.compose-test=$PROJECT"   # the one-off client containers compose_check.py runs
COMPOSE=(timeout "${COMPOSE_TIMEOUT:-600}" podman-compose --project-name "$PROJECT" --file compose.yaml)
compose() { "${COMPOSE[@]}" "$@"; }
# Everything this project made, whatever state it is in: containers by name and by label (podman-compose's
# and the clients'), the pod, the volumes and the network. Every step is bounded.
remove_all() {
    # By name first, with --volumes: the consumer's data volume is the image's anonymous one. The brokers
    # go before etcd: a cluster node stopping without etcd waits for it.
    for service in n3 n2 n1 etcd "${SERVICES[@]}"; do
        timeout 60 podman rm --force --volumes --ignore --time 5 "${PROJECT}_${service}_1" >/dev/null 2>&1 || true
    done
    for label in "io.podman.compose.project=$PROJECT" "$CLIENT_LABEL"; do
        for id in $(timeout 60 podman ps --all --quiet --filter "label=$label" 2>/dev/null); do
            timeout 60 podman rm --force --volumes --time 5 "$id" >/dev/null 2>&1 || true
        done
    done
    compose down --volumes >/dev/null 2>&1 || true
    timeout 60 podman pod rm --force --ignore "pod_${PROJECT}" >/dev/null 2>&1 || true
    for volume in $(timeout 60 podman volume ls --quiet --filter "label=io.podman.compose.project=$PROJECT" 2>/dev/null); do
        timeout 60 podman volume rm --force "$volume" >/dev/null 2>&1 || true
    done
    timeout 60 podman network rm --force "${PROJECT}_default" >/dev/null 2>&1 || true
}
# The long steps run in the background and are waited for: a signal to this script then runs the
# teardown at once, not after the step (bash runs traps only between foreground commands).
step_pid=""
bounded() {
    "$@" &   # a simple command: the background job is `timeout` itself, which passes a TERM on
    step_pid=$!
    local status=0
    wait "$step_pid" || status=$?
    step_pid=""
    return "$status"
}
teardown() {
    status=$?
    trap - EXIT INT TERM
    [ -z "$step_pid" ] || { kill "$step_pid" 2>/dev/null; wait "$step_pid" 2>/dev/null || true; }
    if [ "$status" != 0 ]; then
        for service in "${SERVICES[@]}" "${CLUSTER_SERVICES[@]}"; do
            podman container exists "${PROJECT}_${service}_1" 2>/dev/null || continue
            echo "--- logs of $service"; timeout 30 podman logs --tail 40 "${PROJECT}_${service}_1" 2>&1 || true
        done
    fi
    remove_all
    left=$(timeout 60 podman ps --all --quiet --filter "label=io.podman.compose.project=$PROJECT" 2>/dev/null | wc -l)
    echo "compose-test: torn down ($left containers left, exit $status, ${SECONDS} s)"
    exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM

remove_all   # what a previous run killed before its teardown left
bounded "${COMPOSE[@]}" up --detach --no-build "${SERVICES[@]}" \
    || { echo "compose-test: FAILED: compose up" >&2; exit 1; }
check() {
    bounded timeout "${CHECK_TIMEOUT:-900}" python3 deploy/podman/compose_check.py \
        --image "$IMAGE" --client-label "$CLIENT_LABEL" --broker-port "$BROKER_PORT" \
        --runner-container "${PROJECT}_consumer_1" --broker-container "${PROJECT}_broker_1" \
        --prometheus "http://127.0.0.1:$PROMETHEUS_PORT" \
        --rules monitoring/alerts.yml "$@" \
        || { status=$?; echo "compose-test: FAILED: compose_check.py exited $status" \
                 "(124: still running after CHECK_TIMEOUT=${CHECK_TIMEOUT:-900} s)" >&2; return "$status"; }
}
check
if [ "${COMPOSE_TEST_CLUSTER:-1}" = 1 ]; then   # COMPOSE_TEST_CLUSTER=0 skips the cluster profile
    bounded "${COMPOSE[@]}" up --detach --no-build "${CLUSTER_SERVICES[@]}" \
        || { echo "compose-test: FAILED: compose up (cluster)" >&2; exit 1; }
    check --cluster-network "${PROJECT}_default"
fi
echo "compose-test: passed in ${SECONDS} s"
