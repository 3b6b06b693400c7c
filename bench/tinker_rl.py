"""An RL loop written against the `tinker` SDK trains the tiny model's arith task through burstrl's
Tinker API, against the native burstrl job at the same number of samples (issue 48; docs/tinker.md).

The SDK side is the cookbook's minimal RL loop, as a researcher writes it: each step saves the
weights for a sampler, samples G completions of B training prompts (rollout serves them on that
version), scores them with the task's verifier, computes GRPO advantages, and sends one
forward_backward (importance_sampling; on-policy its ratio is 1, so it is the policy gradient)
and one optim_step. Advantages are divided by the batch's completion tokens, so the summed
Tinker loss has the gradient of the native job's token-mean PPO loss; AdamW as the native
trainer's (torch defaults, grad norm clipped at 1).

The native side is the same task, model, LoRA rank, G, B, steps, learning rate and seed as a
burstrl job (api, rollout, reward, trainer; no KL, no ref). Both final versions are evaluated by
one evaluator (tests/support/lab/heldout.py's `evaluate_versions`: the same held-out prompts and samples).
Target: |SDK accuracy - native accuracy| <= 0.05. A bench, not a test: two trainings and their
evaluations take minutes of both cores, past what `make test` can spend on it.

    .venv/bin/python bench/tinker_rl.py --steps 16 --out bench/results/tinker_rl.md
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TINKER_TELEMETRY", "0")


from shared.domain.tasks import get_task  # noqa: E402
from shared.policy import read_pointer  # noqa: E402
from tests.support.lab.heldout import EVAL_K, EVAL_N, WORKLOADS, evaluate_versions  # noqa: E402
from tests.support.lab.jobs import BATCH, DEMO_SHAPE, G  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, machine, shown_command  # noqa: E402
from tests.support.lab.stack import Stack, run_job  # noqa: E402
from tests.support.tinker import tinker_stack  # noqa: E402

TASK, RANK, LR = "arith", 16, 1e-3


def grpo(rewards: list[float]) -> list[float]:
    """(r - mean) / (std + 1e-6), the native trainer's GRPO advantages (services/trainer/advantages.py)."""
    mean = statistics.fmean(rewards)
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    return [(x - mean) / (std + 1e-6) for x in rewards]


