#!/usr/bin/env bash
# The burst: run the burstrl trainer on a rented GPU box (e.g. a RunPod H200) against the home Redis
# and object store, over TLS, for a fixed time budget.
#
#   BURST_HOURS=10 deploy/burst/start-trainer.sh          # inside the burstrl/trainer image
#
# Written so that a stopped rental loses nothing:
# - nothing on this box is state: the queue is the home Redis, checkpoints and policy versions go to
#   the home store, and the trainer acknowledges a group only once the checkpoint holding its
#   gradient is in the store (docs/architecture.md, invariant 2). A pod killed at any moment costs at most the
#   steps since the last checkpoint; the next trainer, here or at home, resumes from it;
# - so this script refuses a file:// store or a Redis on this box: both would vanish with the pod;
# - the trainer gets a time budget ending before the rental does (BURST_MARGIN_MIN), so it stops on a
#   checkpoint, not mid-step; `exec` hands it SIGTERM directly when the provider stops the pod early.
# - BURST_ROLLOUT=1 also runs a rollout replica on this card beside the trainer (the burst image,
#   `--target burst`, which has vLLM): it joins the home rollout group, so fresh samples come from
#   both sides while the burst lasts. The card is shared through a fixed memory share that
#   `burstrl plan` sizes: the replica's BURST_ROLLOUT_MEMORY_SHARE (its gpu_memory_utilization) and
#   the trainer's BURST_TRAINER_GB (its peak). The replica measures the card and refuses to start
#   (exit 2, the numbers in its log) when its share does not fit beside the trainer; the trainer
#   then trains alone. When the trainer stops (its budget, or SIGTERM) the replica is stopped too:
#   it settles its round in flight and hands what it still holds to the home replicas.
# Required: REDIS_URL (rediss://:password@host:port/0), STORE_URL (s3://bucket/prefix),
# STORE_ENDPOINT_URL (https://...), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, BURSTRL_TOKEN, and
# BURST_HOURS or BURSTRL_TRAINER_TIME_BUDGET_S. Optional: BURST_CA_CERT (PEM text of a private CA),
# BURST_MARGIN_MIN (default 20), NPROC_PER_NODE (default 1), BURSTRL_TRAINER_JOB; BURST_ROLLOUT (0 or
# 1) with BURSTRL_ROLLOUT_MODEL (the jobs' base model), BURST_ROLLOUT_MEMORY_SHARE and BURST_TRAINER_GB.
set -euo pipefail

die() { echo "burst: $*" >&2; exit 2; }
need() { [[ -n "${!1:-}" ]] || die "$1 is required (see deploy/burst/trainer.env.example)"; }

for v in REDIS_URL STORE_URL STORE_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY BURSTRL_TOKEN; do need "$v"; done

