"""Write the example configs in configs/{min,recommended}/ from `burstrl plan` estimates.

Run from the repository root:  .venv/bin/python configs/generate.py

Every number in a generated file comes from the planner command cited in that file (run
here as a subprocess, exactly as cited), so a reader can re-run it and get the same
answer; tests/test_deploy.py re-runs each cited command and fails when a file drifts
from it (then run this script again). Nothing here was measured on the hardware named:
the files say `obtained = "estimated"`. When someone measures a layout, they edit that
file by hand, set `obtained = "measured"` and say how in `meta.measured_how`; this
script then leaves the file alone (it never overwrites a measured config).

File name: [model]_[task]_[gpunums]_[device]_[train]_[infer].toml, where a mixed box
lists its cards with '+' in the same order in gpunums and device (`1+2_h200+mi50`: one
H200 for the trainer, two MI50s for rollout and ref).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "configs"
PLAN_CMD = [".venv/bin/python", "-m", "services.plan"]

# Planner card name -> the short device name used in file names.
DEVICE = {"h200": "h200", "h100": "h100", "rtx4070": "rtx4070", "mi50-32": "mi50", "mi50-16": "mi50"}
# Hub ids of the base models (instruct variants: GRPO usually starts from an SFT'd model).
HUB = {
    "Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen3-0.6B": "Qwen/Qwen3-0.6B",
    "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B-Instruct",
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "Qwen2.5-14B": "Qwen/Qwen2.5-14B-Instruct",
}
# The quantized checkpoint a gfx906 engine serves for each base (vLLM's --served-model-name
# aliases it to the base id, so rollout's "same base model" check still matches the job).
QUANTIZED = {
    "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B-Instruct-AWQ",
    "Qwen2.5-3B": "Qwen/Qwen2.5-3B-Instruct-AWQ",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B-Instruct-AWQ",
    "Qwen2.5-14B": "Qwen/Qwen2.5-14B-Instruct-AWQ",
}


@dataclass(frozen=True)
class Layout:
    profile: str  # "min" (every memory saver on) or "recommended" (best throughput)
    model: str  # a built-in planner shape
    cards: tuple[str, ...]  # planner card specs, trainer's card first
    prompt_len: int
    completion_len: int
    group_size: int
    batch: int
    steps: int
    rank: int = 16
    ref: bool = True  # False: no KL term, the ref role is skipped (--no-ref)
    max_staleness: int = 1
    extra_args: tuple[str, ...] = ()
    why: str = ""
    env: dict[str, dict[str, Any]] = field(default_factory=dict)


LAYOUTS = [
    # --- RTX 4070 (12 GB): the dev loop ---------------------------------------------------
    Layout(
        "recommended",
        "Qwen2.5-0.5B",
        ("rtx4070",),
        256,
        256,
        8,
        16,
        200,
        why="Dev loop on one 12 GB card: debug the loss and chase reward hacking in minutes per step.",
    ),
    Layout(
        "min",
        "Qwen3-0.6B",
        ("rtx4070",),
        256,
        512,
        8,
        16,
        200,
        why="Smallest Qwen3 on a 12 GB card with every saver on, leaving room for a browser and a desktop.",
    ),
    Layout(
        "min",
        "Qwen2.5-1.5B",
        ("rtx4070",),
        256,
        512,
        8,
        8,
        200,
        ref=False,
        why="The largest model this dev loop trains alone on a 12 GB card: QLoRA base, no KL term (no ref).",
    ),
    # --- home box: RTX 4070 trains, two MI50s serve (no rental) ------------------------------
    Layout(
        "recommended",
        "Qwen2.5-3B",
        ("rtx4070", "mi50-32:2"),
        256,
        512,
        8,
        16,
        300,
        max_staleness=2,
        why="Home only: the 4070 steps while two MI50s sample; staleness 2 keeps the slow MI50s busy.",
    ),
    Layout(
        "min",
        "Qwen2.5-7B",
        ("rtx4070", "mi50-32:2"),
        256,
        512,
        8,
        8,
        300,
        max_staleness=2,
        why="The largest model the home box trains: 4-bit base on the 4070, AWQ on the MI50s.",
    ),
    # --- rented H200 + home MI50s: the burst ------------------------------------------------
    Layout(
        "recommended",
        "Qwen2.5-1.5B",
        ("h200",),
        512,
        1024,
        8,
        32,
        400,
        why="A 10-hour H200 burst alone (colocated: vLLM sleeps while the trainer steps).",
    ),
    Layout(
        "recommended",
        "Qwen2.5-1.5B",
        ("h200", "mi50-32:2"),
        512,
        1024,
        8,
        32,
        400,
        extra_args=("--placement", "disaggregated"),
        why="The burstrl layout: the H200 only steps; the home MI50s sample and score around the clock.",
    ),
    Layout(
        "recommended",
        "Qwen2.5-7B",
        ("h200",),
        512,
        1024,
        8,
        32,
        300,
        why="7B on one H200, colocated.",
    ),
    Layout(
        "min",
        "Qwen2.5-14B",
        ("h200", "mi50-32:3"),
        512,
        1024,
        8,
        16,
        300,
        max_staleness=2,
        ref=False,
        extra_args=("--placement", "disaggregated"),
        why="14B with the rental only for the optimizer: 4-bit base on the H200, AWQ on three MI50s, no KL term.",
    ),
    # --- H100 ------------------------------------------------------------------------------
    Layout(
        "recommended",
        "Qwen2.5-3B",
        ("h100",),
        512,
        1024,
        8,
        32,
        300,
        why="3B on one H100, colocated.",
    ),
    Layout(
        "recommended",
        "Llama-3.1-8B",
        ("h100:4",),
        512,
        1024,
        8,
        64,
        300,
        why="8B on a 4x H100 node: the planner picks how many cards train and how many sample.",
    ),
    Layout(
        "min",
        "Qwen2.5-7B",
        ("h100",),
        512,
        1024,
        8,
        16,
        300,
        why="7B on one H100 with every saver on: the most KV left for long completions.",
    ),
    Layout(
        "min",
        "Qwen2.5-14B",
        ("h100",),
        512,
        1024,
        8,
        16,
        300,
        ref=False,
        why="14B on one H100: 4-bit base, no KL term.",
    ),
]


def plan_argv(lay: Layout) -> list[str]:
    argv = ["--model", lay.model, "--method", "lora", "--rank", str(lay.rank)]
    argv += ["--prompt-len", str(lay.prompt_len), "--completion-len", str(lay.completion_len)]
    argv += ["--group-size", str(lay.group_size), "--batch", str(lay.batch), "--cards", *lay.cards]
    if not lay.ref:
        argv.append("--no-ref")
    if any(c.startswith("mi50") for c in lay.cards):  # gfx906 engines serve quantized weights only
        argv += ["--rollout-weights", "awq"]
    argv += list(lay.extra_args)
    return [*argv, "--json"]


def card_name(spec: str) -> tuple[str, int]:
    name, _, count = spec.partition(":")
    return name, int(count or 1)


def file_name(lay: Layout) -> str:
    cards = [card_name(c) for c in lay.cards]
    if len(cards) == 1:
        gpus, device = str(cards[0][1]), DEVICE[cards[0][0]]
    else:
        gpus = "+".join(str(n) for _, n in cards)
        device = "+".join(DEVICE[c] for c, _ in cards)
    infer = "vllm-gfx906" if any(c.startswith("mi50") for c, _ in cards) else "vllm"
    return f"{lay.model.lower()}_grpo-lora_{gpus}_{device}_fsdp_{infer}.toml"


def file_device(lay: Layout) -> str:
    return "+".join(DEVICE[card_name(c)[0]] for c in lay.cards)


def role(plan: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in plan["roles"] if r["role"] == name), None)


def tuning(r: dict[str, Any], profile: str) -> dict[str, Any]:
    settings = r["recommended"] if profile == "recommended" else r["min_settings"]
    peak = r["peak_gb"] if profile == "recommended" else r["min_peak_gb"]
    return {
        "cards": f"{r['count']}x {r['card']}",
        "peak_gb": round(peak, 1),
        "capacity_gb": round(r["capacity_gb"], 1),
        "time_s": round(r["time_s"], 1),
        **settings,
    }


def env_tables(lay: Layout, plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Environment for each service, with names the services read (the test checks them)."""
    base = HUB[lay.model]
    trainer, rollout, ref = role(plan, "trainer"), role(plan, "rollout"), role(plan, "ref")
    env: dict[str, dict[str, Any]] = {}
    assert trainer is not None
    env["trainer"] = {"BURSTRL_TRAINER_DEVICE": "cuda"}
    trainer_tuning = trainer["recommended"] if lay.profile == "recommended" else trainer["min_settings"]
    if trainer_tuning.get("grad_checkpointing"):
        env["trainer"]["BURSTRL_TRAINER_GRADIENT_CHECKPOINTING"] = True
    # The planner sized activations for `micro_batch` sequences of prompt + completion tokens
    # per forward/backward; the trainer bounds its passes by padded tokens.
    env["trainer"]["BURSTRL_TRAINER_MICRO_BATCH_TOKENS"] = max(1, int(trainer_tuning.get("micro_batch", 1))) * (
        lay.prompt_len + lay.completion_len
    )
    if trainer["card"] in ("h200", "h100"):  # rented: stop with a checkpoint before the rental ends
        env["trainer"]["BURSTRL_TRAINER_TIME_BUDGET_S"] = 9 * 3600 + 30 * 60
    if rollout is not None:
        gfx906 = rollout["card"].startswith("mi50")
        env["rollout"] = {
            "BURSTRL_ROLLOUT_MODEL": base,
            "BURSTRL_ROLLOUT_MAX_MODEL_LEN": lay.prompt_len + lay.completion_len,
            "BURSTRL_ROLLOUT_MAX_LORA_RANK": lay.rank,
            # One adapter per version in flight, plus the one being adopted.
            "BURSTRL_ROLLOUT_MAX_LORAS": lay.max_staleness + 2,
            "BURSTRL_ROLLOUT_DTYPE": "float16" if gfx906 else "bfloat16",  # gfx906 has no bf16
            # Max per-token |engine - trainer| log-prob gap a version's probe may show: a 4-bit fp16
            # engine needs more room than a bf16 one (a guess to refine: refusals state the gap seen).
            "BURSTRL_ROLLOUT_PROBE_TOLERANCE": 1.0 if gfx906 else 0.25,
        }
        if gfx906:  # the gfx906 fork runs in its own container; rollout is its client
            engine_limits = {
                k: env["rollout"].pop(f"BURSTRL_ROLLOUT_{k}") for k in ("MAX_MODEL_LEN", "MAX_LORA_RANK", "MAX_LORAS")
            }
            del env["rollout"]["BURSTRL_ROLLOUT_DTYPE"]  # the engine's --dtype=float16 decides
            env["rollout"]["BURSTRL_ROLLOUT_ENGINE"] = "remote"
            env["rollout"]["BURSTRL_ROLLOUT_ENGINE_URL"] = "http://engine-rollout:8000"
            env["rollout"]["BURSTRL_ROLLOUT_ENGINE_SERVED_MODEL"] = base
            # compose/.env variables: what the gfx906 engines load ("quantize every served model",
            # served under the base model's id) and the engine's limits (vllm serve arguments).
            env["compose"] = {
                "BURSTRL_MODEL": base,
                "ENGINE_ROLLOUT_CHECKPOINT": QUANTIZED.get(lay.model, base),
                **{f"BURSTRL_{k}": v for k, v in engine_limits.items()},
                "MI50_PROBE_TOLERANCE": env["rollout"]["BURSTRL_ROLLOUT_PROBE_TOLERANCE"],
            }
    if ref is not None and lay.ref:
        gfx906 = ref["card"].startswith("mi50")
        env["ref"] = {"BURSTRL_REF_MODEL": base, "BURSTRL_REF_DEVICE": "cuda"}
        if gfx906:
            env["ref"]["BURSTRL_REF_ENGINE"] = "remote"
            env["ref"]["BURSTRL_REF_ENGINE_URL"] = "http://engine-ref:8000"
            env.setdefault("compose", {})["ENGINE_REF_CHECKPOINT"] = QUANTIZED.get(lay.model, base)
    return env


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def toml_table(name: str, values: dict[str, Any], comment: str = "") -> list[str]:
    lines = ["", f"[{name}]" + (f"  # {comment}" if comment else "")]
    lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    return lines


