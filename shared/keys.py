"""Every Redis key and stream name in one place.

All keys live under one prefix so a shared Redis can host several deployments
(`BURSTRL_REDIS_PREFIX`). Streams are scoped per job: several jobs share the rollout,
reward and ref pools, each with its own streams, ledger and policy pointer.

Every key carries a Redis Cluster hash tag (the part in braces picks the slot), so each
script and MULTI touches one slot (docs/architecture.md, "Keys and Redis Cluster"):
- a job's keys, `{PREFIX}:{{job_id}}:{name}`: the job id is the tag, so a job's streams,
  ledger, pointer and lease are on one slot, and any script over them runs there;
- every other key, `{{PREFIX}}:{name}`: the prefix is the tag, so the job table, its
  indexes, the active set, the dataset id and the heartbeats share one slot.
No script or MULTI touches keys of both kinds, nor of two jobs (shared/job.py's
insert_job writes a job's keys, then its record, in two steps).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

_PREFIX_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")  # the whole prefix (fullmatch)


def _prefix() -> str:
    """BURSTRL_REDIS_PREFIX, checked: a ':' in it would make stream names ambiguous to parse."""
    p = os.environ.get("BURSTRL_REDIS_PREFIX", "burstrl")
    if not _PREFIX_RE.fullmatch(p):
        raise ValueError(f"BURSTRL_REDIS_PREFIX={p!r}: use 1-32 characters of [A-Za-z0-9_-]")
    return p


PREFIX = _prefix()


def _global(name: str) -> str:
    """A key that is no job's: the prefix is its hash tag, so all of them share one slot."""
    return f"{{{PREFIX}}}:{name}"


# Consumer-group names, one per stage. Replicas of a stage share the group.
GROUP_ROLLOUT = "rollout"
GROUP_REWARD = "reward"
GROUP_REF = "ref"
GROUP_TRAINER = "trainer"
# Rollout replicas that serve Tinker sample calls (shared/tinker_queue.py) share this group.
GROUP_TINKER_SAMPLER = "tinker-sampler"
# Consumers of the trainer's group on the ready stream that are not the trainer: rollout's
# spillers (services/rollout/spill.py), named SPILL_CONSUMER + the rollout replica id.
SPILL_CONSUMER = "spill-"


def dataset() -> str:
    """String (JSON): the identity of this Redis dataset (shared/dataset.py): {id, created_at, supersedes}."""
    return _global("dataset")


def jobs_index() -> str:
    """Hash job_id -> JobRecord JSON (the api's durable job table)."""
    return _global("jobs")


def active_jobs() -> str:
    """Set of job ids that stages should serve (running or paused-but-draining)."""
    return _global("jobs:active")


def jobs_by_created() -> str:
    """Sorted set (all scores 0, ordered by member): every job in the table, as shared/job.py's
    `index_member` "{created_at in µs}/{job_id}": GET /v1/jobs pages it newest first."""
    return _global("jobs:by-created")


def jobs_in_state(state: str) -> str:
    """Sorted set like jobs_by_created, of the jobs in one state (GET /v1/jobs?state=...)."""
    return _global(f"jobs:state:{state}")


def page_key() -> str:
    """String: the random key that signs the api's page cursors (services/api/pages.py); a new
    Redis dataset gets a new one, so cursors from before a loss are refused as stale."""
    return _global("jobs:page-key")


def _per_job_key(job_id: str, name: str) -> str:
    """`{PREFIX}:{{job_id}}:{name}`: the one shape of every per-job key (job_of_stream and
    job_key_pattern, deleting a job's keys, parse and match it); the braces make the job id
    the key's Redis Cluster hash tag, so all of a job's keys share one slot (job ids are
    [a-z0-9-], shared/job.py: no brace ends the tag early)."""
    return f"{PREFIX}:{{{job_id}}}:{name}"


def _per_job(name: str, doc: str) -> Callable[[str], str]:
    """The key function of the per-job key `name` (`_per_job_key`'s shape), documented by `doc`."""

    def key(job_id: str) -> str:
        return _per_job_key(job_id, name)

    key.__doc__ = doc
    return key


