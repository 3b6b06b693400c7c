"""Rich displays: follow a job with a progress bar; per-version summary table; services."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# How long a completed job's final version may wait for its evaluation: the api's feeder
# retires a completed job after the same time (services/api/feeder.py), evaluated or not.
FINAL_EVAL_WAIT_S = 600.0


def finished(status: dict[str, Any]) -> str | None:
    """Why following `status` is over, or None while there is more to wait for.

    A completed job is over once its final version is evaluated, or at once when no
    evaluation is due (eval_size = 0: none ever comes)."""
    state = status["job"]["state"]
    if state in ("cancelled", "failed"):
        return state
    if state != "completed":
        return None
    if status["job"]["spec"].get("eval_size", 1) == 0:
        return "completed (no evaluation: eval_size = 0)"
    if any(e["version"] == status["policy_version"] for e in status["evals"]):
        return "completed"
    return None


def follow_job(
    api: str,
    job_id: str,
    headers: dict[str, str],
    console: Console,
    timeout: float = 3600,
    on_poll: Callable[[dict[str, Any]], Any] | None = None,
) -> dict[str, Any]:
    """Poll the job until it is completed and its final version evaluated, when one is due
    (or it fails). The returned status carries `outcome`: why following ended ("timed out"
    when `timeout` passed first).

    `on_poll(status)` runs after each poll (the tracker bridge forwards new points there).
    """
    deadline = time.time() + timeout
    outcome = "timed out"
    completed_at: float | None = None
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        status = httpx.get(f"{api}/v1/jobs/{job_id}", headers=headers, timeout=10).json()
        task = bar.add_task(job_id, total=status["job"]["spec"]["steps"], info="")
        while time.time() < deadline:
            try:
                status = httpx.get(f"{api}/v1/jobs/{job_id}", headers=headers, timeout=10).json()
            except httpx.HTTPError as e:
                bar.update(task, info=f"[yellow]api unreachable: {e}")
                time.sleep(2)
                continue
            last, evals = status.get("last_step") or {}, status["evals"]
            acc = f"held-out acc v{evals[-1]['version']} {evals[-1]['accuracy']:.2f}" if evals else "held-out acc -"
            bar.update(
                task,
                completed=status["policy_version"],
                info=f"reward {last.get('reward_mean', 0):.2f}  {acc}  in-flight {status['ledger'].get('in_flight', 0)}",
            )
            if on_poll:
                _poll_hook(on_poll, status, bar, task)
            done = finished(status)
            if done is not None:
                outcome = done
                break
            if status["job"]["state"] == "completed":
                completed_at = completed_at or time.time()
                if time.time() - completed_at > FINAL_EVAL_WAIT_S:
                    outcome = "completed (its final version was not evaluated: is a rollout replica up?)"
                    break
            time.sleep(1.0)
    status["outcome"] = outcome
    status["trainer_points"] = httpx.get(
        f"{api}/v1/jobs/{job_id}/metrics", params={"source": "trainer"}, headers=headers, timeout=30
    ).json()
    return status


def _poll_hook(on_poll: Callable[[dict[str, Any]], Any], status: dict[str, Any], bar: Progress, task: Any) -> None:
    # A tracker failing (disk full, bad dir) must not stop following the job itself.
    try:
        on_poll(_bridge_status(status))
    except Exception as e:  # noqa: BLE001
        bar.update(task, info=f"[yellow]tracker: {type(e).__name__}: {e}")


def _bridge_status(status: dict[str, Any]) -> dict[str, Any]:
    """The api's job status in the shape the tracker bridge takes."""
    return {
        "state": status["job"]["state"],
        "policy_version": status["policy_version"],
        "evals": status["evals"],
        "spec": status["job"]["spec"],
    }


def print_summary(status: dict[str, Any], console: Console) -> None:
    job = status["job"]
    console.print(f"job [bold]{job['id']}[/]: {job['state']}, policy v{status['policy_version']}")
    evals = {e["version"]: e for e in status["evals"]}
    steps = {p["step"]: p for p in status.get("trainer_points", [])}
    t = Table(title="per policy version")
    for col in ("version", "train reward (batch)", "held-out acc (T=1)", "held-out acc (greedy)"):
        t.add_column(col, justify="right")
    for v in sorted(set(evals) | set(steps)):
        e, s = evals.get(v, {}), steps.get(v, {})
        t.add_row(
            str(v),
            f"{s['reward_mean']:.3f}" if s else "",
            f"{e['accuracy']:.3f}" if e else "",
            f"{e['greedy_accuracy']:.3f}" if e else "",
        )
    console.print(t)
    led = status["ledger"]
    console.print("ledger: " + ", ".join(f"{k}={v}" for k, v in sorted(led.items())))


def print_services(services: list[dict[str, Any]], console: Console) -> None:
    t = Table(title="services")
    for col in ("role", "replica", "ready", "age s", "reasons"):
        t.add_column(col)
    for s in services:
        t.add_row(
            s["role"],
            s["replica"],
            "[green]yes" if s["ready"] else "[red]no",
            str(s["age_s"]),
            "; ".join(f"{k}: {v}" for k, v in s.get("reasons", {}).items()),
        )
    console.print(t)
