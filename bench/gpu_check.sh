#!/usr/bin/env bash
# The memory savers on one CUDA card against the planner (bench/gpu_check.py): under 8 minutes,
# no network, no vLLM or Redis. Needs torch (CUDA), transformers and peft; bitsandbytes and
# pydantic come from wheels in ${WHEELS:-.whl} when missing (bench/gpu_wheels.sh fetches them).
# Writes the rows to $OUT (or bench/out) and to bench/results/plan_calibration.md's GPU section.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
wheels=${WHEELS:-.whl}
site=$(mktemp -d /tmp/burstrl-gpu-site.XXXX)
py=${PYTHON:-python3}
for mod in bitsandbytes pydantic; do
  if ! "$py" -c "import $mod" 2>/dev/null; then
    pat=$mod; [ "$mod" = pydantic ] && pat="pydantic pydantic_core annotated_types typing_inspection"
    for p in $pat; do
      ls "$wheels"/${p}-*.whl >/dev/null 2>&1 || { echo "gpu_check: no $p wheel in $wheels (rows needing it are skipped)"; continue; }
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/${p}-*.whl
    done
  fi
done
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$py" -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)"
timeout 470 "$py" bench/gpu_check.py --out "$out/gpu_calibration.md" --doc bench/results/plan_calibration.md "$@"
rc=$?
cp bench/results/plan_calibration.md "$out/plan_calibration.md" 2>/dev/null || true
exit $rc
