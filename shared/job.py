"""The job spec: what a user submits to `POST /v1/jobs` (or in a job TOML file).

One pydantic model, validated at the api's door; every stage reads the stored copy
from Redis, so what the stages act on is exactly what the api accepted. Defaults are
the tiny-model demo's settings.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Literal, Self

import redis
from pydantic import BaseModel, Field, StringConstraints, field_validator, model_validator
from redis.client import Pipeline

from shared import keys
from shared.agent_spec import AgentSpec
from shared.algorithm import AlgorithmSpec
from shared.env_spec import EnvSpec
from shared.limits import (
    MODEL_REF_MAX,
    SEED_MAX,
    STOP_MAX_CHARS,
    STOP_MAX_ITEMS,
    TIS_CAP_MAX,
    ModelRef,
    Name,
    SpecModel,
)
from shared.model_files import PromptFormat
from shared.task_spec import TaskSpec

log = logging.getLogger(__name__)

JOB_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,47}")  # the whole name (fullmatch: "$" lets a final newline by)
StopString = Annotated[str, StringConstraints(min_length=1, max_length=STOP_MAX_CHARS)]


class JobState(StrEnum):
    pending = "pending"
    running = "running"
    paused = "paused"
    completed = "completed"
    cancelled = "cancelled"
    failed = "failed"


class SamplingSpec(SpecModel):
    """How rollout samples. Temperature 1 keeps sampler log-probs exact (see docs/architecture.md, "Weight sync")."""

    temperature: float = Field(1.0, gt=0.0, le=2.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(8, ge=1, le=8192, description="Completion length cap.")
    stop: list[StopString] = Field(
        default_factory=list,
        max_length=STOP_MAX_ITEMS,
        description="Stop strings, matched literally (not patterns); not included in the completion.",
    )


class BacklogSpec(SpecModel):
    """Let rollout keep generating while no trainer holds the job (docs/architecture.md, invariant 4).

    Off by default (max_groups 0): the job is windowed, at most (max_staleness + 1) x batch_size groups
    in flight, and rollout idles once the trainer stops taking them. With a backlog, rollout keeps
    going: Redis keeps the hot window and ready groups beyond it spill to the object store as
    checksummed segments (jobs/{job}/backlog/), up to max_groups and max_bytes. The trainer then
    accepts groups up to max_age_versions behind it (instead of max_staleness) and max_age_hours old.
    """

    max_groups: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description="Groups the job may hold beyond its in-flight window while the trainer is away "
        "(hot window + disk segments); 0: no backlog (windowed, rollout idles without a trainer).",
    )
    max_bytes: int = Field(
        1 << 30,
        ge=1 << 20,
        le=1 << 44,
        description="Bytes of stored segments at most; rollout idles (and says so in /readyz) at this size.",
    )
    max_age_versions: int = Field(
        256,
        ge=0,
        le=1_000_000,
        description="With a backlog, the staleness limit: a group sampled more than this many policy "
        "versions behind the trainer is dropped (ledger dropped_age). At least max_staleness.",
    )
    max_age_hours: float = Field(
        48.0,
        gt=0.0,
        le=24.0 * 365,
        description="A group sampled longer ago than this is dropped (ledger dropped_age); segments past "
        "it are dropped while no trainer holds the job, so expired data never holds the budget.",
    )
    order: Literal["oldest", "freshest"] = Field(
        "oldest",
        description="Which groups the returning trainer takes first. oldest: the backlog in the order it "
        "was made, so every group is trained before it ages out (nothing the home cards made is wasted "
        "while the drain outpaces the age limit). freshest: the hot window, then the newest segments "
        "first, so the trainer sees the smallest lag (old groups may age out; correct the rest for their lag "
        "with algorithm.mismatch = 'm2po').",
    )
    segment_groups: int = Field(
        64,
        ge=1,
        le=4096,
        description="Groups per disk segment (one object each). Larger: fewer, bigger writes and reads; "
        "smaller: less data held in Redis before it reaches the store.",
    )

    @property
    def enabled(self) -> bool:
        return self.max_groups > 0


class JobSpec(SpecModel):
    """A GRPO training job. Field docs are served in the OpenAPI schema."""

    name: str = Field("job", max_length=48, description="Lowercase name, [a-z0-9-], used in job ids.")
    base_model: ModelRef = Field(
        ...,
        min_length=1,
        description=f"Hub id or local path of the base model (at most {MODEL_REF_MAX} characters); the reference "
        "when training LoRA.",
    )
    task: Name = Field("arith", description="Registered task name (prompt source + verifier).")
    verifier: Name = Field("", description="Verifier override; empty uses the task's own.")
    task_spec: TaskSpec = Field(default_factory=TaskSpec, description="Prompt source, template, weighted verifiers.")
    group_size: int = Field(8, ge=2, le=256, description="Completions per prompt (G).")
    batch_size: int = Field(8, ge=1, le=4096, description="Groups per optimizer step.")
    steps: int = Field(20, ge=1, le=1_000_000, description="Optimizer steps (policy versions).")
    learning_rate: float = Field(2e-3, gt=0.0, le=1.0, description="AdamW learning rate.")
    lora_rank: int = Field(16, ge=1, le=256, description="LoRA rank (vLLM supports 8..256).")
    lora_alpha: int = Field(32, ge=1, le=1024, description="LoRA alpha.")
    kl_coef: float = Field(0.0, ge=0.0, le=10.0, description="KL-to-reference weight; 0 skips ref.")
    teacher: ModelRef = Field(
        "",
        description="Hub id or local path of a teacher (same tokenizer as base_model) that replaces base_model as "
        "the reference: algorithm.advantage='distill' distills from it, kl_coef > 0 regularises toward it.",
    )
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip below 1 (epsilon_low).")
    clip_high: float = Field(0.28, ge=0.0, le=10.0, description="PPO clip above 1 (DAPO).")
    tis_cap: float = Field(2.0, ge=1.0, le=TIS_CAP_MAX, description="Truncated importance-sampling cap.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    max_staleness: int = Field(1, ge=0, le=64, description="Max policy versions a sample may lag.")
    eval_size: int = Field(64, ge=0, le=100_000, description="Held-out prompts per evaluation.")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seeds prompt order and the trainer (0 .. 2**32 - 1).")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    prompt_format: PromptFormat = Field(
        "auto",
        description="How the task's prompts reach the model: 'chat' as one user message through the base model's "
        "chat template, 'raw' as the task's text. 'auto': chat when the base model's tokenizer has a chat template, "
        "except for models trained on raw prompts (the tiny models burstrl builds). Multi-turn (env) jobs are raw.",
    )
    env: EnvSpec = Field(
        default_factory=EnvSpec,
        description="Multi-turn environment (tool use, games) and its episode limits; empty name: single-turn.",
    )
    backlog: BacklogSpec = Field(
        default_factory=BacklogSpec,
        description="Keep generating while no trainer holds the job, into a bounded backlog with a disk tier.",
    )
    agent: AgentSpec = Field(
        default_factory=AgentSpec,
        description="Episodes driven by agents through rollout's OpenAI-compatible endpoint instead of the feeder.",
    )
    tinker: bool = Field(
        False,
        description="A Tinker model (docs/tinker.md): created by the Tinker API, trained by the trainer's Tinker "
        "worker from its call queue, sampled through rollout; the feeder feeds it nothing and the job trainer "
        "never claims it. Not for POST /v1/jobs.",
    )

    @field_validator("name")
    @classmethod
    def _name_is_slug(cls, v: str) -> str:
        if not JOB_NAME_RE.fullmatch(v):
            raise ValueError("name must match [a-z0-9][a-z0-9-]{0,47} (lowercase, digits, '-')")
        return v

    @field_validator("base_model", "teacher")
    @classmethod
    def _model_ref(cls, v: str) -> str:
        # Stages load these from the Hugging Face cache or a local folder, never over the
        # network at run time: a URL could never load. (ModelRef refuses control and format
        # characters: they are in no hub id or sane path.)
        if "://" in v:
            raise ValueError("a hub id (org/name) or a local path, not a URL")
        return v

    @model_validator(mode="after")
    def _alpha_sane(self) -> Self:
        if self.lora_alpha > 16 * self.lora_rank:
            raise ValueError("lora_alpha above 16 x lora_rank makes LoRA updates explode")
        return self

    @model_validator(mode="after")
    def _minibatches_fit(self) -> Self:
        if self.algorithm.minibatches > self.batch_size:
            raise ValueError("algorithm.minibatches must not exceed batch_size (each needs at least one group)")
        return self

    @model_validator(mode="after")
    def _teacher_is_used(self) -> Self:
        if self.teacher and self.algorithm.advantage != "distill" and self.kl_coef == 0.0:
            raise ValueError("teacher is set but unused: set algorithm.advantage = 'distill' or kl_coef > 0")
        if self.algorithm.distill_reward_weight > 0.0 and self.algorithm.advantage != "distill":
            raise ValueError("algorithm.distill_reward_weight needs algorithm.advantage = 'distill'")
        return self

    @model_validator(mode="after")
    def _turn_level_fits(self) -> Self:
        a = self.algorithm
        if a.advantage_level == "turn":
            if not self.env.name:
                raise ValueError(
                    "algorithm.advantage_level = 'turn' needs a multi-turn job: set env.name (e.g. 'calc'); "
                    "single-turn completions have one turn, so use 'episode'"
                )
            if a.advantage not in ("grpo", "dr_grpo", "rloo"):
                raise ValueError(
                    f"algorithm.advantage_level = 'turn' works with advantage grpo, dr_grpo or rloo, not "
                    f"{a.advantage!r} (distill is already per token)"
                )
        return self

    @model_validator(mode="after")
    def _chat_single_turn(self) -> Self:
        if self.prompt_format == "chat" and self.env.name:
            raise ValueError(
                "prompt_format = 'chat' with env.name: an environment's episodes build their token context from raw "
                "text; use prompt_format 'raw' (or 'auto')"
            )
        return self

    @model_validator(mode="after")
    def _agent_alone(self) -> Self:
        if self.agent.enabled and self.env.name:
            raise ValueError(
                "agent.enabled and env.name both set: an agent job's turns come from its agents, not from an "
                "environment; unset one of them"
            )
        if self.agent.enabled and self.backlog.enabled:
            raise ValueError("agent.enabled with backlog.enabled: agents generate on demand, there is nothing to spill")
        return self

    @model_validator(mode="after")
    def _backlog_fits(self) -> Self:
        b = self.backlog
        if not b.enabled:
            return self
        if b.segment_groups > b.max_groups:
            raise ValueError(
                f"backlog.segment_groups ({b.segment_groups}) must not exceed backlog.max_groups ({b.max_groups}): "
                "a backlog holds at least one segment"
            )
        if b.max_age_versions < self.max_staleness:
            raise ValueError(
                f"backlog.max_age_versions ({b.max_age_versions}) must be at least max_staleness "
                f"({self.max_staleness}): groups of the hot window would be dropped as too old"
            )
        return self

    @property
    def uses_ref(self) -> bool:
        """The ref stage runs only when there is a KL term or a teacher to distill from."""
        return self.kl_coef > 0.0 or self.algorithm.advantage == "distill" or bool(self.teacher)

    @property
    def reference_model(self) -> str:
        """What the ref stage scores under: the teacher if set, else the base model (the LoRA's base)."""
        return self.teacher or self.base_model

    @property
    def inflight_window(self) -> int:
        """Groups allowed beyond what the trainer consumed (docs/architecture.md, invariant 4)."""
        return (self.max_staleness + 1) * self.batch_size


class JobRecord(BaseModel):
    """A job as stored in Redis and returned by the api."""

    id: str
    spec: JobSpec
    state: JobState = JobState.pending
    created_at: float
    updated_at: float
    error: str = ""
    # Earlier errors, oldest first (the last ERROR_HISTORY of them): a refusal that replaced
    # another does not hide it. Kept by `update_job`, the one writer of records.
    error_history: list[str] = Field(default_factory=list)


def same_model(a: str, b: str) -> bool:
    """Whether two base-model references name the same model (local paths resolved)."""
    from pathlib import Path

    def norm(x: str) -> str:
        p = Path(x).expanduser()
        return str(p.resolve()) if p.exists() else x

    return a == b or norm(a) == norm(b)


ERROR_HISTORY = 20  # earlier errors a job record keeps
ERROR_CHARS = 2000  # each error is cut to this many characters (a record is read on every GET /v1/jobs)


class UnreadableJob(ValueError):
    """A stored job record that does not parse as a JobRecord (written by another version, or damaged)."""


def load_job(r: redis.Redis, job_id: str) -> JobRecord | None:
    """The api's stored copy of a job (what every stage acts on); None when there is none.

    Raises UnreadableJob when the record is there but cannot be read: callers that serve
    several jobs skip that one and report it, so one bad record never breaks the others.
    """
    raw = r.hget(keys.jobs_index(), job_id)
    return parse_job(job_id, raw) if raw else None


def parse_job(job_id: str, raw: bytes | str) -> JobRecord:
    try:
        return JobRecord.model_validate_json(raw)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise UnreadableJob(f"job {job_id}: stored record is unreadable: {str(e)[:300]}") from None


class JobTaken(RuntimeError):
    """`insert_job`: a job with this id exists already (the caller draws another id)."""


def index_member(job_id: str, created_at: float) -> str:
    """A job's member in the table's indexes (keys.jobs_by_created, keys.jobs_in_state): its
    creation time first, fixed width (µs, 17 digits), so byte order is creation order and two
    jobs created in the same microsecond are ordered by id: a page is one ZRANGE BYLEX from
    the last member seen, with no ties and no offsets."""
    return f"{max(0, round(created_at * 1_000_000)):017d}/{job_id}"


def _member_of(job_id: str, raw: bytes) -> tuple[str, str | None]:
    """(index member, state) of a stored record. An unreadable one sorts by the creation time it
    still holds (0 if none) and is in no state's index."""
    try:
        rec = parse_job(job_id, raw)
        return index_member(job_id, rec.created_at), rec.state.value
    except UnreadableJob:
        try:
            at = float(json.loads(raw).get("created_at") or 0)
        except (ValueError, TypeError, AttributeError):
            at = 0.0
        return index_member(job_id, at), None


def _state_indexes() -> list[str]:
    return [keys.jobs_in_state(s.value) for s in JobState]


def insert_job(
    r: redis.Redis, rec: JobRecord, *, also: Callable[[Pipeline], None] | None = None, active: bool = False
) -> None:
    """Create a job, never over an existing one, in two MULTIs, each on one Redis Cluster slot
    (shared/keys.py): first the job's own keys, its creation mark (keys.created) and `also(pipe)`
    (the job's other keys: pointer, ledger; only keys of this job); then its record, its index
    entries and (`active`) its place in the active set. Raises JobTaken, writing nothing, when
    the id has a record or a creation mark, or another creator takes it meanwhile (the mark is
    WATCHed, and only the creator that set it goes on to the record). Every later change goes
    through `update_job`.

    The job's keys go first, so no stage ever sees a record whose ledger is not there yet. A crash
    between the two leaves a mark and keys with no record: that id stays taken (a retry draws
    another), and `DELETE`/recovery never see it; its few keys are left for an operator."""
    mark = keys.created(rec.id)
    if r.hexists(keys.jobs_index(), rec.id):
        raise JobTaken(rec.id)
    with r.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(mark)
            if pipe.exists(mark):
                raise JobTaken(rec.id)
            pipe.multi()
            pipe.set(mark, repr(rec.created_at))
            if also is not None:
                also(pipe)
            pipe.execute()
        except redis.WatchError:
            raise JobTaken(rec.id) from None
    # The mark is ours: no other creator of this id gets here. The table's own MULTI (its slot).
    member = index_member(rec.id, rec.created_at)
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.jobs_index(), rec.id, rec.model_dump_json())
    pipe.zadd(keys.jobs_by_created(), {member: 0})
    pipe.zadd(keys.jobs_in_state(rec.state.value), {member: 0})
    if active:
        pipe.sadd(keys.active_jobs(), rec.id)
    pipe.execute()


