"""TRL's GRPOTrainer on a workload of the comparisons, held to burstrl's settings: the same tiny
model, task, group size and batch (tests/support/lab/jobs.py), learning rate, LoRA (r 16, alpha
32, all linear layers), KL weight, clip (0.2 / 0.28, token-mean loss), temperature 1 and max new
tokens. Evaluated after each step by the one held-out evaluator (heldout.py) with its training
clock stopped.

`trl_subprocess` runs it in a fresh process (a failed vLLM start must not poison the next try):

    .venv/bin/python -m tests.support.lab.trl --task arith --steps 20 --lr 1e-3 --mode hf --result out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support import ROOT
from tests.support.lab.heldout import WORKLOADS, heldout_accuracy
from tests.support.lab.jobs import BATCH, KL, G


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
    cmd = [sys.executable, "-m", "tests.support.lab.trl", "--mode", mode, "--steps", str(steps)]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="The SFT'd model folder.")
    ap.add_argument("--task", choices=sorted(WORKLOADS), required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--mode", choices=["colocate", "hf"], required=True, help="vLLM colocated, or HF generate.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kl", type=float, default=KL, help="TRL's KL weight, beta.")
    ap.add_argument("--result", type=Path, required=True, help="Where the run's JSON goes.")
    a = ap.parse_args(argv)
    res = run_trl(a.model, a.task, a.steps, a.lr, a.mode, a.seed, a.result.parent, a.kl)
    a.result.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
