#!/usr/bin/env bash
# The local base image for builds on a machine that reaches no image registry (only Debian's apt
# mirror and PyPI): Debian bookworm minbase from debootstrap, imported into podman.
#   docker/local/build-base.sh [IMAGE]        # default localhost/burstrl-base:bookworm
# It stands in for python:3.11-slim-bookworm (the Dockerfile's PYTHON_IMAGE default): bookworm's python3
# is 3.11, and /usr/local/bin/python{,3} point at it, as in the slim image (compose's
# BURSTRL_SANDBOX_PYTHON names that path).
# Idempotent and cached: an image whose label matches this recipe is kept; the rootfs tarball is kept
# under $BURSTRL_CONTAINER_CACHE (default ~/.cache/burstrl/containers), so a removed image is
# re-imported in seconds, without debootstrap.
set -euo pipefail

image="${1:-localhost/burstrl-base:bookworm}"
cache="${BURSTRL_CONTAINER_CACHE:-$HOME/.cache/burstrl/containers}"
suite=bookworm
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# python3-venv: the Dockerfile makes /opt/venv; ca-certificates: pip's TLS; util-linux (essential,
# so in minbase) brings `unshare` for the code sandbox.
packages=python3,python3-venv,python-is-python3,ca-certificates
recipe=$(printf '%s\n' "$suite" "$packages" "v1" | sha256sum | cut -c1-16)

have=$(podman image inspect --format '{{ index .Labels "burstrl.base.recipe" }}' "$image" 2>/dev/null || true)
if [[ "$have" == "$recipe" ]]; then
  echo "base: $image is current (recipe $recipe)"
  exit 0
fi

tarball="$cache/base-$suite-$recipe.tar"
if [[ ! -s "$tarball" ]]; then
  command -v debootstrap >/dev/null || { echo "base: debootstrap is missing (make install-containers)" >&2; exit 2; }
  mkdir -p "$cache"
  root=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  echo "base: debootstrap $suite (minbase + $packages) into $root"
  debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 \
    || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
  ln -sf /usr/bin/python3 "$root/usr/local/bin/python3"
  ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
  # Keep the image small: package lists and caches are re-fetched by whoever installs more.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*
  tar --numeric-owner -C "$root" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi

echo "base: importing $tarball as $image"
podman import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change "LABEL burstrl.base.recipe=$recipe" \
  --change 'CMD ["/bin/bash"]' \
  "$tarball" "$image" >/dev/null
podman image inspect --format '{{.Id}} {{.Size}}' "$image"
