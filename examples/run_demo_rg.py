"""Run examples/demo_rg.toml on a private local stack (free ports) and plot its curve.

    PYTHONPATH=. .venv/bin/python examples/run_demo_rg.py --steps 30 --out bench/results/demo_rg.png

What `burstrl init-model --rg` + `burstrl up` + `burstrl submit examples/demo_rg.toml --follow`
do, but on free ports (so it runs beside another stack) and with the demo's plot at the end.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import httpx
from rich.console import Console

from services.cli.demo import plot
from services.cli.follow import follow_job, print_summary
from services.cli.launch import Launcher, free_port
from services.cli.stack import stack_env
from shared.ml.models import RG_MODEL_NAME, ensure_rg_model

ROLES = ["api", "reward", "ref", "rollout", "trainer"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=Path("examples/demo_rg.toml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--home", type=Path, default=Path(".burstrl/demo-rg"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/demo_rg.png"))
    a = ap.parse_args()
    console = Console()
    spec = tomllib.loads(a.job.read_text())
    spec["steps"] = a.steps
    spec["base_model"] = str(Path(spec["base_model"]).resolve())
    if Path(spec["base_model"]).name == RG_MODEL_NAME:  # the demo's own model: copied from the shipped one
        ensure_rg_model(Path(spec["base_model"]), log=console.print)
    a.home.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(a.home / "run")
    try:
        redis_url = launcher.start_redis()
        ports = {role: free_port() for role in ROLES}
        env = stack_env(a.home, spec["base_model"], redis_url)
        env["BURSTRL_TOOLS_SANDBOX_URL"] = f"http://127.0.0.1:{ports['reward']}"
        for role in ROLES:
            launcher.start_service(role, env, port=ports[role])
        launcher.wait_ready(ROLES, timeout=900)
        api = f"http://127.0.0.1:{ports['api']}"
        resp = httpx.post(f"{api}/v1/jobs", json=spec, timeout=300)
        if resp.status_code == 422:
            raise SystemExit(json.dumps(resp.json()["detail"], indent=1))
        job_id = resp.raise_for_status().json()["id"]
        console.print(f"submitted {job_id}")
        status = follow_job(api, job_id, {}, console, timeout=7200)
        print_summary(status, console)
        (a.home / "status.json").write_text(json.dumps(status))
        console.print(f"plot: {plot(status, a.out)}")
        evals = status["evals"]
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            console.print(
                f"held-out pass@1: v{first['version']} {first['accuracy']:.3f} -> v{last['version']} "
                f"{last['accuracy']:.3f}; greedy {first['greedy_accuracy']:.3f} -> {last['greedy_accuracy']:.3f}"
            )
    finally:
        launcher.stop_all()


if __name__ == "__main__":
    main()
