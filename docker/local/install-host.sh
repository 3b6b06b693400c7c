#!/usr/bin/env bash
# `make install-containers`: what `make images` and `make test-containers` need on a Debian 12 host
# without Docker: podman (rootful) with runc, debootstrap for the base image, and Compose v2.
# Idempotent: installs only what is missing, rewrites only its own containers.conf drop-in.
set -euo pipefail

# podman 4.3 + runc: crun fails on a cgroup-v1/hybrid host ("cgroups in hybrid mode not supported").
# netavark + aardvark-dns: bridge networks where service names resolve (compose's networks).
pkgs=(podman runc netavark aardvark-dns iptables debootstrap)
missing=()
for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# A drop-in (podman reads /etc/containers/containers.conf.d/*.conf after containers.conf).
mkdir -p /etc/containers/containers.conf.d
cat >/etc/containers/containers.conf.d/50-burstrl.conf <<'CONF'
# Written by burstrl's `make install-containers` (docker/local/install-host.sh).
[containers]
# Setting RLIMIT_NOFILE inside containers is refused on this kind of host: keep the host's limits.
default_ulimits = []

[engine]
# crun fails with "cgroups in hybrid mode not supported"; runc works.
runtime = "runc"
cgroup_manager = "cgroupfs"
# No journald/systemd: events to a file.
events_logger = "file"
CONF

# Compose v2 (the `docker compose` plugin; v1's docker-compose 1.29 rejects compose.yaml's top-level
# `name`). Debian 12 has only v1, Debian 13 ships v2 as a static binary whose one dependency
# (libc6 >= 2.34) Debian 12 meets: fetch that one package through apt with a throw-away source list,
# so the host's sources stay Debian 12's.
if ! docker-compose version 2>/dev/null | grep -q "version v\?2"; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  echo "deb http://deb.debian.org/debian trixie main" >"$tmp/sources.list"
  opts=(-o "Dir::Etc::sourcelist=$tmp/sources.list" -o "Dir::Etc::sourceparts=-" -o "Dir::State::Lists=$tmp/lists"
    -o "Dir::Cache=$tmp/cache" -o "APT::Sandbox::User=root")
  apt-get "${opts[@]}" update -qq
  (cd "$tmp" && apt-get "${opts[@]}" download -qq docker-compose)
  dpkg -i "$tmp"/docker-compose_2*.deb >/dev/null
fi
# The docker CLI finds the plugin in /usr/libexec/docker/cli-plugins (the package puts it there).
command -v docker >/dev/null && docker compose version >/dev/null 2>&1 || echo "note: no docker CLI with the compose plugin; docker-compose (v2) works alone"
podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.NetworkBackend}}' | grep -q "^runc netavark" \
  || { echo "podman is not using runc + netavark: check /etc/containers/containers.conf" >&2; exit 1; }
echo "containers: podman $(podman version --format '{{.Client.Version}}'), $(docker-compose version --short 2>/dev/null | sed 's/^/compose /')"
