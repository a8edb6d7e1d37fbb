#!/usr/bin/env bash
# Runs the containers' HEALTHCHECKs where podman cannot: podman 4.3 schedules them with systemd timers, and
# without systemd (a container or VM booted without it) no check ever runs, every container stays
# "(starting)" and `depends_on: condition: service_healthy` waits forever. setup.sh starts this in the
# background; it runs `podman healthcheck run` on every running container that has a healthcheck:
# every TICK_S while it is starting or unhealthy, every HEALTHY_S once healthy.
set -uo pipefail

TICK_S=${RLBUS_HEALTH_TICK_S:-2}
HEALTHY_S=${RLBUS_HEALTH_HEALTHY_S:-30}
declare -A last_ok=()

while true; do
    now=$SECONDS
    while read -r id status; do
        [ -n "$id" ] || continue
        case "$status" in
            *"(healthy)"*) [ $((now - ${last_ok[$id]:-0})) -ge "$HEALTHY_S" ] || continue ;;
            *"(starting)"*|*"(unhealthy)"*) ;;
            *) continue ;;  # no healthcheck
        esac
        if timeout 60 podman healthcheck run "$id" >/dev/null 2>&1; then last_ok[$id]=$now; fi
    done < <(podman ps --filter status=running --format '{{.ID}} {{.Status}}' 2>/dev/null)
    sleep "$TICK_S"
done