# Across sites: TLS only, credentials always.
[[ "$REDIS_URL" == rediss://* ]] || die "REDIS_URL must be rediss:// (TLS) across sites, got ${REDIS_URL%%://*}://"
[[ "$REDIS_URL" =~ ^rediss://[^@]*:[^@]+@ ]] || die "REDIS_URL carries no password (rediss://:PASSWORD@host:port/0)"
[[ "$STORE_ENDPOINT_URL" == https://* ]] || die "STORE_ENDPOINT_URL must be https:// across sites"
[[ "$STORE_URL" == s3://* ]] || die "STORE_URL must be s3://bucket/prefix: a file:// store dies with the pod"
host=$(sed -E 's#^rediss://([^@]*@)?([^:/]+).*#\2#' <<<"$REDIS_URL")
case "$host" in localhost|127.*|::1) die "REDIS_URL points at this box: its data would die with the pod";; esac

# A private CA (self-signed home certificates): trust it for Redis and for boto3.
if [[ -n "${BURST_CA_CERT:-}" ]]; then
  ca="${BURSTRL_DATA_DIR:-/var/lib/burstrl}/burst-ca.crt"
  mkdir -p "$(dirname "$ca")"
  printf '%s\n' "$BURST_CA_CERT" >"$ca"
  export AWS_CA_BUNDLE="$ca"
  # redis-py passes unknown URL query arguments to its SSL connection.
  [[ "$REDIS_URL" == *ssl_ca_certs=* ]] || REDIS_URL+="$([[ "$REDIS_URL" == *\?* ]] && echo '&' || echo '?')ssl_ca_certs=$ca"
  export REDIS_URL
fi

# Time budget: the rental length minus a margin for the last step, its checkpoint and the upload.
margin_s=$(( ${BURST_MARGIN_MIN:-20} * 60 ))
if [[ -z "${BURSTRL_TRAINER_TIME_BUDGET_S:-}" ]]; then
  need BURST_HOURS
  [[ "$BURST_HOURS" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "BURST_HOURS must be a number of hours, got '$BURST_HOURS'"
  BURSTRL_TRAINER_TIME_BUDGET_S=$(awk -v h="$BURST_HOURS" -v m="$margin_s" 'BEGIN { b = int(h * 3600) - m; print (b > 0 ? b : 0) }')
fi
[[ "$BURSTRL_TRAINER_TIME_BUDGET_S" =~ ^[0-9]+$ ]] || die "BURSTRL_TRAINER_TIME_BUDGET_S must be whole seconds"
(( BURSTRL_TRAINER_TIME_BUDGET_S > 600 )) || die "time budget ${BURSTRL_TRAINER_TIME_BUDGET_S}s is too short to train"
export BURSTRL_TRAINER_TIME_BUDGET_S

# A rollout replica beside the trainer: both shares checked here, the fit on the card by the replica.
positive() { awk -v x="$1" 'BEGIN { exit !(x + 0 > 0) }'; }
case "${BURST_ROLLOUT:-0}" in
  0) ;;
  1)
    need BURSTRL_ROLLOUT_MODEL
    need BURST_ROLLOUT_MEMORY_SHARE
    need BURST_TRAINER_GB
    [[ "$BURST_ROLLOUT_MEMORY_SHARE" =~ ^(0?[.][0-9]+|1([.]0*)?)$ ]] && positive "$BURST_ROLLOUT_MEMORY_SHARE" \
      || die "BURST_ROLLOUT_MEMORY_SHARE must be a fraction of the card in (0, 1] (burstrl plan's replica gpu_memory_utilization), got '$BURST_ROLLOUT_MEMORY_SHARE'"
    [[ "$BURST_TRAINER_GB" =~ ^[0-9]+([.][0-9]+)?$ ]] && positive "$BURST_TRAINER_GB" \
      || die "BURST_TRAINER_GB must be a positive number of GB (burstrl plan's trainer peak), got '$BURST_TRAINER_GB'"
    python -c "import vllm" 2>/dev/null \
      || die "BURST_ROLLOUT=1 needs vLLM, which this image lacks: use the burst image (docker build --target burst)"
    ;;
  *) die "BURST_ROLLOUT must be 0 or 1, got '${BURST_ROLLOUT}'" ;;
esac
export BURSTRL_TRAINER_DEVICE="${BURSTRL_TRAINER_DEVICE:-cuda}"
export BURSTRL_HOST="${BURSTRL_HOST:-0.0.0.0}"

# Fail fast, before the GPU hour starts burning on a model download: both ends reachable with these
# credentials, and Redis configured not to lose data.
python - <<'PY'
import os, sys
from shared.redis_conn import RedisPolicyError, check_server, connect, refusal
from shared.store import open_store
r = connect(os.environ["REDIS_URL"])
try:
    r.ping()
    for w in check_server(r):
        print(f"burst: warning: {w}", file=sys.stderr)
except RedisPolicyError as e:
    sys.exit(f"burst: {e}")
except Exception as e:  # a wrong password or an untrusted certificate: say which, and the fix
    sys.exit(f"burst: {refusal(e) or f'cannot reach Redis over TLS: {type(e).__name__}: {e}'}")
try:
    open_store(os.environ["STORE_URL"]).list("jobs/__burst_probe__")
except Exception as e:
    sys.exit(f"burst: cannot reach the store at {os.environ['STORE_ENDPOINT_URL']}: {type(e).__name__}: {e}")
print("burst: Redis and the store are reachable")
PY

echo "burst: training for up to ${BURSTRL_TRAINER_TIME_BUDGET_S}s on ${NPROC_PER_NODE:-1} GPU(s)"
trainer_cmd=(torchrun --standalone --nproc-per-node="${NPROC_PER_NODE:-1}" --max-restarts=3 -m services.trainer)

if [[ "${BURST_ROLLOUT:-0}" == 1 ]]; then
  echo "burst: a rollout replica beside the trainer: ${BURST_ROLLOUT_MEMORY_SHARE} of the card; the trainer keeps ${BURST_TRAINER_GB} GB"
  BURSTRL_REPLICA="${BURST_ROLLOUT_REPLICA:-burst-$(hostname)-rollout}" \
    BURSTRL_PORT="${BURST_ROLLOUT_PORT:-8701}" \
    BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION="$BURST_ROLLOUT_MEMORY_SHARE" \
    BURSTRL_ROLLOUT_TRAINER_RESERVE_GB="$BURST_TRAINER_GB" \
    python -m services.rollout &
  rollout=$!
  "${trainer_cmd[@]}" &
  trainer=$!
  # This script is PID 1 here, so the provider's SIGTERM comes to it: hand it to both. The trainer
  # finishes its step and checkpoints; the replica settles its round and leaves its consumer group.
  trap 'kill -TERM "$trainer" "$rollout" 2>/dev/null' TERM INT
  rc=0
  while kill -0 "$trainer" 2>/dev/null; do # a trap ends `wait` early: wait again until it is gone
    rc=0
    wait "$trainer" || rc=$?
  done
  # The trainer is done (its budget, the job, or SIGTERM): the burst is over for the replica too.
  kill -TERM "$rollout" 2>/dev/null || true
  rollout_rc=0
  wait "$rollout" || rollout_rc=$?
  if ((rollout_rc == 2)); then
    echo "burst: the rollout replica refused to start (its log above says why); the trainer ran alone" >&2
  elif ((rollout_rc != 0)); then
    echo "burst: the rollout replica exited with status $rollout_rc" >&2
  fi
  exit "$rc"
fi
# torchrun: one process per GPU; --standalone needs no rendezvous server on a single node. An error on
# any rank ends the group (the others would hang in a collective); --max-restarts starts it again and it
# resumes from the newest checkpoint in the store.
exec torchrun --standalone --nproc-per-node="${NPROC_PER_NODE:-1}" --max-restarts=3 -m services.trainer