def remove_job(pipe: Pipeline, job_id: str, raw: bytes) -> None:
    """Queue the removal of a job's record (`raw`, read under the caller's WATCH) and its index
    entries, in the caller's MULTI (the api's delete, which removes the job's other keys too)."""
    member, _ = _member_of(job_id, raw)
    pipe.hdel(keys.jobs_index(), job_id)
    pipe.zrem(keys.jobs_by_created(), member)
    for key in _state_indexes():  # every state: an unreadable record's state is not known
        pipe.zrem(key, member)


def ensure_indexes(r: redis.Redis, *, attempts: int = 5) -> bool:
    """Rebuild the table's indexes from the records when they do not cover it (a Redis written
    before they existed, a record written by hand: the counts differ); True if rebuilt.

    One round trip when they agree (HLEN against ZCARD), so the api checks on every listing and
    at start."""
    table, every_job = keys.jobs_index(), keys.jobs_by_created()
    if len(set(r.pipeline(transaction=False).hlen(table).zcard(every_job).execute())) == 1:
        return False
    for _ in range(attempts):
        with r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(table)
                if pipe.hlen(table) == pipe.zcard(every_job):
                    return False
                records = pipe.hgetall(table)
                members: dict[str, int] = {}
                by_state: dict[str, dict[str, int]] = {}
                for raw_id, raw in records.items():
                    job_id = raw_id.decode(errors="replace")
                    member, state = _member_of(job_id, raw)
                    members[member] = 0
                    if state is not None:
                        by_state.setdefault(state, {})[member] = 0
                pipe.multi()
                pipe.delete(every_job, *_state_indexes())
                if members:
                    pipe.zadd(every_job, members)
                for state, those in by_state.items():
                    pipe.zadd(keys.jobs_in_state(state), those)
                pipe.execute()
                log.warning("job table: indexes rebuilt from its %d records", len(records))
                return True
            except redis.WatchError:
                continue
    return False


