#!/bin/bash
# Install and configure podman on a Debian machine without a Docker daemon (CI, this kind of VM).
#
# Why each setting (issue #21): the machine runs as root inside a VM whose cgroup tree systemd does not
# own, so podman needs runc with the cgroupfs manager (on cgroup v1 and v2 alike); its default ulimits are
# not inherited, so nofile and nproc are given explicitly; events go to a file because there may be no
# journald. The storage driver is chosen by trying it: the kernel's overlay where a mount works on the
# store's filesystem, else fuse-overlayfs where /dev/fuse exists, else vfs (slow and large, but works
# anywhere). Files it did not write are left alone. Idempotent; prints what it chose.
set -eu

say() { echo "host-setup: $*"; }
die() { echo "host-setup: FAILED: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (it installs packages with apt-get and runs podman as root)"
command -v apt-get >/dev/null || die "needs a Debian-like machine with apt-get"

# netavark + aardvark-dns: compose services find each other by name (CNI would need the dnsname plugin).
# prometheus, etcd-server: the stand-ins' binaries (deploy/podman/*-standin.sh); the host's promtool and etcd.
# fuse-overlayfs: the storage driver where the kernel's overlay cannot mount (see storage_driver below).
PACKAGES="podman podman-compose debootstrap runc uidmap slirp4netns netavark aardvark-dns iptables fuse-overlayfs prometheus etcd-server ca-certificates"
missing=""
for package in $PACKAGES; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null || true)
    [ "$status" = installed ] || missing="$missing $package"
done
if [ -n "$missing" ]; then
    say "installing$missing"
    apt_get() { timeout 900 apt-get -q -o DPkg::Lock::Timeout=300 "$@"; }
    apt_get update || die "apt-get update failed (are the machine's apt sources reachable?)"
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt_get install -y --no-install-recommends $missing \
        || die "apt-get install$missing failed"
fi
for tool in podman podman-compose debootstrap runc prometheus etcd /usr/lib/podman/netavark; do
    command -v "$tool" >/dev/null || die "$tool is not on PATH after installing its package"
done

# Explicit limits: runc may lower a limit but not raise one (no CAP_SYS_RESOURCE in this kind of VM), and
# podman's own defaults (nofile 1048576, nproc 4194304) are above the hard limits here. nproc stays at
# 32768: runc was refused 65536 here although the shell's hard limit is higher.
limit() { hard=$(ulimit -H "$1"); [ "$hard" = unlimited ] || [ "$hard" -gt "$2" ] && hard=$2; echo "$hard"; }
nofile=$(limit -n 65536)
nproc=$(limit -u 32768)
mkdir -p /etc/containers
MARK='conveyor: deploy/podman/host-setup.sh'
ours() { [ ! -e "$1" ] || grep -q "$MARK" "$1"; }

conf=/etc/containers/containers.conf
if ours "$conf"; then
    cat > "$conf" <<CONF
# $MARK (runc + cgroupfs + explicit ulimits; see docs/operations.md)
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
CONF
else
    say "$conf exists and is not ours; left as it is" >&2
fi

# The storage driver, tried rather than assumed: overlay on an overlay root (a container running CI) or on
# some network filesystems does not mount. A store already holding images keeps its driver: podman refuses
# to open a store with another one.
GRAPHROOT=/var/lib/containers/storage
overlay_mounts() {
    mkdir -p "$GRAPHROOT"
    probe=$(mktemp -d "$GRAPHROOT/../conveyor-overlay-probe.XXXXXX")
    mkdir "$probe/lower" "$probe/upper" "$probe/work" "$probe/merged"
    ok=1
    if timeout 30 mount -t overlay overlay \
        -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" 2>/dev/null; then
        ok=0
        umount "$probe/merged" || true
    fi
    rm -rf "$probe"
    return "$ok"
}
storage_driver() {
    for existing in overlay vfs; do
        if [ -s "$GRAPHROOT/$existing-images/images.json" ] && [ "$(cat "$GRAPHROOT/$existing-images/images.json")" != "[]" ]; then
            echo "$existing"; return
        fi
    done
    if overlay_mounts; then echo overlay
    elif [ -c /dev/fuse ] && command -v fuse-overlayfs >/dev/null; then echo fuse-overlayfs
    else echo vfs
    fi
}
storage=/etc/containers/storage.conf
if ours "$storage"; then
    choice=$(storage_driver)
    driver=$choice; options=""
    if [ "$choice" = fuse-overlayfs ]; then
        driver=overlay
        options=$'\n[storage.options.overlay]\nmount_program = "/usr/bin/fuse-overlayfs"'
    fi
    cat > "$storage" <<CONF
# $MARK (storage driver chosen by trying it: $choice)
[storage]
driver = "$driver"
graphroot = "$GRAPHROOT"
runroot = "/run/containers/storage"
$options
CONF
else
    say "$storage exists and is not ours; left as it is" >&2
fi

# No registry can be reached: short names must not prompt, and nothing is pulled.
reg=/etc/containers/registries.conf
grep -q '^short-name-mode' "$reg" 2>/dev/null || printf 'unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n' >> "$reg"

cgroup=v1; [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ] && cgroup=v2
info=$(timeout 120 podman info --format \
    'runtime {{.Host.OCIRuntime.Name}}, cgroup manager {{.Host.CgroupManager}}, storage {{.Store.GraphDriverName}}, network {{.Host.NetworkBackend}}' 2>&1) \
    || die "podman info failed: $info"
mount_program=$(sed -n 's/^mount_program = "\(.*\)"/ (mount program \1)/p' "$storage" 2>/dev/null || true)
say "$info$mount_program, cgroup $cgroup, nofile $nofile, nproc $nproc"
