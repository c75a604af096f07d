#!/usr/bin/env bash
# A Docker engine of our own, for machines where none runs (CI, the dev machines): its own data
# root, exec root, pid file and socket, so it never touches a system dockerd or its images.
#
#   eval "$(scripts/private-dockerd.sh start)"   # prints: export DOCKER_HOST=unix://...
#   scripts/private-dockerd.sh stop
#
# Needs root and Debian's docker.io. Images stay in the data root between runs, so a second CI
# run on the same machine reuses them. PDSERVE_DOCKER_STATE / PDSERVE_DOCKER_RUN move the dirs.
set -euo pipefail
STATE="${PDSERVE_DOCKER_STATE:-/var/lib/pdserve-docker}"
RUN="${PDSERVE_DOCKER_RUN:-/run/pdserve-docker}"
SOCK="unix://$RUN/docker.sock"

answers() { docker -H "$SOCK" info >/dev/null 2>&1; }

start() {
  if answers; then echo "export DOCKER_HOST=$SOCK"; return; fi
  command -v dockerd >/dev/null || { echo "dockerd is not installed (apt-get install docker.io)" >&2; exit 1; }
  mkdir -p "$STATE" "$RUN"
  # No iptables rules: builds use the host network and the demo's containers only talk to each
  # other and to published ports on loopback; the host's own test networks stay as they are.
  setsid dockerd --data-root "$STATE" --exec-root "$RUN/exec" --pidfile "$RUN/dockerd.pid" \
    --host "$SOCK" --storage-driver overlay2 --iptables=false \
    >"$RUN/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 60); do
    if answers; then echo "export DOCKER_HOST=$SOCK"; return; fi
    sleep 0.5
  done
  echo "dockerd did not answer within 30 s; its log:" >&2
  tail -20 "$RUN/dockerd.log" >&2
  exit 1
}

stop() {
  [ -f "$RUN/dockerd.pid" ] || return 0
  pid="$(cat "$RUN/dockerd.pid")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