def render(lay: Layout, plan: dict[str, Any], command: str, fname: str) -> str:
    kl = 0.001 if lay.ref else 0.0
    job = {
        # A job-name slug ([a-z0-9-], <= 48): model, cards and profile.
        "name": re.sub(r"[^a-z0-9]+", "-", f"{lay.model}-{file_device(lay)}-{lay.profile}".lower())[:48],
        "base_model": HUB[lay.model],
        "task": "arith",
        "group_size": lay.group_size,
        "batch_size": lay.batch,
        "steps": lay.steps,
        "learning_rate": 2e-5,
        "lora_rank": lay.rank,
        "lora_alpha": 2 * lay.rank,
        "kl_coef": kl,
        "max_staleness": lay.max_staleness,
        "eval_size": 256,
        "seed": 0,
    }
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": lay.completion_len}
    names = fname.removesuffix(".toml").split("_")
    meta = {
        "profile": lay.profile,
        "model": names[0],
        "task": names[1],
        "gpunums": names[2],
        "device": names[3],
        "train": names[4],
        "infer": names[5],
        "obtained": "estimated",
        "command": command,
        "why": lay.why,
    }
    summary = {"placement": plan["placement"], "fits": plan["fits"], "step_time_s": round(plan["step_time_s"], 1)}
    lines = [
        f"# {fname} [{lay.profile}] - {lay.why}",
        "# Obtained: estimated by `burstrl plan`, not measured on this hardware. The command, run from the",
        "# repository root (the same numbers come back on any machine: the planner is arithmetic):",
        f"#   {command}",
        "# Regenerate with `.venv/bin/python configs/generate.py`; tests/test_deploy.py re-runs the command.",
        "#",
        "# The top-level keys and [sampling] are a JobSpec (shared/job.py): the job `burstrl submit` posts.",
        "# [meta], [plan], [tuning.*] and [env.*] are not part of the job: who made this file and how, the",
        "# planner's answer, the per-role settings it recommends, and the environment of each service.",
        "# `task` is arith, the one task registered today: swap in yours; the plan is sized for the",
        f"# {lay.prompt_len}-token prompts and {lay.completion_len}-token completions in meta.command.",
        "",
    ]
    lines += [f"{k} = {toml_value(v)}" for k, v in job.items()]
    lines += toml_table("sampling", sampling, "temperature 1: sampler log-probs stay exact")
    lines += toml_table("meta", meta)
    lines += toml_table("plan", summary, "the planner's answer for the whole layout")
    for r in plan["roles"]:
        if r["role"] == "ref" and not lay.ref:
            continue
        lines += toml_table(f"tuning.{r['role']}", tuning(r, lay.profile), f"{lay.profile} settings, per card")
    for svc, env in env_tables(lay, plan).items():
        what = "variables for compose/.env" if svc == "compose" else f"environment of `python -m services.{svc}`"
        lines += toml_table(f"env.{svc}", env, what)
    return "\n".join(lines) + "\n"


def main() -> int:
    written = 0
    for lay in LAYOUTS:
        argv = plan_argv(lay)
        proc = subprocess.run(
            [sys.executable, "-m", "services.plan", *argv], cwd=ROOT, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            print(f"{lay.model} on {lay.cards}: planner says it does not fit:\n{proc.stdout}{proc.stderr}")
            return 1
        plan = json.loads(proc.stdout)
        trainer_card = role(plan, "trainer")["card"]  # type: ignore[index]
        if trainer_card != card_name(lay.cards[0])[0]:
            print(f"{lay.model} on {lay.cards}: the planner puts the trainer on {trainer_card}, not the first card")
            return 1
        fname = file_name(lay)
        path = OUT / lay.profile / fname
        if path.exists() and tomllib.loads(path.read_text()).get("meta", {}).get("obtained") == "measured":
            print(f"kept (measured): {path.relative_to(ROOT)}")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(lay, plan, shlex.join(PLAN_CMD + argv), fname))
        written += 1
        print(f"wrote {path.relative_to(ROOT)}  ({plan['placement']}, {plan['step_time_s']:.1f} s/step)")
    print(f"{written} configs written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
