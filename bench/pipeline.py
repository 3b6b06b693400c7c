"""Pipeline efficiency: end-to-end trained groups/s over the slowest stage's groups/s run alone.

One stack (redis-server + api, rollout, reward, ref, trainer as local processes, exactly
what `burstrl up` runs), one model, one machine, one run. Rounds alternate:
- **end-to-end**: a GRPO-LoRA job of the demo's shape (G 16, batch 8, KL 0.001 so ref
  runs, max_staleness 1) through all five services; rate = groups trained per second
  between the trainer's first and last step (model loading excluded);
- **each stage alone** (tests/support/lab/stages.py): every service paused, a full queue
  fed, then each stage resumed alone over what the previous one left; rate = groups moved
  per second from the stage's first counted group to its last, so one-off start-up work
  is excluded on both sides.
Efficiency = end-to-end rate / min(stage rates). Evaluations are off (eval_size 0) in
both, so both measure the same work.

Two layouts of the same services on one machine, each measured both ways:
- **split** (`split_layout`): the deployment burstrl is built for, on one box: the
  always-on inference side (rollout, ref, reward, api) pinned to half the cores, the
  trainer (a rented GPU in production) to the other half. Each stage alone runs on its
  side's cores. The inference side's stages share its cores in the pipeline, so the
  side's rate is theirs one after another (1 / sum of 1/rate); efficiency is also given
  against the slowest side.
- **shared**: every service on every core, as `burstrl up` runs them; each stage alone
  has the whole machine while the end-to-end job splits it five ways, so on 2 cores this
  ratio mostly measures the contention, not the pipeline.

    .venv/bin/python bench/pipeline.py [--steps 12] [--rounds 2] [--layouts split,shared] [--out bench/results/pipeline.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.lab.jobs import DEMO_SHAPE  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command  # noqa: E402
from tests.support.lab.stack import MODEL, Stack, run_job, split_layout  # noqa: E402
from tests.support.lab.stages import stages_alone  # noqa: E402

SIDES = {"inference": ("rollout", "reward", "ref"), "trainer": ("trainer",)}


def side_rates(alone: dict[str, float]) -> dict[str, float]:
    """Groups/s of each side of the split layout: its stages share its cores, so its rate
    is theirs one after another (1 / sum of 1/rate)."""
    return {
        side: 1.0 / sum(1.0 / alone[s] for s in stages if s in alone)
        for side, stages in SIDES.items()
        if any(s in alone for s in stages)
    }


def measure(
    layout: str,
    steps: int,
    rounds: int,
    model: str,
    env: dict[str, str] | None = None,
    alone_too: bool = True,
    stalenesses: tuple[int, ...] = (1,),
) -> dict[str, dict[str, Any]]:
    """Alternating end-to-end / stages-alone rounds on one stack in `layout`; one result per
    max_staleness of the end-to-end job (the stages alone do not depend on it)."""
    cpus = split_layout() if layout == "split" else None
    e2e: dict[int, list[float]] = {s: [] for s in stalenesses}
    idle: dict[int, list[float]] = {s: [] for s in stalenesses}
    busy: dict[int, list[float]] = {s: [] for s in stalenesses}
    alone, bus_frac, bus_ms = [], [], []
    with (
        tempfile.TemporaryDirectory(prefix="burstrl-pipe-") as tmp,
        Stack(Path(tmp), model, cpus=cpus, env=env) as stack,
    ):
        # A short job first: one-off work in fresh services (caches, allocator growth) must
        # not land in the first measured round.
        run_job(stack, {**DEMO_SHAPE, "name": "warm-up", "steps": 2, "eval_size": 0})
        for k in range(rounds):
            for st in stalenesses:
                spec = {**DEMO_SHAPE, "name": f"e2e{k}-s{st}", "steps": steps, "eval_size": 0, "max_staleness": st}
                res = run_job(stack, spec)
                e2e[st].append(res["groups_per_s"])
                pts = res["points"][1:]  # the first step waited for the first rollouts
                idle[st].append(statistics.median(p["idle_frac"] for p in pts))
                # The trainer's own speed inside the job: groups over the time between its
                # points minus the time it waited for data. Against its speed alone it splits
                # the ratio in two: the trainer slower when sharing the machine (busy rate <
                # alone) and the trainer waiting on the pipeline (end-to-end < busy rate).
                seq = sorted(res["points"], key=lambda p: p["step"])[1:]
                span = sum(b["at"] - a["at"] - b["wait_s"] for a, b in zip(seq, seq[1:], strict=False))
                busy[st].append(sum(p["groups"] for p in seq[1:]) / span if span > 0 else float("nan"))
                # Redis time in a trainer step: bus reads that found data + settle scripts, over the busy time.
                bus_frac.append(statistics.median(p["bus_frac"] for p in pts))
                bus_ms.append(statistics.median(p["bus_s"] for p in pts) * 1000)
                print(f"{layout} round {k} max_staleness {st}: end-to-end {e2e[st][-1]:.2f} groups/s", flush=True)
            if alone_too:
                alone.append(stages_alone(stack, steps))
                print(f"{layout} round {k}: alone {alone[-1]}", flush=True)
    out: dict[str, dict[str, Any]] = {}
    for st in stalenesses:
        r: dict[str, Any] = {
            "layout": layout,
            "max_staleness": st,
            "cpus": {k: sorted(v) for k, v in (cpus or {}).items()},
            "end_to_end": e2e[st],
            "trainer_idle": statistics.median(idle[st]),
            "trainer_busy_rate": statistics.median(busy[st]),
            "bus_frac": statistics.median(bus_frac),
            "bus_ms": statistics.median(bus_ms),
        }
        if alone:
            med = {s: statistics.median(x[s] for x in alone) for s in alone[0]}
            e2e_med = statistics.median(e2e[st])
            slowest = min(med, key=med.get)
            r |= {"alone": alone, "alone_median": med, "slowest": slowest, "ratio": e2e_med / med[slowest]}
            if layout == "split":  # shared: every stage can use every core, sides mean nothing
                sides = side_rates(med)
                slowest_side = min(sides, key=sides.get)
                r |= {"sides": sides, "slowest_side": slowest_side, "ratio_side": e2e_med / sides[slowest_side]}
        out[f"{layout}, max_staleness {st}"] = r
    return out


def report(cmd: str, steps: int, rounds: int, res: dict[str, dict[str, Any]]) -> str:
    lines = [
        "## Pipeline efficiency",
        "",
        f"`{cmd}` — per layout, {rounds} alternating round(s) of an end-to-end job and the stages "
        f"alone, {steps} steps x 8 groups x G=16 each, eval off.",
        "",
        "- **split**: the deployment on one box: rollout, ref, reward and api (the always-on inference side) "
        "pinned to the first half of the cores, the trainer (the rented GPU, in production) to the other half. "
        "Each stage alone runs on its side's cores; a side's rate is its stages one after another "
        "(they share its cores), the trainer side's is the trainer's.",
        "- **shared**: every service on every core; each stage alone has the whole machine, the end-to-end "
        "job splits it five ways.",
        "- **max_staleness s**: the feeder keeps s + 1 batches in flight (the staleness bound). A batch fed when "
        "step k is acknowledged must be generated, scored and ref'd before step k + s + 1 starts, so the "
        "trainer can hide at most s of its own steps of that latency: once the inference chain of one batch "
        "takes longer than s trainer steps, the trainer waits, however fast each stage is.",
        "",
        "| layout, job | end-to-end groups/s | rollout alone | reward alone | ref alone | trainer alone "
        "| inference side (split) | trainer idle / step | trainer's busy rate in the job (waits excluded) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        m = r["alone_median"]
        e2e = statistics.median(r["end_to_end"])
        inf = r["sides"].get("inference", float("nan")) if r["layout"] == "split" else float("nan")
        lines.append(
            f"| {name} | {e2e:.2f} ({', '.join(f'{x:.2f}' for x in r['end_to_end'])}) | {m.get('rollout', 0):.2f} "
            f"| {m.get('reward', 0):.2f} | {m.get('ref', 0):.2f} | {m.get('trainer', 0):.2f} | {inf:.2f} "
            f"| {r['trainer_idle']:.2f} | {r['trainer_busy_rate']:.2f} |"
        )
    lines.append("")
    for name, r in res.items():
        side = (
            f"; end-to-end / slowest side alone ({r['slowest_side']} side) = {r['ratio_side']:.2f}"
            if r["layout"] == "split"  # shared: every stage can use every core, sides mean nothing
            else ""
        )
        lines.append(
            f"- **{name}: efficiency = end-to-end / slowest stage alone ({r['slowest']}) = {r['ratio']:.2f}**"
            f"{side} (target >= 0.9)."
        )
        if r["slowest"] == "trainer":
            alone_t = r["alone_median"]["trainer"]
            e2e = statistics.median(r["end_to_end"])
            lines.append(
                f"  - split of that ratio: the trainer's busy rate in the job / alone = "
                f"{r['trainer_busy_rate'] / alone_t:.2f} (the trainer itself slower while the other stages share "
                f"the machine) x end-to-end / the trainer's busy rate = {e2e / r['trainer_busy_rate']:.2f} "
                "(the trainer waiting for data: pipeline stalls)."
            )
    any_r = next(iter(res.values()))
    lines += [
        "",
        f"**Redis time as a share of a trainer step: median {100 * any_r['bus_frac']:.2f}%** "
        f"({any_r['bus_ms']:.1f} ms of bus reads and settle scripts per step, over the step's train + publish + "
        f"checkpoint time; trainer points `bus_frac`, {any_r['layout']} layout).",
        "",
    ]
    return "\n".join(lines)


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: each layout's efficiency (and, split, against the
    slowest side), and Redis's share of a trainer step."""
    out = []
    for name, r in res["layouts"].items():
        value = f"{statistics.median(r['end_to_end']):.2f} groups/s end-to-end"
        against = [(f"stage alone ({r['slowest']})", r["alone_median"][r["slowest"]], r["ratio"])]
        if r["layout"] == "split":  # shared: every stage can use every core, sides mean nothing
            against.append((f"side alone ({r['slowest_side']} side)", r["sides"][r["slowest_side"]], r["ratio_side"]))
        for what, rate, ratio in against:
            title = f"pipeline efficiency ({name}): end-to-end / slowest {what}"
            out.append(figure(title, value, f"{rate:.2f} groups/s", ratio, ">= 0.9"))
    out.append(figure("Redis time / trainer step", f"{100 * res['bus_frac']:.2f}%", target="small"))
    return out


