"""bench/chaos.py's page and headline figures, pure functions of its results."""

from __future__ import annotations

from typing import Any

from tests.support.lab.results import Figure, figure


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: faults survived, and checks passed afterwards."""
    faults = [f for f in res["faults"] if not f.get("skipped")]
    checks = res["checks"]
    return [
        figure(
            "chaos: faults survived / injected", f"{sum(f['survived'] for f in faults)} / {len(faults)}", target="all"
        ),
        figure("chaos: checks passed afterwards", f"{sum(checks.values())} / {len(checks)}", target="all"),
    ]


def report(res: dict[str, Any], cmd: str) -> str:
    faults = [f for f in res["faults"] if not f.get("skipped")]
    lines = [
        "# Chaos",
        "",
        f"`{cmd}`",
        "",
        f"A {res['steps']}-step GRPO-LoRA job on the tiny model (G 16, batch 32, max_staleness 1) through the five "
        "real services, S3 store (moto) behind a switchable proxy, redis-server with AOF everysec.",
        "",
        f"**Faults injected: {len(faults)}; survived: {sum(f['survived'] for f in faults)}. "
        f"All checks passed: {res['ok']}.**",
        "",
        "| # | fault | at version | all services ready after s | next policy version after s |",
        "|---|---|---|---|---|",
    ]
    for i, f in enumerate(res["faults"], 1):
        if f.get("skipped"):
            lines.append(f"| {i} | {f['fault']} | skipped: {f['skipped']} | | |")
            continue
        lines.append(
            f"| {i} | {f['fault']} | v{f['at_version']} | {f['all_ready_after_s']} | {f['next_version_after_s']} |"
        )
    lines += ["", "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'pass' if v else '**FAIL**'} |" for k, v in res["checks"].items()]
    lines += [
        "",
        f"- job wall time under chaos: {res['chaos_wall_s']} s"
        + (f"; the same job without faults, same stack: {res['clean_wall_s']} s" if "clean_wall_s" in res else ""),
        f"- ledger: {res['ledger']}",
        f"- trainer's record (all checkpoints' trained groups): {res['trained_record']}",
        f"- trainer resumed from checkpoints {res['resumed_from']}; corrupt checkpoints skipped: "
        f"{sorted(set(res['corrupt_skipped']))}",
        f"- rollout refused versions {res['refused_versions']}; adopted {len(res['adopted_versions'])} versions",
        f"- dead letters: {res['dead_letters']}; restarts: {res['restarts']} (only the injected ones)",
        f"- final held-out accuracy: {res['final_eval'] and res['final_eval']['accuracy']}",
        "",
    ]
    if res["audit_problems"]:
        lines += ["Audit problems:", *[f"- {p}" for p in res["audit_problems"]], ""]
    return "\n".join(lines)
