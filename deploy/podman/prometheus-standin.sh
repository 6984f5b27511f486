#!/bin/bash
# A local stand-in for the Prometheus image compose.yaml names, for machines that can pull from no registry:
# the binary of Debian's `prometheus` package (installed by host-setup.sh) laid out as the official image
# lays it out (/bin/prometheus as entry point, config in /etc/prometheus, data in /prometheus, user nobody).
# Built on the Python stand-in's Debian root, so it costs one small layer. Kept once built.
set -eu

IMAGE="$1"                                   # the name compose.yaml uses, e.g. prom/prometheus:v2.53.4
BASE="${PYTHON_IMAGE:-docker.io/library/python:3.11-slim}"
LABEL=org.conveyor.standin

case "$IMAGE" in */*/*) ;; */*) IMAGE="docker.io/$IMAGE" ;; *) IMAGE="docker.io/library/$IMAGE" ;; esac
if podman image exists "$IMAGE" && [ "${STANDIN_REBUILD:-0}" != 1 ]; then
    echo "prometheus-standin: $IMAGE exists, kept"
    exit 0
fi

ctx=$(mktemp -d /var/tmp/conveyor-prometheus-standin.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
cp "$(command -v prometheus)" "$ctx/prometheus"
cat > "$ctx/Containerfile" <<CONTAINERFILE
FROM $BASE
LABEL $LABEL=debian-prometheus
COPY prometheus /bin/prometheus
RUN mkdir -p /etc/prometheus /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
VOLUME ["/prometheus"]
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
CONTAINERFILE
timeout 600 podman build --pull=never --network host --tag "$IMAGE" "$ctx"
echo "prometheus-standin: built $IMAGE from $(prometheus --version 2>&1 | head -1)"
