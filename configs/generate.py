"""Write the example configs in configs/{min,recommended}/ from `burstrl plan` estimates.

Run from the repository root:  .venv/bin/python configs/generate.py

Every number in a generated file comes from the planner command cited in that file (run
here as a subprocess, exactly as cited), so a reader can re-run it and get the same
answer; tests/unit/test_deploy_configs.py re-runs each cited command and fails when a file drifts
from it (then run this script again). Nothing here was measured on the hardware named:
the files say `obtained = "estimated"`. When someone measures a layout, they edit that
file by hand, set `obtained = "measured"` and say how in `meta.measured_how`; this
script then leaves the file alone (it never overwrites a measured config).

File name: [model]_[task]_[gpunums]_[device]_[train]_[infer].toml, where a mixed box
lists its cards with '+' in the same order in gpunums and device (`1+2_h200+mi50`: one
H200 for the trainer, two MI50s for rollout and ref), and [train] says what the trainer
uses (`train_tag`): lora / qlora (4-bit base) / full, then -ddp (several cards, each with the
whole model), -fsdp2 (sharded), -offload (CPU offload), -adam8bit.

Every setting in [tuning.*] and [env.*] is a service setting with the planner's name for it:
the environment lines come from `services.plan.vocabulary`, the one place that spells them.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from the repository root: import the planner's vocabulary
from services.plan import vocabulary  # noqa: E402

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
    method: str = "lora"  # or "full"
    ref: bool = True  # False: no KL term, the ref role is skipped (--no-ref)
    max_staleness: int = 1
    extra_args: tuple[str, ...] = ()
    why: str = ""


def load_layouts(path: Path = OUT / "layouts.toml") -> list[Layout]:
    """The layouts to write, from configs/layouts.toml (data, not code: one [[layout]] per file)."""
    rows = tomllib.loads(path.read_text())["layout"]
    return [
        Layout(**{**row, "cards": tuple(row["cards"]), "extra_args": tuple(row.get("extra_args", ()))}) for row in rows
    ]


LAYOUTS = load_layouts()


def plan_argv(lay: Layout) -> list[str]:
    argv = ["--model", lay.model, "--method", lay.method, "--rank", str(lay.rank)]
    argv += ["--prompt-len", str(lay.prompt_len), "--completion-len", str(lay.completion_len)]
    argv += ["--group-size", str(lay.group_size), "--batch", str(lay.batch), "--cards", *lay.cards]
    if not lay.ref:
        argv.append("--no-ref")
    if any(c.startswith("mi50") for c in lay.cards):  # gfx906 engines serve quantized weights only
        argv += ["--rollout-weights", "awq"]
    # The profiles are about throughput and footprint, not price: rank by step time.
    argv += [*lay.extra_args, "--objective", "time"]
    return [*argv, "--json"]


def card_name(spec: str) -> tuple[str, int]:
    name, _, count = spec.partition(":")
    return name, int(count or 1)


def train_tag(trainer: dict[str, Any], profile: str, method: str) -> str:
    """What the trainer uses, for the file name: lora/qlora/full, then -ddp, -fsdp2, -offload, -adam8bit."""
    settings = trainer["recommended"] if profile == "recommended" else trainer["min_settings"]
    parts = ["full" if method == "full" else "qlora" if settings["base_bits"] == 4 else "lora"]
    if settings["sharding"] == "fsdp":
        parts.append("fsdp2")
    elif trainer["count"] > 1:
        parts.append("ddp")
    if settings["cpu_offload"]:
        parts.append("offload")
    if settings["optimizer"] == "adamw8bit":
        parts.append("adam8bit")
    return "-".join(parts)


def file_name(lay: Layout, plan: dict[str, Any]) -> str:
    cards = [card_name(c) for c in lay.cards]
    if len(cards) == 1:
        gpus, device = str(cards[0][1]), DEVICE[cards[0][0]]
    else:
        gpus = "+".join(str(n) for _, n in cards)
        device = "+".join(DEVICE[c] for c, _ in cards)
    infer = "vllm-gfx906" if any(c.startswith("mi50") for c, _ in cards) else "vllm"
    train = train_tag(role(plan, "trainer") or {}, lay.profile, lay.method)
    return f"{lay.model.lower()}_grpo-{lay.method}_{gpus}_{device}_{train}_{infer}.toml"


def file_device(lay: Layout) -> str:
    return "+".join(DEVICE[card_name(c)[0]] for c in lay.cards)


def role(plan: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in plan["roles"] if r["role"] == name), None)


def profile_settings(r: dict[str, Any], profile: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(service settings, layout facts) of a role for this profile."""
    if profile == "recommended":
        return r["recommended"], r["layout"]
    return r["min_settings"], r["min_layout"]


def tuning(r: dict[str, Any], profile: str) -> dict[str, Any]:
    settings, layout = profile_settings(r, profile)
    peak = r["peak_gb"] if profile == "recommended" else r["min_peak_gb"]
    return {
        "cards": f"{r['count']}x {r['card']}",
        "peak_gb": round(peak, 1),
        "capacity_gb": round(r["capacity_gb"], 1),
        "time_s": round(r["time_s"], 1),
        **settings,
        **layout,
    }


