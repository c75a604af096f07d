#!/usr/bin/env bash
# Base images for the compose demo, built from Debian packages: for machines that reach no image
# registry (air-gapped clusters, our CI). With Docker Hub, skip this: compose.yaml defaults to
# python:3.11-slim, redis:7 and prom/prometheus.
#
#   eval "$(scripts/build-base-images.sh [--ca-bundle FILE] [--wheels DIR] [--mirror URL] [--rebuild])"
#   docker compose up --build -d
#
# It prints the variables compose.yaml reads (PDSERVE_BASE_IMAGE, PDSERVE_REDIS_IMAGE,
# PDSERVE_PROMETHEUS_IMAGE). Images that already exist are kept unless --rebuild.
#   --ca-bundle FILE  trusted inside the images (hosts behind a TLS-inspecting proxy)
#   --wheels DIR      pre-downloaded wheels, torch's CPU build among them (else the CPU index)
#   --mirror URL      Debian mirror for debootstrap and apt (default http://deb.debian.org/debian)
# Needs root, debootstrap and a Docker engine (DOCKER_HOST).
set -euo pipefail
SUITE=bookworm
ROOTFS_IMAGE="pdserve/debian-rootfs:$SUITE"
PYTHON_IMAGE="pdserve/python-base:$SUITE"
REDIS_IMAGE="pdserve/redis-base:$SUITE"
PROMETHEUS_IMAGE="pdserve/prometheus-base:$SUITE"
TORCH_VERSION=2.13.0
CA_BUNDLE="" WHEELS="" MIRROR="http://deb.debian.org/debian" REBUILD=0

while [ $# -gt 0 ]; do
  case "$1" in
    --ca-bundle) CA_BUNDLE="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --mirror) MIRROR="$2"; shift 2 ;;
    --rebuild) REBUILD=1; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

say() { echo "[build-base-images] $*" >&2; }
have() { [ "$REBUILD" = 0 ] && docker image inspect "$1" >/dev/null 2>&1; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

build_rootfs() {
  have "$ROOTFS_IMAGE" && return
  say "debootstrap $SUITE (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$SUITE" "$WORK/rootfs" "$MIRROR" >&2
  echo "deb $MIRROR $SUITE main" > "$WORK/rootfs/etc/apt/sources.list"
  tar -C "$WORK/rootfs" -c . | docker import - "$ROOTFS_IMAGE" >&2
  rm -rf "$WORK/rootfs"
}

# A build context holding the CA bundle (or an empty file) and the wheels, for every image.
prepare_context() {
  mkdir -p "$WORK/ctx/wheels"
  if [ -n "$CA_BUNDLE" ]; then cp "$CA_BUNDLE" "$WORK/ctx/ca.crt"; else : > "$WORK/ctx/ca.crt"; fi
  if [ -n "$WHEELS" ]; then cp "$WHEELS"/torch-"$TORCH_VERSION"*.whl "$WORK/ctx/wheels/" 2>/dev/null || true; fi
}

# Common first steps: the host's CA bundle replaces Debian's when given (it is a superset there).
PREAMBLE="FROM $ROOTFS_IMAGE
COPY ca.crt /tmp/ca.crt
RUN if [ -s /tmp/ca.crt ]; then cp /tmp/ca.crt /etc/ssl/certs/ca-certificates.crt; fi; rm /tmp/ca.crt
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt"

build_image() {  # name, Dockerfile text
  have "$1" && return
  say "building $1"
  printf '%s\n' "$2" | docker build --network host -t "$1" -f - "$WORK/ctx" >&2
}

python_dockerfile() {
  # python:3.11-slim's shape: a `python` command, pip free to install, torch pinned so nothing
  # installed later swaps in the multi-GB CUDA build.
  cat <<DOCKERFILE
$PREAMBLE
COPY wheels /tmp/wheels
RUN ln -sf python3 /usr/bin/python \
 && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \
 && echo "torch==$TORCH_VERSION" > /etc/pip-constraints.txt \
 && if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then src="--find-links /tmp/wheels"; \
    else src="--extra-index-url https://download.pytorch.org/whl/cpu"; fi \
 && python -m pip install --no-cache-dir \$src "torch==$TORCH_VERSION" \
 && rm -rf /tmp/wheels
ENV PIP_CONSTRAINT=/etc/pip-constraints.txt
DOCKERFILE
}

apt_dockerfile() {  # packages
  cat <<DOCKERFILE
$PREAMBLE
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $* \
 && rm -rf /var/lib/apt/lists/*
DOCKERFILE
}

build_rootfs
prepare_context
build_image "$PYTHON_IMAGE" "$(python_dockerfile)"
build_image "$REDIS_IMAGE" "$(apt_dockerfile redis-server)"
build_image "$PROMETHEUS_IMAGE" "$(apt_dockerfile prometheus)"
echo "export PDSERVE_BASE_IMAGE=$PYTHON_IMAGE PDSERVE_REDIS_IMAGE=$REDIS_IMAGE PDSERVE_PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE"
