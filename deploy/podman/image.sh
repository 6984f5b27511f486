#!/bin/bash
# `make image`: build Conveyor's image (the repository's Dockerfile) with podman on a machine without a
# Docker daemon or registry access. Prepares the host (host-setup.sh) and the local python:3.11-slim
# stand-in (python-standin.sh), then builds with --pull=never. IMAGE names the result (conveyor:latest).
#
# pip inside the build trusts the host's CA bundle through the Dockerfile's optional `pip_ca` secret:
# a network that inspects TLS re-signs PyPI's certificate with a CA only the host knows. The build's RUN
# steps use the host's network: pip then resolves and connects as the host does (a resolver on the host's
# loopback, a firewall without the bridge's NAT rules), which a build on podman's bridge may not.
set -eu
cd "$(dirname "$0")/../.."

IMAGE="${IMAGE:-conveyor:latest}"
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

bash deploy/podman/host-setup.sh
bash deploy/podman/python-standin.sh

# --format docker: the OCI format has no HEALTHCHECK.
set -- --pull=never --network host --format docker --tag "$IMAGE" --file Dockerfile
[ -s "$CA_BUNDLE" ] && set -- "$@" --secret "id=pip_ca,src=$CA_BUNDLE"
timeout "${IMAGE_BUILD_TIMEOUT:-1200}" podman build "$@" . \
    || { echo "image: FAILED: podman build of $IMAGE (exit $?; a pip error above means PyPI was not reachable)" >&2; exit 1; }
podman image inspect --format 'image: {{.RepoTags}} {{.Size}} bytes, user {{.Config.User}}' "$IMAGE"