def env_tables(lay: Layout, plan: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Environment for each service, with names the services read (the test checks them), and
    the `vllm serve` flags a remote engine needs (comments: compose's engine command sets them)."""
    base = HUB[lay.model]
    trainer, rollout, ref = role(plan, "trainer"), role(plan, "rollout"), role(plan, "ref")
    env: dict[str, dict[str, Any]] = {}
    serve: list[str] = []
    assert trainer is not None
    env["trainer"] = {"BURSTRL_TRAINER_DEVICE": "cuda"}
    env["trainer"] |= vocabulary.env_vars("trainer", profile_settings(trainer, lay.profile)[0])
    if trainer["card"] in ("h200", "h100"):  # rented: stop with a checkpoint before the rental ends
        env["trainer"]["BURSTRL_TRAINER_TIME_BUDGET_S"] = 9 * 3600 + 30 * 60
    if rollout is not None:
        settings, layout = profile_settings(rollout, lay.profile)
        remote = layout.get("engine") == "remote"
        env["rollout"] = {
            "BURSTRL_ROLLOUT_MODEL": base,
            "BURSTRL_ROLLOUT_MAX_MODEL_LEN": lay.prompt_len + lay.completion_len,
            "BURSTRL_ROLLOUT_MAX_LORA_RANK": lay.rank,
            # One adapter per version in flight, plus the one being adopted.
            "BURSTRL_ROLLOUT_MAX_LORAS": lay.max_staleness + 2,
            # Max per-token |engine - trainer| log-prob gap a version's probe may show: a 4-bit fp16
            # engine needs more room than a bf16 one (a guess to refine: refusals state the gap seen).
            "BURSTRL_ROLLOUT_PROBE_TOLERANCE": 1.0 if remote else 0.25,
        }
        if not remote:
            env["rollout"] |= vocabulary.env_vars("rollout", settings)
        else:  # the gfx906 fork runs in its own container; rollout is its client
            serve = vocabulary.serve_flags(settings)
            engine_limits = {
                k: env["rollout"].pop(f"BURSTRL_ROLLOUT_{k}") for k in ("MAX_MODEL_LEN", "MAX_LORA_RANK", "MAX_LORAS")
            }
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
        settings, layout = profile_settings(ref, lay.profile)
        env["ref"] = {"BURSTRL_REF_MODEL": base, "BURSTRL_REF_DEVICE": "cuda"}
        if layout.get("engine") == "remote":
            env["ref"]["BURSTRL_REF_ENGINE"] = "remote"
            env["ref"]["BURSTRL_REF_ENGINE_URL"] = "http://engine-ref:8000"
            env.setdefault("compose", {})["ENGINE_REF_CHECKPOINT"] = QUANTIZED.get(lay.model, base)
        else:
            env["ref"] |= vocabulary.env_vars("ref", settings)
    return env, serve


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
    full = lay.method == "full"
    job = {
        # A job-name slug ([a-z0-9-], <= 48): model, cards and profile.
        "name": re.sub(r"[^a-z0-9]+", "-", f"{lay.model}-{file_device(lay)}-{lay.profile}".lower())[:48],
        "base_model": HUB[lay.model],
        "task": "arith",
        "group_size": lay.group_size,
        "batch_size": lay.batch,
        "steps": lay.steps,
        "learning_rate": 1e-6 if full else 2e-5,  # all weights move: a much smaller step
        "lora_rank": lay.rank,
        "lora_alpha": 2 * lay.rank,
        "kl_coef": kl,
        "max_staleness": lay.max_staleness,
        "eval_size": 256,
        "seed": 0,
    }
    if full:
        job["algorithm"] = {"finetune": "full"}
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
        "# Regenerate with `.venv/bin/python configs/generate.py`; tests/unit/test_deploy_configs.py re-runs the command.",
        "#",
        "# The top-level keys and [sampling] are a JobSpec (shared/job.py): the job `burstrl submit` posts.",
        "# [meta], [plan], [tuning.*] and [env.*] are not part of the job: who made this file and how, the",
        "# planner's answer, the per-role settings it recommends, and the environment of each service.",
        "# `task` is arith, the one task registered today: swap in yours; the plan is sized for the",
        f"# {lay.prompt_len}-token prompts and {lay.completion_len}-token completions in meta.command.",
        "",
    ]
    lines += [f"{k} = {toml_value(v)}" for k, v in job.items() if not isinstance(v, dict)]
    lines += toml_table("sampling", sampling, "temperature 1: sampler log-probs stay exact")
    if full:
        lines += toml_table("algorithm", job["algorithm"], "update every weight, not a LoRA adapter")
    lines += toml_table("meta", meta)
    lines += toml_table("plan", summary, "the planner's answer for the whole layout")
    for r in plan["roles"]:
        if r["role"] == "ref" and not lay.ref:
            continue
        lines += toml_table(f"tuning.{r['role']}", tuning(r, lay.profile), f"{lay.profile} settings, per card")
    env, serve = env_tables(lay, plan)
    for svc, values in env.items():
        what = "variables for compose/.env" if svc == "compose" else f"environment of `python -m services.{svc}`"
        lines += toml_table(f"env.{svc}", values, what)
        if svc == "rollout" and serve:
            # A remote engine's capacity is set where it starts (compose's engine-rollout command).
            lines.append("# remote engine: start it with  vllm serve " + " ".join(serve))
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
        fname = file_name(lay, plan)
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
