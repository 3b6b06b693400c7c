"""What a job spec cannot say about itself, checked at submission (issue 18, item 15).

JobSpec checks shapes and ranges; this checks a spec against what is registered here
(tasks, verifiers, environments), what its prompt source holds, and the context of the
rollout replicas that would serve it. Each problem is a `SpecProblem` naming the field
and the valid choices; the router turns it into a 422. Without these checks a bad job
was accepted and the feeder logged a traceback for it every second.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import redis

from services.api.model_checks import prompt_format_problem, prompt_length_problem
from services.api.overview import list_services
from shared import keys
from shared.domain.envs import EnvError, env_names, make_env
from shared.domain.tasks import make_task, task_for_job
from shared.domain.tasks.files import SourceError
from shared.domain.verifiers import VerifierError, check_verifier_args, verifier_names
from shared.job import JobSpec, same_model
from shared.limits import TRUNCATION_WARN_FRAC, TRUNCATION_WINDOW_POINTS
from shared.schema import decode_point


class SpecProblem(ValueError):
    """A spec the api refuses: `loc` is the field's path in the body, `msg` what to fix."""

    def __init__(self, loc: tuple[str | int, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg

    def detail(self) -> list[dict[str, Any]]:
        return [{"type": "value_error", "loc": ["body", *self.loc], "msg": self.msg}]


def check_spec(r: redis.Redis, spec: JobSpec) -> None:
    """Raise SpecProblem for the first thing in `spec` that could never run."""
    _check_verifiers(spec)
    _check_env(spec)
    _check_task(spec)
    _check_context(r, spec)
    _check_model(r, spec)


def _check_verifiers(spec: JobSpec) -> None:
    known = verifier_names()
    if spec.verifier:
        if spec.verifier not in known:
            raise SpecProblem(("verifier",), f"unknown verifier {spec.verifier!r}; known: {known}")
        if spec.task_spec.verifiers:
            raise SpecProblem(("verifier",), "set either `verifier` or `task_spec.verifiers`, not both")
    for i, ref in enumerate(spec.task_spec.verifiers):
        loc: tuple[str | int, ...] = ("task_spec", "verifiers", i)
        if ref.name not in known:
            raise SpecProblem(
                (*loc, "name"),
                f"unknown verifier {ref.name!r}; known: {known} (plugins: the reward service's "
                "BURSTRL_REWARD_PLUGINS, which the api loads too)",
            )
        try:
            check_verifier_args(ref.name, ref.args)
        except VerifierError as e:
            raise SpecProblem((*loc, "args", *([e.arg] if e.arg else [])), str(e)) from None


def _check_env(spec: JobSpec) -> None:
    if not spec.env.name:
        return
    known = env_names()
    if spec.env.name not in known:
        raise SpecProblem(
            ("env", "name"),
            f"unknown environment {spec.env.name!r}; known: {known} (plugins: the rollout service's "
            "BURSTRL_ROLLOUT_ENV_PLUGINS, which the api loads too)",
        )
    try:
        env = make_env(spec.env.name, dict(spec.env.args))  # its constructor checks its args
    except EnvError as e:
        raise SpecProblem(("env", "args"), str(e)) from None
    close = getattr(env, "close", None)
    if callable(close):
        close()


def _check_task(spec: JobSpec) -> None:
    """The task exists, its source reads, and the template renders its first item."""
    if spec.task_spec.source is None:
        try:  # a registered task, or one of a family ("rg:<dataset>") with its task_spec.args
            make_task(spec.task, dict(spec.task_spec.args))
        except KeyError as e:
            raise SpecProblem(("task",), str(e.args[0] if e.args else e)) from None
        except (ValueError, TypeError) as e:
            arg = getattr(e, "arg", "")  # the option at fault, when the task names it
            raise SpecProblem(("task_spec", "args", *([arg] if arg else [])), str(e)) from None
    try:
        task = task_for_job(spec)
        first = list(itertools.islice(task.train_items(spec.seed), 1))
        if spec.eval_size:
            task.heldout_items(1)
    except SourceError as e:
        raise SpecProblem(("task_spec", "source", e.field), str(e)) from None
    except KeyError as e:  # a template placeholder that is not a field of the items
        where = ("task_spec", "template") if spec.task_spec.template else ("task",)
        raise SpecProblem(where, str(e.args[0] if e.args else e)) from None
    except (ValueError, TypeError, OSError, ImportError) as e:
        where = ("task_spec", "source", "path") if spec.task_spec.source is not None else ("task_spec",)
        raise SpecProblem(where, f"{type(e).__name__}: {e}") from None
    if not first:
        where = ("task_spec", "source", "path") if spec.task_spec.source is not None else ("task",)
        raise SpecProblem(where, "the prompt source has no training items")


# -- the rollout's context (issue 18, item 17) ---------------------------------------------
def _rollout_contexts(r: redis.Redis, base_model: str) -> list[int]:
    """max_model_len of each live rollout replica serving `base_model` (0: not advertised)."""
    out = []
    for beat in list_services(r):
        if (
            beat.get("role") == "rollout"
            and beat.get("rollout_model")
            and same_model(beat["rollout_model"], base_model)
        ):
            out.append(int(beat.get("max_model_len") or 0))
    return out


def _check_context(r: redis.Redis, spec: JobSpec) -> None:
    """Refuse a job whose completions no registered replica could hold.

    A completion needs sampling.max_tokens positions after at least one prompt token;
    beyond the engine's context vLLM cuts it short, silently (a job asking for 300 tokens
    of a 256-token context got a mean of 252). Replicas that do not advertise a context
    (older ones) or none at all registered: accepted, with a warning in the job's status.
    """
    contexts = [c for c in _rollout_contexts(r, spec.base_model) if c > 0]
    need = spec.sampling.max_tokens + 1
    if contexts and max(contexts) < need:
        raise SpecProblem(
            ("sampling", "max_tokens"),
            f"sampling.max_tokens={spec.sampling.max_tokens} plus a prompt does not fit the context of any rollout "
            f"replica serving {spec.base_model} (max_model_len {sorted(set(contexts))}); lower it below "
            f"{max(contexts)} minus the prompt's tokens, or start rollout with a larger BURSTRL_ROLLOUT_MAX_MODEL_LEN",
        )


def _check_model(r: redis.Redis, spec: JobSpec) -> None:
    """The job against its base model's files (services/api/model_checks.py): the prompt
    format its tokenizer allows, and prompts that fit the context."""
    problem = prompt_format_problem(spec)
    if problem is None and not spec.agent.enabled:  # an agent job's prompts come from its agents
        contexts = [c for c in _rollout_contexts(r, spec.base_model) if c > 0]
        problem = prompt_length_problem(spec, task_for_job(spec), contexts)
    if problem is not None:
        raise SpecProblem(*problem)


def job_warnings(r: redis.Redis, spec: JobSpec, job_id: str) -> list[str]:
    """What may silently hurt a job, for its status: an unchecked context, cut-off completions."""
    out = []
    contexts = _rollout_contexts(r, spec.base_model)
    known = [c for c in contexts if c > 0]
    need = spec.sampling.max_tokens + 1
    if not contexts:
        out.append(
            f"no rollout replica serving {spec.base_model} is registered: sampling.max_tokens="
            f"{spec.sampling.max_tokens} could not be checked against its context (max_model_len)"
        )
    elif not known:
        out.append(f"the rollout replicas serving {spec.base_model} do not advertise their context (max_model_len)")
    elif max(known) < need:
        out.append(
            f"sampling.max_tokens={spec.sampling.max_tokens} plus a prompt does not fit the context of any rollout "
            f"replica serving {spec.base_model} (max_model_len {sorted(set(known))}): completions are cut short"
        )
    frac = _truncated_frac(r, job_id)
    if frac is not None and frac >= TRUNCATION_WARN_FRAC:
        out.append(
            f"{frac:.0%} of recent completions ended at the length limit (truncated_frac): sampling.max_tokens="
            f"{spec.sampling.max_tokens} or the rollout's context cuts them off"
        )
    return out


def _truncated_frac(r: redis.Redis, job_id: str) -> float | None:
    """Groups-weighted truncated_frac over the job's newest rollout points; None without any."""
    points = []
    # Newest first; other sources' points are interleaved, so look a bounded way back.
    for _, fields in r.xrevrange(keys.metrics(job_id), count=50 * TRUNCATION_WINDOW_POINTS):
        try:
            p = decode_point(fields[b"m"])
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        if p.get("source") == "rollout":
            points.append(p)
            if len(points) == TRUNCATION_WINDOW_POINTS:
                break
    pairs = [
        (float(p["truncated_frac"]), max(1, int(p.get("groups") or 1)))
        for p in points
        if isinstance(p.get("truncated_frac"), int | float)
    ]
    if not pairs:
        return None
    return sum(f * w for f, w in pairs) / sum(w for _, w in pairs)
