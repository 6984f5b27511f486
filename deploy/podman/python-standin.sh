#!/bin/bash
# A local stand-in for the official `python:3.11-slim` image, for machines that can pull from no registry.
#
# Debian bookworm's python3 is 3.11. The official image's python lives in /usr/local and pip may install
# into it; Debian's /usr/bin/python3 is "externally managed" (PEP 668) and refuses. So the stand-in makes
# /usr/local a venv of Debian's python: `python`, `python3` and `pip` in /usr/local/bin, first on PATH,
# as in the official image. Built once and kept (the label marks it); STANDIN_REBUILD=1 builds it again.
# A real python:3.11-slim already present (no label) is left alone.
set -eu

IMAGE="${PYTHON_IMAGE:-docker.io/library/python:3.11-slim}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
LABEL=org.conveyor.standin

if podman image exists "$IMAGE" && [ "${STANDIN_REBUILD:-0}" != 1 ]; then
    kind=$(podman image inspect --format "{{ index .Labels \"$LABEL\" }}" "$IMAGE")
    echo "python-standin: $IMAGE exists (${kind:-not a stand-in}), kept"
    exit 0
fi

root=$(mktemp -d /var/tmp/conveyor-python-standin.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR"
chroot "$root" python3 -m venv /usr/local
chroot "$root" /usr/local/bin/python -m pip --version
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | podman import \
    --change "LABEL $LABEL=debootstrap-$SUITE" \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$IMAGE"
echo "python-standin: built $IMAGE from debootstrap $SUITE"
