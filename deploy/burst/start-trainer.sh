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
# Required: REDIS_URL (rediss://:password@host:port/0), STORE_URL (s3://bucket/prefix),
# STORE_ENDPOINT_URL (https://...), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, BURSTRL_TOKEN, and
# BURST_HOURS or BURSTRL_TRAINER_TIME_BUDGET_S. Optional: BURST_CA_CERT (PEM text of a private CA),
# BURST_MARGIN_MIN (default 20), NPROC_PER_NODE (default 1), BURSTRL_TRAINER_JOB.
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
# torchrun: one process per GPU; --standalone needs no rendezvous server on a single node. An error on
# any rank ends the group (the others would hang in a collective); --max-restarts starts it again and it
# resumes from the newest checkpoint in the store.
exec torchrun --standalone --nproc-per-node="${NPROC_PER_NODE:-1}" --max-restarts=3 -m services.trainer
