"""`make demo`: a real GRPO run of the tiny model through all five services
(`burstrl demo --model smollm2`: of SmolLM2-135M-Instruct, docs/smollm2.md).

Builds (or imports) the model if missing, starts Redis and the services as local processes,
submits the job over HTTP, follows it, prints the per-version table, draws a plot,
and stops everything it started (also on Ctrl-C or error).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from services.cli.follow import follow_job, print_summary
from services.cli.stack import start_stack
from shared.ml.models import ensure_model

DEMO_JOB = {
    "name": "demo",
    "task": "arith",
    "group_size": 16,
    "batch_size": 8,
    "learning_rate": 1e-3,
    "lora_rank": 16,
    "lora_alpha": 32,
    "kl_coef": 0.001,
    "max_staleness": 1,
    "eval_size": 64,
    "sampling": {"temperature": 1.0, "max_tokens": 6},
}

# The tool-use variant (`env="calc"`, examples/demo_calc.toml): 3-digit sums, which the tiny
# model gets mostly wrong in its head; episodes through the calculator environment, where a
# turn `<calc>a+b</calc>` gets `=sum` back. GRPO should teach it to call the tool.
DEMO_CALC_JOB = {
    "name": "demo-calc",
    "task": "arith3",
    "group_size": 8,
    "batch_size": 8,
    "learning_rate": 1e-3,
    "lora_rank": 16,
    "lora_alpha": 32,
    "kl_coef": 0.0,
    "max_staleness": 1,
    "eval_size": 32,
    "sampling": {"temperature": 1.0, "max_tokens": 24},
    "env": {"name": "calc", "max_turns": 3, "max_tokens": 64},
}

# The Python-tool variant (`env="python"`, examples/demo_python.toml): the same sums, but the
# tool is a program, `<python>print(a+b)</python>`, run in the reward service's code sandbox
# (POST /v1/sandbox/run), whose stdout comes back as `<output>s</output>`.
DEMO_PYTHON_JOB = {
    **DEMO_CALC_JOB,
    "name": "demo-python",
    "task": "arith3py",
    # `<python>print(123+456)</python>` is 31 byte tokens (the calc call is 20).
    "sampling": {"temperature": 1.0, "max_tokens": 40},
    "env": {
        "name": "python",
        "max_turns": 3,
        # a call (31) and its output (`<output>1458</output>` and a newline, 22) twice, then the answer
        "max_tokens": 128,
        "max_seconds": 120,
        # One step is a sandbox run on the reward service: ~30 ms plus HTTP, but a group's calls
        # queue for its few tool slots, and a run may take BURSTRL_TOOLS_TIMEOUT_S (3 s) plus the
        # client's 2 s of slack; a step deadline below that would cut off a working tool.
        "step_timeout_s": 15,
    },
}

# The real-model demo (`burstrl demo --model smollm2`, docs/smollm2.md): SmolLM2-135M-Instruct on
# the task its v0 measurement chose before any GRPO run (bench/smollm2_v0.py: greedy 0.188, pass@1
# 0.094), "Calculate 69 + 24." in chat form, scored on the reply's final number.
# Hyperparameters as a user of this model would set them, not tuned on this run:
# - lr 2e-4: the Tinker cookbook's RL recipe (recipes/rl_basic.py) trains Llama-3.1-8B with LoRA
#   at 4e-5, and its `hyperparam_utils.get_lr` scales a Llama-family LoRA lr with the hidden size
#   as (2000 / hidden) ** 0.781; from hidden 4096 to SmolLM2's 576 that is x4.63: 1.85e-4, rounded.
# - LoRA rank 16, alpha 32: the cookbook keeps alpha at 32 for every rank (its lr does not depend
#   on rank that way), and RL needs little rank ("LoRA Without Regret": even rank 1 matches full
#   fine-tuning on RL); 16 is the rollout engine's default max_lora_rank.
# - G = 8 as the cookbook's reasoning-gym example (gem_rl); 8 groups a step (64 sequences, about a
#   minute and a half of a CPU optimizer step here) is what fits 2 cores in ~40 minutes, not its 64-128.
# - kl_coef 0.001, as the tiny demo: small enough not to hold learning back, and it keeps the ref
#   service in the loop (a job without KL skips it).
SMOLLM2_JOB = {
    "name": "demo-smollm2",
    "task": "rg:basic_arithmetic",
    "task_spec": {
        "args": {
            "min_terms": 2,
            "max_terms": 2,
            "max_digits": 2,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "answer_format": "raw",
        },
        "verifiers": [{"name": "math"}],
    },
    "prompt_format": "chat",
    "group_size": 8,
    "batch_size": 8,
    "learning_rate": 2e-4,
    "lora_rank": 16,
    "lora_alpha": 32,
    "kl_coef": 0.001,
    "max_staleness": 1,
    "eval_size": 64,
    "sampling": {"temperature": 1.0, "max_tokens": 96},
}
SMOLLM2_STEPS = 20  # ~41 minutes on 2 cores running nothing else (docs/smollm2.md)

# What each `burstrl demo --env` runs: its job, its model (shipped, copied under home/models) and
# its plot's file name.
DEMOS: dict[str, tuple[dict[str, Any], str, str]] = {
    "": (DEMO_JOB, "tiny-sft", "demo.png"),
    "calc": (DEMO_CALC_JOB, "tiny-calc", "demo-calc.png"),
    "python": (DEMO_PYTHON_JOB, "tiny-python", "demo-python.png"),
}


def check_choice(env: str, model_name: str) -> None:
    """ValueError unless `burstrl demo` has a demo for this --env and --model."""
    if env not in DEMOS:
        raise ValueError(f"--env: no demo for environment {env!r} (try 'calc' or 'python')")
    if model_name not in ("", "smollm2"):
        raise ValueError(f"--model: no demo for model {model_name!r} (try 'smollm2')")
    if model_name and env:
        raise ValueError("--model smollm2 has no tool-use variant: give --model or --env, not both")


def run_demo(
    home: Path,
    *,
    steps: int | None,
    keep_running: bool,
    console: Console,
    env: str = "",
    model_name: str = "",
    ports: dict[str, int] | None = None,
    save: Path | None = None,
) -> int:
    """The GRPO demo; env="calc" or "python" runs a tool-use variant (each its own SFT'd tiny model);
    model_name="smollm2" runs SmolLM2-135M-Instruct instead (imported from its wheel if missing).

    `ports`: each service's (default 8700..8704); `save`: write the job's final status there as
    JSON, with rollout's adoption reports (`rollout_version` points: each probe's mean difference)
    and the wall time (bench/smollm2_demo.py reads it)."""
    check_choice(env, model_name)
    t0 = time.time()
    if model_name == "smollm2":
        from shared.ml.gguf_import import import_gguf, packaged_gguf

        src, pkg = packaged_gguf("smollm2")
        job, png_name, steps = SMOLLM2_JOB, "demo-smollm2.png", steps or SMOLLM2_STEPS
        model = import_gguf(src, home / "models" / pkg.folder, log=console.print)
    else:
        job, tiny, png_name = DEMOS[env]
        model = ensure_model(tiny, home / "models" / tiny, log=console.print)
        steps = steps or 40
    console.print(f"[dim]model ready in {time.time() - t0:.0f}s[/]")
    launcher = None
    try:
        roles = ["api", "reward", "ref", "rollout", "trainer"]
        launcher = start_stack(home, str(model), roles, log=console.print, ports=ports)
        api = f"http://127.0.0.1:{(ports or {}).get('api', 8700)}"
        spec = {**job, "steps": steps, "base_model": str(model)}
        job_id = httpx.post(f"{api}/v1/jobs", json=spec, timeout=30).raise_for_status().json()["id"]
        console.print(f"submitted job [bold]{job_id}[/]")
        status = follow_job(api, job_id, {}, console)
        print_summary(status, console)
        evals = status["evals"]
        png = plot(status, home / png_name)
        console.print(f"plot: {png}")
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            console.print(
                f"[bold]held-out accuracy: v{first['version']} {first['accuracy']:.3f} -> "
                f"v{last['version']} {last['accuracy']:.3f} "
                f"({100 * (last['accuracy'] - first['accuracy']):+.1f} points); greedy "
                f"{first['greedy_accuracy']:.3f} -> {last['greedy_accuracy']:.3f}[/]"
            )
            if "tool_calls_mean" in last:
                console.print(
                    f"tool calls per episode: {first['tool_calls_mean']:.2f} -> {last['tool_calls_mean']:.2f}; "
                    f"turns {first['turns_mean']:.2f} -> {last['turns_mean']:.2f}"
                )
        console.print(f"demo wall time: {time.time() - t0:.0f}s")
        if save is not None:
            status["adoptions"] = httpx.get(
                f"{api}/v1/jobs/{job_id}/metrics", params={"source": "rollout_version"}, timeout=30
            ).json()
            status["wall_s"] = round(time.time() - t0, 1)
            save.write_text(json.dumps(status, indent=1))
        return 0 if status["job"]["state"] == "completed" else 1
    finally:
        if launcher and not keep_running:
            launcher.stop_all()
            console.print("stopped all services")


def plot(status: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals, points = status["evals"], status["trainer_points"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([e["version"] for e in evals], [e["accuracy"] for e in evals], "o-", label="held-out acc (T=1)")
    ax.plot([e["version"] for e in evals], [e["greedy_accuracy"] for e in evals], "s--", label="held-out acc (greedy)")
    ax.plot([p["step"] for p in points], [p["reward_mean"] for p in points], ".", alpha=0.5, label="train batch reward")
    ax.set_xlabel("policy version")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"burstrl demo: {status['job']['id']}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
