#!/usr/bin/env bash
# Make this machine a Docker host for the compose test: Debian's docker.io and
# docker-compose (1.29) when missing, debootstrap for stand-in base images,
# and a running dockerd. Needs root and apt; idempotent.
set -euo pipefail
log() { echo "[compose-test] $*"; }

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if ((${#missing[@]})); then
    log "installing ${missing[*]} (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
    log "no Docker engine answers: starting dockerd (log: /var/log/pdserve-dockerd.log)"
    setsid dockerd >/var/log/pdserve-dockerd.log 2>&1 </dev/null &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
fi
docker info --format '[compose-test] Docker engine {{.ServerVersion}} ({{.Driver}}), docker-compose '"$(docker-compose version --short)"