def page_of_jobs(
    r: redis.Redis, *, state: JobState | None, after: str | None, limit: int
) -> tuple[list[tuple[str, bytes | None]], str | None]:
    """The next `limit` jobs, newest first, after index member `after` (None: from the newest),
    of every state or of `state`: [(job id, its stored record, None if it went meanwhile)], and
    the member to continue after (None: this was the last page). Two round trips."""
    index = keys.jobs_in_state(state.value) if state is not None else keys.jobs_by_created()
    members = r.zrange(index, f"({after}" if after else "+", "-", desc=True, bylex=True, offset=0, num=limit + 1)
    page = [m.decode() for m in members[:limit]]
    ids = [m.partition("/")[2] for m in page]
    raws = r.hmget(keys.jobs_index(), ids) if ids else []
    return list(zip(ids, raws, strict=True)), (page[-1] if len(members) > limit else None)


def update_job(
    r: redis.Redis, job_id: str, change: Callable[[JobRecord], bool | None], *, attempts: int = 50
) -> JobRecord | None:
    """The one way to change a stored job record: read, `change(rec)`, write, under WATCH.

    `change` edits the record in place and returns False to leave it as it is (nothing is
    written). A concurrent write by another service makes the transaction retry with the
    fresh record, so no writer ever overwrites another's change (a cancel by the api and a
    refusal note by rollout, say). Returns the record as stored, or None when there is none.
    """
    key = keys.jobs_index()
    for _ in range(attempts):
        with r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                raw = pipe.hget(key, job_id)
                if raw is None:
                    return None
                rec = parse_job(job_id, raw)
                before, was = rec.error, rec.state
                if change(rec) is False:
                    return rec
                if before and rec.error != before:
                    rec.error_history = [*rec.error_history, before[:ERROR_CHARS]][-ERROR_HISTORY:]
                rec.error = rec.error[:ERROR_CHARS]
                rec.updated_at = time.time()
                pipe.multi()
                pipe.hset(key, job_id, rec.model_dump_json())
                if rec.state != was:  # the state's index follows, in the same MULTI
                    member = index_member(job_id, rec.created_at)
                    pipe.zrem(keys.jobs_in_state(was.value), member)
                    pipe.zadd(keys.jobs_in_state(rec.state.value), {member: 0})
                pipe.execute()
                return rec
            except redis.WatchError:
                continue
    raise RuntimeError(f"job {job_id}: record kept changing under {attempts} attempts to update it")


def set_state(
    r: redis.Redis, job_id: str, state: JobState, *, only_from: set[JobState], error: str | None = None
) -> JobRecord | None:
    """Move a job to `state` if it is in one of `only_from` (else leave it); `error` replaces its error."""

    def change(rec: JobRecord) -> bool:
        if rec.state not in only_from:
            return False
        rec.state = state
        if error is not None:
            rec.error = error
        return True

    return update_job(r, job_id, change)
