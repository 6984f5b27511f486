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
LABEL=org.conveyor.standin

# One container run, so that a host where podman cannot start containers (cgroups, runtime, storage) fails
# here with runc's own words rather than in the middle of a build.
smoke_test() {
    out=$(timeout 120 podman run --rm --network none "$IMAGE" python -c 'import sys, venv; print(sys.version.split()[0])' 2>&1) \
        || { echo "python-standin: FAILED: podman cannot run a container of $IMAGE here:" >&2; echo "$out" >&2; exit 1; }
    echo "python-standin: a container of $IMAGE runs Python $out"
}

if podman image exists "$IMAGE" && [ "${STANDIN_REBUILD:-0}" != 1 ]; then
    kind=$(podman image inspect --format "{{ index .Labels \"$LABEL\" }}" "$IMAGE")
    echo "python-standin: $IMAGE exists (${kind:-not a stand-in}), kept"
    smoke_test
    exit 0
fi

# The Debian mirror this machine's apt uses (a CI machine may reach only its own mirror or proxy): the first
# URI of /etc/apt/sources.list{,.d/*} serving $SUITE (or any Debian suite), deb.debian.org if none.
# DEBIAN_MIRROR overrides it.
host_mirror() {
    python3 - "$SUITE" <<'PY'
import glob, re, sys
suite, found = sys.argv[1], []
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        fields = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
        if len(fields) >= 3 and fields[0] == "deb":
            found.append((fields[1], [fields[2]]))
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = {}
        for line in stanza.splitlines():
            if ":" in line and not line.startswith(("#", " ", "\t")):
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.split("#")[0].split()
        if "deb" in fields.get("types", []) and fields.get("enabled", ["yes"]) != ["no"]:
            found += [(uri, fields.get("suites", [])) for uri in fields.get("uris", [])]
debian = [(uri, suites) for uri, suites in found if "security" not in uri and any(
    re.fullmatch(r"(buster|bullseye|bookworm|trixie|forky|sid|stable|testing|unstable)", s) for s in suites)]
best = [uri for uri, suites in debian if suite in suites] or [uri for uri, _ in debian]
print(best[0].rstrip("/") if best else "http://deb.debian.org/debian")
PY
}
MIRROR="${DEBIAN_MIRROR:-$(host_mirror)}"
echo "python-standin: debootstrap $SUITE from $MIRROR"

root=$(mktemp -d /var/tmp/conveyor-python-standin.XXXXXX)
# A debootstrap stopped midway may leave /proc, /sys or a bound /dev mounted inside the root: unmount
# them first, and never let rm cross into another filesystem.
cleanup() {
    awk -v root="$root/" 'index($2, root) == 1 { print $2 }' /proc/mounts | sort -r | while read -r mounted; do
        umount -l "$mounted" || true
    done
    rm -rf --one-file-system "$root"
}
trap cleanup EXIT
timeout 1200 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR" \
    || { echo "python-standin: FAILED: debootstrap $SUITE from $MIRROR (set DEBIAN_MIRROR to a reachable mirror)" >&2
         tail -20 "$root/debootstrap/debootstrap.log" >&2 2>/dev/null || true; exit 1; }
chroot "$root" python3 -m venv /usr/local
chroot "$root" /usr/local/bin/python -m pip --version
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | timeout 600 podman import \
    --change "LABEL $LABEL=debootstrap-$SUITE" \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$IMAGE"
echo "python-standin: built $IMAGE from debootstrap $SUITE"
smoke_test
