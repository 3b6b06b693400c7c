#!/usr/bin/env bash
# `make images`: every CPU image of docker/Dockerfile, built here with podman on the local Debian base
# (docker/local/build-base.sh), plus the infrastructure stand-ins the container tests run
# (docker/local/Dockerfile.infra). The Dockerfile's production defaults (python slim, CUDA base, the
# PyTorch CPU index) are untouched: only build arguments differ.
#   docker/local/build-images.sh [TARGET...]     # default: every CPU target and the stand-ins
# Layer cache: podman's own (--layers): dependency layers are reused until docker/requirements-*.txt
# or the ARGs change; a code edit rebuilds only the last layers.
# Not built here: trainer, rollout, ref (the CUDA targets: their base image is on a registry and torch's
# CUDA wheel is several GB; no GPU to run them) and the MI50 engine (the gfx906 fork's image, pulled in
# production, never built). tests/unit/test_deploy_*.py validate their files offline.
set -euo pipefail
cd "$(dirname "$0")/../.."

tag="${BURSTRL_IMAGE_TAG:-0.1.0}"
base="${BURSTRL_BASE_IMAGE:-localhost/burstrl-base:bookworm}"
# The host's CA bundle: pip inside the build reaches PyPI only through the host's trust store.
ca="${BURSTRL_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
# A folder holding the CPU torch wheel (torch-2.13.0+cpu-*.whl), when the PyTorch CPU index is out of
# reach; empty: build from that index as in production.
wheels="${BURSTRL_TORCH_WHEELS:-/opt/wheels}"

command -v podman >/dev/null || { echo "images: podman is missing (make install-containers)" >&2; exit 2; }
docker/local/build-base.sh "$base"

args=(--format docker --layers --pull=never --build-arg "PYTHON_IMAGE=$base" -v "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
if compgen -G "$wheels/torch-*+cpu-*.whl" >/dev/null; then
  args+=(-v "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_CPU_INDEX=https://pypi.org/simple)
fi

logs="${BURSTRL_CONTAINER_CACHE:-$HOME/.cache/burstrl/containers}/build-logs"
mkdir -p "$logs"
# podman build with its output in a log per target; on failure, the log's tail.
build() {
  if ! podman build "$@" >"$logs/$t.log" 2>&1; then
    echo "images: building $t failed; the end of $logs/$t.log:" >&2
    tail -30 "$logs/$t.log" >&2
    exit 1
  fi
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(api reward rollout-remote ref-remote laptop redis s3 tls-proxy)
for t in "${targets[@]}"; do
  start=$SECONDS
  case "$t" in redis|s3|tls-proxy) name="localhost/burstrl-local/$t:bookworm" ;; *) name="localhost/burstrl/$t:$tag" ;; esac
  old=$(podman image inspect --format '{{.Id}}' "$name" 2>/dev/null || true)
  case "$t" in
    redis|s3|tls-proxy)
      build -f docker/local/Dockerfile.infra --target "$t" --format docker --layers --pull=never \
        --build-arg "BASE_IMAGE=$base" -v "$ca:/etc/ssl/certs/ca-certificates.crt:ro" \
        -t "$name" docker/local ;;
    *)
      build -f docker/Dockerfile --ignorefile docker/Dockerfile.dockerignore --target "$t" "${args[@]}" \
        -t "$name" . ;;
  esac
  # The image this build replaced, now untagged: ours, so remove it (never a blanket prune, which
  # would also drop the layer cache and other people's images).
  new=$(podman image inspect --format '{{.Id}}' "$name")
  if [[ -n "$old" && "$old" != "$new" && -z "$(podman image inspect --format '{{.RepoTags}}' "$old" 2>/dev/null | tr -d '[]')" ]]; then
    podman rmi "$old" >/dev/null 2>&1 || true
  fi
  printf 'images: %-42s %5ss  %s\n' "$name" "$((SECONDS - start))" \
    "$(podman image inspect --format '{{.Size}}' "$name" | awk '{ printf "%.0f MB", $1 / 1e6 }')"
done