def plot(res: dict[str, dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_layout: dict[str, list[dict[str, Any]]] = {}
    for r in res.values():
        by_layout.setdefault(r["layout"], []).append(r)
    fig, axes = plt.subplots(1, len(by_layout), figsize=(6 * len(by_layout), 3.8), squeeze=False)
    for ax, (layout, rs) in zip(axes[0], by_layout.items(), strict=True):
        first = rs[0]
        labels = [f"end-to-end s{r['max_staleness']}" for r in rs]
        vals = [statistics.median(r["end_to_end"]) for r in rs]
        sides = first["sides"] if layout == "split" else {}
        labels += [*(f"{k} alone" for k in first["alone_median"]), *(f"{k} side" for k in sides)]
        vals += [*first["alone_median"].values(), *sides.values()]
        colors = ["tab:red"] * len(rs) + ["tab:blue"] * len(first["alone_median"]) + ["tab:gray"] * len(sides)
        ax.bar(labels, vals, color=colors)
        ax.set_yscale("log")  # stages alone span two orders of magnitude
        ax.set_ylabel("groups/s (log)")
        ax.tick_params(axis="x", labelrotation=45)
        eff = ", ".join(f"s{r['max_staleness']} {r['ratio']:.2f}" for r in rs)
        ax.set_title(f"{layout} cores: end-to-end / slowest stage = {eff}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def ab(layout: str, steps: int, rounds: int, model: str, setting: str) -> str:
    """End-to-end groups/s with and without one environment setting, fresh stacks alternating."""
    key, _, value = setting.partition("=")
    rates: dict[str, list[float]] = {"default": [], setting: []}
    for k in range(rounds):
        for name in ("default", setting) if k % 2 == 0 else (setting, "default"):
            env = {key: value} if name == setting else None
            (r,) = measure(layout, steps, 1, model, env, alone_too=False).values()
            rates[name].append(r["end_to_end"][0])
            print(f"ab round {k} {name}: {rates[name][-1]:.2f} groups/s", flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    return "\n".join(
        [
            f"## A/B: `{setting}` ({layout} layout)",
            "",
            "| stack | end-to-end groups/s (median) | rounds |",
            "|---|---|---|",
            *(f"| {n} | {med[n]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |" for n, v in rates.items()),
            "",
            f"**{setting} / default = {med[setting] / med['default']:.2f}**",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="Steps per job (groups = 8 x steps).")
    ap.add_argument("--rounds", type=int, default=2, help="Alternating end-to-end / stages-alone rounds.")
    ap.add_argument("--layouts", default="split,shared", help="Comma-separated: split, shared.")
    ap.add_argument(
        "--staleness",
        default="1,2",
        help="Comma-separated max_staleness values of the end-to-end job (the window is max_staleness + 1 "
        "batches; it bounds how much of the inference latency the trainer can overlap).",
    )
    ap.add_argument(
        "--ab",
        metavar="KEY=VALUE",
        default="",
        help="Instead: end-to-end rate of fresh stacks with and without this service setting, alternating "
        "(first layout only).",
    )
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", type=Path, default=None, help="Markdown here; .json and .png beside it.")
    a = ap.parse_args()
    cmd = shown_command(__file__)
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    if bad := set(layouts) - {"split", "shared"}:
        ap.error(f"unknown layouts {sorted(bad)}: use split and/or shared")
    if a.ab:
        if "=" not in a.ab:
            ap.error("--ab takes KEY=VALUE, e.g. BURSTRL_VLLM_CPU_INLINE=0")
        text = f"`{cmd}`\n\n" + ab(layouts[0], a.steps, a.rounds, a.model, a.ab)
        emit(text, a.out)  # a one-off reading: no results JSON, no headline
        return
    stal = tuple(int(x) for x in a.staleness.split(","))
    res: dict[str, dict[str, Any]] = {}
    for name in layouts:
        res |= measure(name, a.steps, a.rounds, a.model, stalenesses=stal)
    text = report(cmd, a.steps, a.rounds, res)
    head = next(iter(res.values()), {})
    data = {"layouts": res, "ratio": head.get("ratio"), "bus_frac": head.get("bus_frac")}
    emit(text, a.out, data, figures=figures(data), command=cmd)
    if a.out:
        plot(res, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