# The per-job keys (the stage streams, then the job's state), by the name code calls them.
prompts = _per_job("prompts", "Stream api -> rollout: one entry per prompt (one GRPO group).")
rollouts = _per_job("rollouts", "Stream rollout -> reward: G sampled completions per prompt.")
scored = _per_job("scored", "Stream reward -> ref: completions with rewards.")
ready = _per_job("ready", "Stream ref (or reward, when the ref stage is skipped) -> trainer.")
dead_letter = _per_job("dead", "Stream of entries no stage could handle, each with its reason.")
policy_pointer = _per_job("policy", "String: the newest published policy version of a job (an int).")
ledger = _per_job("ledger", "Hash of counters: fed, produced, scored, trained, dropped_*, dead, spilled, backlog_done.")
agent_groups = _per_job(
    "agent_groups",
    'Hash group id -> outcome ("bus" or "dropped_<reason>") of every agent group that left rollout '
    "(docs/agents.md): written in the same script that hands it on or counts it dropped, only if absent, "
    "so each agent group enters the ledger once.",
)
created = _per_job(
    "created",
    "String: when the job was created; set once, in the MULTI that writes its record: every creator WATCHes "
    "it, so two creating one id cannot both succeed (shared/job.py, insert_job).",
)
metrics = _per_job("metrics", "Stream of MetricPoint entries (the job's durable time series).")
sessions = _per_job(
    "sessions",
    "Stream of the trainer's session points (start and end of each lease it held), each with `metrics_id`, "
    "the id of the same point in `metrics`: the burst timeline's index, so it reads O(sessions), not the "
    "whole series (shared/metrics.py, record_session_point).",
)
evals = _per_job("evals", "Hash policy version -> EvalResult JSON (held-out evaluation per version).")
trainer_lease = _per_job(
    "trainer-lease", 'Lease held by the one trainer process that trains a job: "{token} {epoch}" (shared/lease.py).'
)
trainer_epoch = _per_job(
    "trainer-epoch", "Counter: the fencing epoch of the newest lease taken on a job (only ever grows)."
)
trainer_failures = _per_job(
    "trainer-failures",
    "Hash attempts/error/at: consecutive failed attempts to load or train a job (services/trainer/progress.py).",
)
segment_seq = _per_job(
    "segment-seq", "Counter: the last backlog segment number drawn for a job (shared/segments.py, new_segment_id)."
)
backlog_index = _per_job(
    "backlog",
    "Hash segment id -> JSON {groups, remaining, bytes, v_min, v_max, t_min, t_max, status, created_at}: "
    "the backlog's disk segments a trainer may take groups from (shared/backlog.py).",
)

# A Tinker model (docs/tinker.md) is a job whose training calls come over the Tinker API.
tinker_calls = _per_job(
    "tinker-calls",
    "Stream api -> trainer's Tinker worker: one entry per training call (`seq`, `call`: a TinkerCall), "
    "kept until a checkpoint holds its effect (shared/tinker_queue.py).",
)
tinker_seqs = _per_job(
    "tinker-seqs",
    "Hash seq_id -> digest of the call received under it: a repeat with the same digest is the same request.",
)
tinker_state = _per_job(
    "tinker-state",
    "Hash: next (the lowest seq_id not received yet), applied (the highest one a trainer applied), "
    "checkpointed (the highest one a checkpoint holds), versions (policy versions published so far).",
)
tinker_results = _per_job(
    "tinker-results", "Hash seq_id -> TinkerResult of the call, written by the lease holder (fenced)."
)
tinker_samples = _per_job(
    "tinker-samples", "Stream api -> rollout: one entry per Tinker sample call (a SampleCall), read by a group."
)


def tinker_sample_result(job_id: str, request: str) -> str:
    """String: the SampleResult of a Tinker sample call, written by rollout, expiring (SAMPLE_RESULT_TTL_S)."""
    return _per_job_key(job_id, f"tinker-sample-result:{request}")


def tinker_done(job_id: str, request: str) -> str:
    """List: a token pushed when a Tinker request's result is written, for the api's long poll."""
    return _per_job_key(job_id, f"tinker-done:{request}")


def tinker_sessions() -> str:
    """Hash session id -> JSON {created_at, heartbeat_at, sdk_version}: the Tinker API's sessions."""
    return _global("tinker:sessions")


def eval_claim(job_id: str, version: int) -> str:
    """Lock so only one rollout replica evaluates a given version."""
    return _per_job_key(job_id, f"eval-claim:{version}")


def backlog_done(job_id: str, segment: str) -> str:
    """Bitmap: bit i set once group i of an indexed segment left the backlog (trained, dropped, dead)."""
    return _per_job_key(job_id, f"backlog-done:{segment}")


def service(role: str, replica: str) -> str:
    """Heartbeat of one service replica (JSON, expires when the replica dies)."""
    return _global(f"svc:{role}:{replica}")


def service_pattern() -> str:
    return _global("svc:*")


def job_key_pattern(job_id: str) -> str:
    """SCAN pattern matching every per-job key of `job_id` (they all have job_of_stream's shape).

    Glob characters in the id are escaped, so the pattern never reaches another job's keys."""
    escaped = "".join(f"\\{c}" if c in "*?[]\\" else c for c in job_id)
    return f"{PREFIX}:{{{escaped}}}:*"


def job_of_stream(stream: str) -> str:
    """The job a per-job key belongs to: `{PREFIX}:{{job}}:{what}` (job ids hold no ':')."""
    head, _, rest = stream.partition(":")
    tag, sep, _ = rest.partition(":")
    job = tag[1:-1]
    if head != PREFIX or not sep or len(tag) < 3 or tag[0] != "{" or tag[-1] != "}" or "{" in job or "}" in job:
        raise ValueError(f"{stream!r} is not a per-job key under prefix {PREFIX!r}")
    return job


def stage_of_stream(stream: str) -> str:
    """The stage stream's own name (prompts, rollouts, scored, ready, ...) of a per-job key."""
    job_of_stream(stream)  # validates the shape
    return stream.rsplit(":", 1)[1]


def job_streams(job_id: str) -> dict[str, str]:
    """The stage streams of a job with the consumer group that reads each."""
    return {
        prompts(job_id): GROUP_ROLLOUT,
        rollouts(job_id): GROUP_REWARD,
        scored(job_id): GROUP_REF,
        ready(job_id): GROUP_TRAINER,
    }
