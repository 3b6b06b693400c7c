#!/usr/bin/env bash
# Fetch, here (where PyPI is reachable), the wheels bench/gpu_check.sh installs on a GPU machine
# that has torch, transformers and peft but no network: bitsandbytes (8-bit AdamW, NF4) and
# pydantic (the planner's estimate column). Python 3.12, x86-64 Linux; ~45 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=${PYVER:-3.12}
mkdir -p "$dest"
for spec in bitsandbytes==0.50.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$spec"
done
ls -la "$dest"
