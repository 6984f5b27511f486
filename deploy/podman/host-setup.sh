#!/bin/bash
# Install and configure podman on a Debian machine without a Docker daemon (CI, this kind of VM).
#
# Why each setting (issue #21): the machine runs as root inside a VM whose cgroup tree systemd does not
# own, so podman needs runc with the cgroupfs manager; its default ulimits are not inherited, so nofile
# and nproc are given explicitly; events go to a file because there is no journald. Idempotent.
set -eu

# netavark + aardvark-dns: compose services find each other by name (CNI would need the dnsname plugin).
# prometheus, etcd-server: the stand-ins' binaries (deploy/podman/*-standin.sh); the host's promtool and etcd.
PACKAGES="podman podman-compose debootstrap runc uidmap slirp4netns netavark aardvark-dns iptables prometheus etcd-server ca-certificates"
# shellcheck disable=SC2086
if ! dpkg -s $PACKAGES >/dev/null 2>&1; then
    apt-get update -q
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $PACKAGES
fi

# Explicit limits: runc may lower a limit but not raise one (no CAP_SYS_RESOURCE in this kind of VM), and
# podman's own defaults (nofile 1048576, nproc 4194304) are above the hard limits here. nproc stays at
# 32768: runc was refused 65536 here although the shell's hard limit is higher.
limit() { hard=$(ulimit -H "$1"); [ "$hard" = unlimited ] || [ "$hard" -gt "$2" ] && hard=$2; echo "$hard"; }
nofile=$(limit -n 65536)
nproc=$(limit -u 32768)
mkdir -p /etc/containers
conf=/etc/containers/containers.conf
if [ -e "$conf" ] && ! grep -q 'conveyor: deploy/podman/host-setup.sh' "$conf"; then
    echo "host-setup: $conf exists and is not ours; left as it is" >&2
else
    cat > "$conf" <<CONF
# conveyor: deploy/podman/host-setup.sh (runc + cgroupfs + explicit ulimits; see docs/operations.md)
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
CONF
fi
# No registry can be reached: short names must not prompt, and nothing is pulled.
reg=/etc/containers/registries.conf
grep -q '^short-name-mode' "$reg" 2>/dev/null || printf 'unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n' >> "$reg"
podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}}'
