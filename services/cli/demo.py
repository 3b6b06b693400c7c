"""`make demo`: a real GRPO run of the tiny model through all five services.

Builds the model if missing, starts Redis and the services as local processes,
submits the job over HTTP, follows it, prints the per-version table, draws a plot,
and stops everything it started (also on Ctrl-C or error).
"""

from __future__ import annotations

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

# What each `burstrl demo --env` runs: its job, its model (shipped, copied under home/models) and
# its plot's file name.
DEMOS: dict[str, tuple[dict[str, Any], str, str]] = {
    "": (DEMO_JOB, "tiny-sft", "demo.png"),
    "calc": (DEMO_CALC_JOB, "tiny-calc", "demo-calc.png"),
    "python": (DEMO_PYTHON_JOB, "tiny-python", "demo-python.png"),
}


def run_demo(home: Path, *, steps: int, keep_running: bool, console: Console, env: str = "") -> int:
    """The GRPO demo; env="calc" or "python" runs a tool-use variant (each its own SFT'd tiny model)."""
    if env not in DEMOS:
        raise ValueError(f"no demo for environment {env!r} (try 'calc' or 'python')")
    job, model_name, png_name = DEMOS[env]
    t0 = time.time()
    model = ensure_model(model_name, home / "models" / model_name, log=console.print)
    console.print(f"[dim]model ready in {time.time() - t0:.0f}s[/]")
    launcher = None
    try:
        launcher = start_stack(home, str(model), ["api", "reward", "ref", "rollout", "trainer"], log=console.print)
        api = "http://127.0.0.1:8700"
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
