"""Every Redis key and stream name in one place.

All keys live under one prefix so a shared Redis can host several deployments
(`BURSTRL_REDIS_PREFIX`). Streams are scoped per job: several jobs share the rollout,
reward and ref pools, each with its own streams, ledger and policy pointer.
"""

from __future__ import annotations

PREFIX = "burstrl"

# Consumer-group names, one per stage. Replicas of a stage share the group.
GROUP_ROLLOUT = "rollout"
GROUP_REWARD = "reward"
GROUP_REF = "ref"
GROUP_TRAINER = "trainer"


def jobs_index() -> str:
    """Hash job_id -> JobRecord JSON (the api's durable job table)."""
    return f"{PREFIX}:jobs"


def active_jobs() -> str:
    """Set of job ids that stages should serve (running or paused-but-draining)."""
    return f"{PREFIX}:jobs:active"


def prompts(job_id: str) -> str:
    """Stream api -> rollout: one entry per prompt (one GRPO group)."""
    return f"{PREFIX}:{job_id}:prompts"


def rollouts(job_id: str) -> str:
    """Stream rollout -> reward: G sampled completions per prompt."""
    return f"{PREFIX}:{job_id}:rollouts"


def scored(job_id: str) -> str:
    """Stream reward -> ref: completions with rewards."""
    return f"{PREFIX}:{job_id}:scored"


def ready(job_id: str) -> str:
    """Stream ref (or reward, when the ref stage is skipped) -> trainer."""
    return f"{PREFIX}:{job_id}:ready"


def dead_letter(job_id: str) -> str:
    """Stream of entries no stage could handle, each with its reason."""
    return f"{PREFIX}:{job_id}:dead"


def policy_pointer(job_id: str) -> str:
    """String: the newest published policy version of a job (an int)."""
    return f"{PREFIX}:{job_id}:policy"


def policy_events(job_id: str) -> str:
    """Stream trainer -> rollout: one PolicyPublished entry per new version."""
    return f"{PREFIX}:{job_id}:policy-events"


def ledger(job_id: str) -> str:
    """Hash of counters: fed, produced, scored, trained, dropped_*, dead."""
    return f"{PREFIX}:{job_id}:ledger"


def metrics(job_id: str) -> str:
    """Stream of MetricPoint entries (the job's durable time series)."""
    return f"{PREFIX}:{job_id}:metrics"


def evals(job_id: str) -> str:
    """Hash policy version -> EvalResult JSON (held-out evaluation per version)."""
    return f"{PREFIX}:{job_id}:evals"


def eval_claim(job_id: str, version: int) -> str:
    """Lock so only one rollout replica evaluates a given version."""
    return f"{PREFIX}:{job_id}:eval-claim:{version}"


def trainer_lease(job_id: str) -> str:
    """Lease held by the one trainer process that trains a job."""
    return f"{PREFIX}:{job_id}:trainer-lease"


def service(role: str, replica: str) -> str:
    """Heartbeat of one service replica (JSON, expires when the replica dies)."""
    return f"{PREFIX}:svc:{role}:{replica}"


def service_pattern() -> str:
    return f"{PREFIX}:svc:*"


def job_streams(job_id: str) -> dict[str, str]:
    """The stage streams of a job with the consumer group that reads each."""
    return {
        prompts(job_id): GROUP_ROLLOUT,
        rollouts(job_id): GROUP_REWARD,
        scored(job_id): GROUP_REF,
        ready(job_id): GROUP_TRAINER,
    }
