"""configs/: each example is a valid JobSpec plus valid service settings, and its numbers are what
the `burstrl plan` command it cites prints.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest

from services.ref.__main__ import RefSettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from shared.domain.tasks import task_names
from shared.job import JobSpec
from tests.support import ROOT
from tests.support.deploy import COMPOSE, check_env_names, dotenv

CONFIGS = sorted((ROOT / "configs").glob("*/*.toml"))
NAME_RE = re.compile(
    r"^(?P<model>[a-z0-9.-]+)_(?P<task>grpo-[a-z]+)_(?P<gpunums>\d+(?:\+\d+)*)_(?P<device>[a-z0-9]+(?:\+[a-z0-9]+)*)"
    r"_(?P<train>[a-z0-9-]+)_(?P<infer>[a-z0-9-]+)\.toml$"
)
NOT_JOB = {"meta", "plan", "tuning", "env"}  # the non-JobSpec tables of a config


def job_part(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in NOT_JOB}


def run_plan(command: str) -> tuple[int, dict[str, Any]]:
    from services.plan.cli import main as plan_main

    argv = shlex.split(command)
    assert argv[:3] == [".venv/bin/python", "-m", "services.plan"] and argv[-1] == "--json", command
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = plan_main(argv[3:])
    return code, json.loads(buf.getvalue())


def test_configs_cover_models_devices_and_both_tags() -> None:
    assert len(CONFIGS) >= 8
    metas = [tomllib.loads(p.read_text())["meta"] for p in CONFIGS]
    devices = {d for m in metas for d in m["device"].split("+")}
    assert {"mi50", "rtx4070", "h100", "h200"} <= devices
    assert {m["profile"] for m in metas} == {"min", "recommended"}
    assert len({m["model"] for m in metas}) >= 5


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_is_a_valid_job_and_valid_settings(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = NAME_RE.match(path.name)
    assert m, f"{path.name} does not follow [model]_[task]_[gpunums]_[device]_[train]_[infer].toml"
    cfg = tomllib.loads(path.read_text())
    meta = cfg["meta"]
    assert meta["profile"] == path.parent.name in ("min", "recommended")
    assert {k: meta[k] for k in m.groupdict()} == m.groupdict(), "meta disagrees with the file name"
    assert len(meta["gpunums"].split("+")) == len(meta["device"].split("+"))
    assert meta["obtained"] in ("estimated", "measured")
    if meta["obtained"] == "measured":
        assert meta.get("measured_how"), "a measured config says how it was measured"

    # The job: exactly what `burstrl submit` would post, once the non-job tables are dropped.
    job = JobSpec.model_validate(job_part(cfg))
    assert job.task in task_names()
    uses_ref = "--no-ref" not in shlex.split(meta["command"])
    assert job.uses_ref == uses_ref, "kl_coef > 0 exactly when the plan includes the ref role"

    # The services' settings, built the way they are at start-up: from the environment.
    for var in list(__import__("os").environ):
        if var.startswith("BURSTRL_") or var in ("REDIS_URL", "STORE_URL"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("BURSTRL_TOKEN", "0123456789abcdef0123456789abcdef")
    classes = {"trainer": TrainerSettings, "rollout": RolloutSettings, "ref": RefSettings}
    env_tables = cfg.get("env", {})
    assert "trainer" in env_tables and "rollout" in env_tables
    assert ("ref" in env_tables) == uses_ref
    built = {}
    for svc, env in env_tables.items():
        if svc == "compose":
            assert set(env) <= set(dotenv(COMPOSE / ".env.example")), f"{svc}: not a compose/.env variable"
            continue
        check_env_names(list(env), f"{path.name} [env.{svc}]")
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, str(v))
            built[svc] = classes[svc]()
    rollout: RolloutSettings = built["rollout"]
    argv = shlex.split(meta["command"])
    prompt_len = int(argv[argv.index("--prompt-len") + 1])
    assert rollout.model == job.base_model, "rollout must serve the job's base model"
    if rollout.engine == "remote":  # the engine's limits are `vllm serve` arguments, set from compose/.env
        compose_env = env_tables["compose"]
        assert compose_env["BURSTRL_MODEL"] == job.base_model == rollout.engine_served_model
        limits = (compose_env[f"BURSTRL_{k}"] for k in ("MAX_MODEL_LEN", "MAX_LORA_RANK", "MAX_LORAS"))
    else:
        limits = (rollout.max_model_len, rollout.max_lora_rank, rollout.max_loras)
    max_model_len, max_lora_rank, max_loras = limits
    assert max_model_len >= prompt_len + job.sampling.max_tokens
    assert max_lora_rank >= job.lora_rank
    assert max_loras >= job.max_staleness + 2
    if "ref" in built:
        assert built["ref"].model == job.base_model
    if "mi50" in meta["device"]:
        assert meta["infer"] == "vllm-gfx906" and rollout.engine == "remote"
    # One vocabulary: every tuned setting that names a field of the role's settings reaches that
    # service with the same value (the rest are layout facts: weights served, replicas...).
    for svc, settings in built.items():
        tuned = cfg["tuning"][svc]
        if tuned.get("engine") == "remote":
            continue  # a remote engine's sizes are `vllm serve` flags (the comment under [env.rollout])
        for k in (k for k in tuned if k in classes[svc].model_fields):
            assert getattr(settings, k) == tuned[k], f"{path.name}: [tuning.{svc}] {k} does not reach [env.{svc}]"
    # The file name says what the trainer uses.
    t = cfg["tuning"]["trainer"]
    parts = meta["train"].split("-")
    assert parts[0] == ("full" if job.algorithm.finetune == "full" else "qlora" if t["base_bits"] == 4 else "lora")
    assert ("fsdp2" in parts) == (t["sharding"] == "fsdp") and ("offload" in parts) == t["cpu_offload"]
    assert ("ddp" in parts) == (t["sharding"] == "ddp" and t["processes"] > 1)
    assert ("adam8bit" in parts) == (t["optimizer"] == "adamw8bit")
    assert meta["task"] == f"grpo-{job.algorithm.finetune}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_numbers_come_from_the_cited_plan_command(path: Path) -> None:
    cfg = tomllib.loads(path.read_text())
    if cfg["meta"]["obtained"] != "estimated":
        pytest.skip("measured, not estimated")
    code, plan = run_plan(cfg["meta"]["command"])
    hint = f"{path.name} drifted from its plan command: run `.venv/bin/python configs/generate.py`"
    assert code == 0 and plan["fits"], f"{path.name}: the planner says this does not fit"
    assert plan["placement"] == cfg["plan"]["placement"], hint
    assert cfg["plan"]["step_time_s"] == pytest.approx(plan["step_time_s"], rel=0.1), hint
    argv = shlex.split(cfg["meta"]["command"])
    job = job_part(cfg)
    assert int(argv[argv.index("--group-size") + 1]) == job["group_size"]
    assert int(argv[argv.index("--batch") + 1]) == job["batch_size"]
    assert int(argv[argv.index("--completion-len") + 1]) == job["sampling"]["max_tokens"]
    assert int(argv[argv.index("--rank") + 1]) == job["lora_rank"]
    profile = cfg["meta"]["profile"]
    for role in plan["roles"]:
        tuned = cfg["tuning"][role["role"]]
        settings = role["recommended"] if profile == "recommended" else role["min_settings"]
        settings = settings | (role["layout"] if profile == "recommended" else role["min_layout"])
        peak = role["peak_gb"] if profile == "recommended" else role["min_peak_gb"]
        assert tuned["cards"] == f"{role['count']}x {role['card']}", hint
        assert tuned["peak_gb"] == pytest.approx(peak, rel=0.1, abs=0.2), hint
        for k, v in settings.items():
            assert tuned[k] == (pytest.approx(v, rel=0.1) if isinstance(v, float) else v), f"{hint} ({k})"
    if profile == "min":  # every memory saver on
        assert cfg["tuning"]["trainer"]["gradient_checkpointing"] is True
