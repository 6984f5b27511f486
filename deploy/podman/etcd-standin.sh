#!/bin/bash
# A local stand-in for the etcd image compose.yaml's `cluster` profile names, for machines that can pull
# from no registry: the binary of Debian's `etcd-server` (installed by host-setup.sh) as `etcd` on PATH,
# as the official image has it (compose.yaml gives etcd's flags). Kept once built.
set -eu

IMAGE="$1"                                   # e.g. quay.io/coreos/etcd:v3.5.17
BASE="${PYTHON_IMAGE:-docker.io/library/python:3.11-slim}"

if podman image exists "$IMAGE" && [ "${STANDIN_REBUILD:-0}" != 1 ]; then
    echo "etcd-standin: $IMAGE exists, kept"
    exit 0
fi

ctx=$(mktemp -d /var/tmp/conveyor-etcd-standin.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
cp "$(command -v etcd)" "$ctx/etcd"
cat > "$ctx/Containerfile" <<CONTAINERFILE
FROM $BASE
LABEL org.conveyor.standin=debian-etcd-server
COPY etcd /usr/local/bin/etcd
EXPOSE 2379 2380
CMD ["etcd"]
CONTAINERFILE
timeout 600 podman build --pull=never --network host --tag "$IMAGE" "$ctx"
echo "etcd-standin: built $IMAGE from $(etcd --version 2>&1 | head -1)"