def sdk_loop(tc, tok, steps: int, seed: int) -> dict:  # noqa: ANN001
    """The cookbook-style loop: sample, score, advantages, forward_backward, optim_step."""
    from tinker import types

    task = get_task(TASK)
    items = iter(task.train_items(seed))
    params = types.SamplingParams(max_tokens=WORKLOADS[TASK].max_tokens, temperature=1.0)
    rewards_mean, t0 = [], time.time()
    for _ in range(steps):
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=600)
        batch = list(itertools.islice(items, BATCH))
        prompts = [tok(it.prompt, add_special_tokens=True)["input_ids"] for it in batch]
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples=G, sampling_params=params) for p in prompts
        ]
        groups = []
        for it, p, fut in zip(batch, prompts, futures, strict=True):
            seqs = fut.result(timeout=600).sequences
            rewards = [
                float(task.score(tok.decode(s.tokens, skip_special_tokens=True), it.fields)["correct"]) for s in seqs
            ]
            groups.append((p, seqs, grpo(rewards), rewards))
        n_tokens = sum(len(s.tokens) for _, seqs, _, _ in groups for s in seqs)
        data = []
        for p, seqs, adv, _ in groups:
            for s, a in zip(seqs, adv, strict=True):
                if not s.tokens or a == 0.0:
                    continue
                full = p + list(s.tokens)
                n_prompt = len(p) - 1  # positions predicting prompt tokens: not trained
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={
                            "target_tokens": full[1:],
                            "logprobs": [0.0] * n_prompt + list(s.logprobs),
                            "advantages": [0.0] * n_prompt + [a / n_tokens] * len(s.tokens),
                        },
                    )
                )
        if data:
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(types.AdamParams(learning_rate=LR, beta2=0.999, eps=1e-8, grad_clip_norm=1.0))
            fb.result(timeout=600)
            opt.result(timeout=600)
        rewards_mean.append(statistics.fmean(x for *_, rs in groups for x in rs))
    final = tc.save_weights_for_sampler("final").result(timeout=600)
    return {"train_s": round(time.time() - t0, 1), "reward_mean": rewards_mean, "path": final.path}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--native-staleness",
        type=int,
        default=DEMO_SHAPE["max_staleness"],
        help="the native job's max_staleness (0: it samples each batch on the version it trains, as the SDK loop does)",
    )
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    model = WORKLOADS[TASK].model
    started, load0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()
    res: dict[str, object] = {"steps": a.steps, "samples": a.steps * BATCH * G, "native_staleness": a.native_staleness}

    # The SDK side: api, rollout and the trainer's Tinker worker.
    home = Path(tempfile.mkdtemp(prefix="tinker-rl-"))
    with tinker_stack(home, model, roles=("api", "rollout")) as ts:
        ts.start_worker()
        svc = ts.client()
        tc = svc.create_lora_training_client(base_model=str(model), rank=RANK, seed=a.seed).result(timeout=60)
        sdk = sdk_loop(tc, tc.get_tokenizer(), a.steps, a.seed)
        job = "tinker-" + tc.model_id.replace(":train:", "-")
        version = read_pointer(ts.stack.redis.client(), job)
    sdk["evals"] = evaluate_versions(str(model), TASK, f"file://{home / 'store'}", job, {version: sdk["train_s"]})
    res["sdk"] = sdk

    # The native side: the same job through burstrl's own pipeline.
    spec = {
        **DEMO_SHAPE,
        "name": "native",
        "task": TASK,
        "steps": a.steps,
        "learning_rate": LR,
        "lora_rank": RANK,
        "kl_coef": 0.0,  # no ref: the SDK loop has no KL term either
        "eval_size": 0,  # evaluated afterwards, by the one evaluator
        "seed": a.seed,
        "max_staleness": a.native_staleness,
    }
    with Stack(
        Path(tempfile.mkdtemp(prefix="tinker-rl-native-")), model, roles=["api", "rollout", "reward", "trainer"]
    ) as st:
        out = run_job(st, spec)
        times = {pt["step"]: pt["at"] - out["submitted_at"] for pt in out["points"]}
        native = {"train_s": round(out["trained_at"] - out["submitted_at"], 1), "job_id": out["job_id"]}
        native["reward_mean"] = [pt["reward_mean"] for pt in out["points"]]
        native["evals"] = evaluate_versions(
            str(model), TASK, st.env["STORE_URL"], out["job_id"], {a.steps: times[a.steps]}
        )
    res["native"] = native
    acc_sdk, acc_native = sdk["evals"][-1]["accuracy"], native["evals"][-1]["accuracy"]
    base = native["evals"][0]["accuracy"]
    res.update(acc_sdk=acc_sdk, acc_native=acc_native, diff=acc_sdk - acc_native, machine=machine(), load=load0)
    cmd = shown_command(__file__)
    verdict = "within" if abs(acc_sdk - acc_native) <= 0.05 else "outside"
    text = f"""# An RL loop on the tinker SDK against the native burstrl job (arith, tiny model)

`{cmd}`, started {started}; load average then {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} (the machine is shared).

{machine()}

{a.steps} steps x {BATCH} prompts x {G} samples = {a.steps * BATCH * G} samples on each side; LoRA rank {RANK},
learning rate {LR}, seed {a.seed}. Held-out accuracy: {EVAL_N} held-out prompts x {EVAL_K} samples at T=1, one
evaluator for both (tests/support/lab/heldout.py); the base model scores {base:.3f}.

| side | held-out accuracy after {a.steps} steps | training wall s | reward mean, first / last step |
|---|---|---|---|
| the tinker SDK loop over burstrl's Tinker API | **{acc_sdk:.3f}** | {sdk["train_s"]} | {sdk["reward_mean"][0]:.3f} / {sdk["reward_mean"][-1]:.3f} |
| the native burstrl job | **{acc_native:.3f}** | {native["train_s"]} | {native["reward_mean"][0]:.3f} / {native["reward_mean"][-1]:.3f} |

Difference **{acc_sdk - acc_native:+.3f}**: {verdict} the target's 0.05.

The SDK loop is synchronous (sample on the current version, then train on it: on-policy); the native job
samples ahead of the trainer within max_staleness {a.native_staleness} and corrects for the lag. Wall times are not the
comparison here: the SDK loop waits for rollout to adopt each version before it samples it.
"""
    emit(text, a.out, res, figures=figures(res), command=cmd)


def figures(res: dict) -> list[Figure]:
    """The page's headline figure (bench/run_all.py collects it): the accuracy difference, target 0.05."""
    return [
        figure(
            f"arith held-out accuracy after {res['steps']} steps: an RL loop on the tinker SDK vs the native job "
            f"(max_staleness {res['native_staleness']})",
            f"{res['acc_sdk']:.3f}",
            f"{res['acc_native']:.3f}",
            None,
            "within 0.05",
        )
    ]


if __name__ == "__main__":
    main()
