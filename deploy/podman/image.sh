#!/bin/bash
# `make image`: build Conveyor's image (the repository's Dockerfile) with podman on a machine without a
# Docker daemon or registry access. Prepares the host (host-setup.sh) and the local python:3.11-slim
# stand-in (python-standin.sh), then builds with --pull=never. IMAGE names the result (conveyor:latest).
#
# pip inside the build trusts the host's CA bundle through the Dockerfile's optional `pip_ca` secret:
# a network that inspects TLS re-signs PyPI's certificate with a CA only the host knows.
set -eu
cd "$(dirname "$0")/../.."

IMAGE="${IMAGE:-conveyor:latest}"
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

bash deploy/podman/host-setup.sh
bash deploy/podman/python-standin.sh

# --format docker: the OCI format has no HEALTHCHECK.
set -- --pull=never --format docker --tag "$IMAGE" --file Dockerfile
[ -s "$CA_BUNDLE" ] && set -- "$@" --secret "id=pip_ca,src=$CA_BUNDLE"
podman build "$@" .
podman image inspect --format 'image: {{.RepoTags}} {{.Size}} bytes, user {{.Config.User}}' "$IMAGE"
