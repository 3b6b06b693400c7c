"""`make bench`: every benchmark, one after another, into docs/bench.md (+ PNG plots in docs/bench/).

Each benchmark runs as its own process with the exact command shown above its numbers
in the report; the stack benchmarks start and stop their own redis-server and services,
so only one stack runs at a time. Ratios inside one benchmark come from items run side
by side (A/B alternating) in that same process. Short settings by default; `--full`
runs longer jobs and more rounds.

    .venv/bin/python bench/run_all.py [--full] [--only pipeline,staleness] [--out docs/bench.md]

Over ~400 lines: the index of every benchmark (its command, its summary rows, its plot) in one
place, so docs/bench.md is rebuilt from one table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.output import repo_path  # noqa: E402

PY = ".venv/bin/python"
# The countup workload's threshold: its SFT model starts near 0.21 held-out and 30 steps at lr 5e-4
# take it to ~0.5 (bench/trl_compare.py --task countup --steps 30), so 0.45 is reached late in the run.
COUNTUP_THRESHOLD = "0.45"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gb = int(line.split()[1]) / 1024**2
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    load = os.getloadavg()
    return (
        f"- machine: {cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GB RAM, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}\n"
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
        f"- git commit: {commit.stdout.strip() or 'unknown'}{' (working tree has uncommitted changes)' if dirty else ''}\n"
        f"- load average at start: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (the machine is shared; "
        "numbers move with what else runs)"
    )


def items(full: bool, out: Path) -> list[tuple[str, list[str], Path | None]]:
    """(name, command, markdown file it writes or None when its stdout is the report)."""
    b = out  # docs/bench/
    s = {  # short / full settings
        "bus": ["--groups", "400" if full else "200", "--rounds", "21" if full else "15"],
        "pipeline": ["--steps", "16" if full else "10", "--rounds", "3" if full else "2"],
        "staleness": ["--steps", "30" if full else "16", "--rounds", "1"],
        "scaling": ["--steps", "12" if full else "8", "--rounds", "2" if full else "1"],
        "sync": ["--modes", "inprocess,remote", "--versions", "12" if full else "6"],
        "tput": ["--modes", "inprocess,remote" if full else "inprocess", "--prompts", "64", "--rounds", "3"],
        # The trainer needs ~15-40 s to start on a shared 2-core box: on-periods of 50 s (100 s full).
        "backlog": ["--cycles", "2", "--cycle-s", "400" if full else "200", "--rounds", "5" if full else "3"],
    }
    steps = s["staleness"][1]
    return [
        ("bus", [PY, "bench/bus.py", *s["bus"], "--out", str(b / "bus.md")], b / "bus.md"),
        ("pipeline", [PY, "bench/pipeline.py", *s["pipeline"], "--out", str(b / "pipeline.md")], b / "pipeline.md"),
        (
            "staleness",
            [PY, "bench/staleness.py", *s["staleness"], "--out", str(b / "staleness.md")],
            b / "staleness.md",
        ),
        (
            "trl",
            [PY, "bench/trl_compare.py", "--task", "arith", "--steps", steps, "--threshold", "0.3"]
            + ["--rounds", "3" if full else "2", "--out", str(b / "trl.md")],
            b / "trl.md",
        ),
        (
            "trl_countup",
            [PY, "bench/trl_compare.py", "--task", "countup", "--steps", "30", "--threshold", COUNTUP_THRESHOLD]
            + ["--rounds", "3" if full else "2", "--out", str(b / "trl_countup.md")],
            b / "trl_countup.md",
        ),
        (
            "trainer_passes",
            [PY, "bench/trainer_passes.py", "--rounds", "7" if full else "5", "--out", str(b / "trainer_passes.md")],
            b / "trainer_passes.md",
        ),
        (
            # B is the tree before the trainer stopped importing an unused bitsandbytes (docs/bench/trainer_startup.md)
            "trainer_startup",
            [PY, "bench/trainer_startup.py", "--baseline", "9061c30", "--rounds", "7" if full else "5"]
            + ["--out", str(b / "trainer_startup.md")],
            b / "trainer_startup.md",
        ),
        (
            "chunked_logprobs",
            [PY, "bench/chunked_logprobs.py", "--out", str(b / "chunked_logprobs.md")]
            + ["--json", str(b / "chunked_logprobs.json")],
            b / "chunked_logprobs.md",
        ),
        (
            "generation",
            [PY, "bench/generation.py", "--rounds", "3" if full else "2", "--out", str(b / "generation.md")],
            b / "generation.md",
        ),
        ("sync", [PY, "bench/rollout_sync.py", *s["sync"], "--json", str(b / "sync.json")], None),
        ("tput", [PY, "bench/rollout_throughput.py", *s["tput"], "--json", str(b / "tput.json")], None),
        ("scaling", [PY, "bench/scaling.py", *s["scaling"], "--out", str(b / "scaling.md")], b / "scaling.md"),
        ("verifiers", [PY, "bench/verifiers.py", "--n-math", "200", "--n-code", "32"], None),
        (
            "omp_wait",
            [PY, "bench/omp_wait.py", "--rounds", "3" if full else "2", "--out", str(b / "omp_wait.md")],
            b / "omp_wait.md",
        ),
        ("backlog", [PY, "bench/backlog.py", *s["backlog"], "--out", str(b / "backlog.md")], b / "backlog.md"),
        ("burst", [PY, "bench/burst.py", *(["--full"] if full else []), "--out", str(b / "burst.md")], b / "burst.md"),
    ]


def section_md(title: str, cmd: str, columns: list[str], rows: list[str]) -> str:
    """A report section: its heading, the command that measured it, and a table (rows pre-formatted)."""
    head = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join([f"## {title}", "", f"`{cmd}`", "", *head, *rows]) + "\n"


def sync_md(cmd: str, data: list[dict[str, Any]]) -> str:
    columns = ["engine mode", "versions adopted", "refused", "p50 s", "p95 s", "max s"]
    rows = [
        f"| {r['mode']} | {r['adopted']}/{r['versions_published']} | {r['refused']} | {r['p50_s']} | "
        f"{r['p95_s']} | {r['max_s']} |"
        for r in data
    ]
    return section_md("Weight sync: publish -> adopt", cmd, columns, rows)


def tput_md(cmd: str, data: list[dict[str, Any]]) -> str:
    columns = ["engine mode", "direct tok/s", "service tok/s", "service / direct"]
    rows = [f"| {r['mode']} | {r['direct_tok_s']} | {r['service_tok_s']} | **{r['ratio']:.2f}** |" for r in data]
    return section_md("Rollout service vs the engine called directly", cmd, columns, rows)


def trl_rows(d: list[dict[str, Any]], cmd: str, name: str) -> list[tuple[str, str, str, str]]:
    """The TRL comparison's summary rows: per burstrl setting, the median time ratio and accuracies."""
    import statistics

    from bench.trl_compare import ratios

    thr = float(cmd.split("--threshold ")[1].split()[0])
    task = cmd.split("--task ")[1].split()[0]
    ok = [r for r in d if not r.get("failed")]
    trl = [r for r in ok if r["side"] == "trl"]
    if not trl:
        return []
    trl_sps = statistics.median(r["samples_per_s"] for r in trl)
    trl_acc = statistics.median(r["evals"][-1]["accuracy"] for r in trl)
    rows = []
    found = ratios(d, thr)
    for mode in dict.fromkeys(r["mode"] for r in ok if r["side"] == "burstrl"):
        mine = [r for r in ok if r["mode"] == mode]
        rs = found.get(mode)
        ratio = f"{statistics.median(rs):.2f}x" if rs else "threshold not reached by both"
        label = f"max_staleness {mine[0]['staleness']}"
        rows.append((f"{task}: TRL time to acc {thr} / burstrl's ({label})", ratio, ">= 1.5x", name))
        sps = statistics.median(r["samples_per_s"] for r in mine)
        acc = statistics.median(r["evals"][-1]["accuracy"] for r in mine)
        rows.append((f"{task}: samples/s burstrl / TRL ({label})", f"{sps / trl_sps:.2f}", "", name))
        rows.append(
            (
                f"{task}: final held-out acc burstrl vs TRL ({label})",
                f"{acc:.3f} vs {trl_acc:.3f}",
                "burstrl >= TRL",
                name,
            )
        )
    return rows


def burst_rows(d: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """bench/burst.py's headline numbers: billable seconds to the threshold, M2PO's against the others."""
    by = {x["setup"]: x for x in d.get("runs", [])}
    rows = [("burst: measured k (trainer / inference groups/s)", f"{d['rates']['k']}", "~4", "burst")]
    m = by.get("m2po")
    for other in ("windowed", "trl"):
        o = by.get(other)
        if m and o and m.get("to_threshold") is not None and o.get("to_threshold") is not None:
            value = f"{m['to_threshold'] / o['to_threshold']:.2f}x"
        elif m and o and m.get("to_threshold") is not None:
            value = f"< {m['to_threshold'] / o['billable_s']:.2f}x ({other} never reached it)"
        else:
            value = "not reached"
        rows.append((f"burst: billable s to threshold, backlog + M2PO / {other}", value, "<= 0.5x", "burst"))
    return rows


def summary(b: Path, cmds: dict[str, str]) -> list[str]:
    """The headline number of each benchmark that ran, with its target and command."""
    import re
    import statistics

    rows = []

    def load(name: str) -> Any:
        f = b / name
        return json.loads(f.read_text()) if f.exists() else None

    if "pipeline" in cmds and (d := load("pipeline.json")):
        for name, r in d.get("layouts", {}).items():
            if r["layout"] == "split":
                what = f"/ slowest stage alone ({r['slowest']}); / slowest side alone ({r['slowest_side']})"
                value = f"{r['ratio']:.2f}; {r['ratio_side']:.2f}"
            else:
                what, value = f"/ slowest stage alone ({r['slowest']})", f"{r['ratio']:.2f}"
            rows.append(
                (
                    f"pipeline efficiency ({name.replace(',', ' cores,', 1)}): end-to-end {what}",
                    value,
                    ">= 0.9",
                    "pipeline",
                )
            )
        rows.append(("Redis time / trainer step", f"{100 * d['bus_frac']:.2f}%", "small", "pipeline"))
    if "omp_wait" in cmds and (b / "omp_wait.md").exists():
        for m in re.finditer(
            r"^\| (\d+) \| [0-9.]+ \| [0-9.]+ \| \*\*([0-9.]+)x\*\* \|$", (b / "omp_wait.md").read_text(), re.M
        ):
            what = f"tiny-model step time, OpenMP default / PASSIVE ({m.group(1)} torch processes at once)"
            rows.append((what, f"{m.group(2)}x", ">= 1 (the Makefile's OMP_WAIT_POLICY)", "omp_wait"))
    if "bus" in cmds and (b / "bus.md").exists():
        text = (b / "bus.md").read_text()
        if m := re.search(r"\| bus: .*?\*\*([0-9.]+)\*\*", text):
            rows.append(("bus / raw redis-py throughput", m.group(1), ">= 0.8", "bus"))
        if m := re.search(r"\| bus \+ schema: .*?\*\*([0-9.]+)\*\*", text):
            rows.append(("bus + msgpack schema / raw redis-py throughput", m.group(1), "", "bus"))
    for name in ("trl", "trl_countup"):
        if name in cmds and (d := load(f"{name}.json")):
            rows += trl_rows(d, cmds[name], name)
    if "trainer_passes" in cmds and (b / "trainer_passes.md").exists():
        text = (b / "trainer_passes.md").read_text()
        if m := re.search(r"\| (\d+) \| [0-9.]+ \| \*\*([0-9.]+x)\*\*", text):
            rows.append(
                (f"trainer step, micro_batch_tokens {m.group(1)} vs one padded pass", m.group(2), "", "trainer_passes")
            )
    if "trainer_startup" in cmds and (b / "trainer_startup.md").exists():
        if m := re.search(r"\*\*median ([0-9.]+x)\*\*", (b / "trainer_startup.md").read_text()):
            rows.append(
                (
                    "trainer spawn to ready, this tree / before bitsandbytes was skipped",
                    m.group(1),
                    "",
                    "trainer_startup",
                )
            )
    if "chunked_logprobs" in cmds and (d := load("chunked_logprobs.json")):
        for case, r in d.items():
            rows.append(
                (
                    f"peak memory, chunked / unchunked log-probs ({case}, Qwen2.5-0.5B shape)",
                    f"{r['ratio']:.2f}x ({r['chunked_mib']:.0f} vs {r['unchunked_mib']:.0f} MiB)",
                    "",
                    "chunked_logprobs",
                )
            )
    if "generation" in cmds and (d := load("generation.json")):
        for n in sorted(d["hf"], key=int):
            ratio = statistics.median(d["vllm"][n]) / statistics.median(d["hf"][n])
            rows.append((f"generation tok/s vLLM / HF generate, {n} new tokens", f"{ratio:.2f}", "", "generation"))
    if "staleness" in cmds and (d := load("staleness.json")):
        walls = {k: statistics.median(r["wall_s"] for r in v) for k, v in d.items()}
        if "0" in walls:
            for k in sorted(walls):
                if k != "0":
                    rows.append((f"speed-up max_staleness {k} vs 0", f"{walls['0'] / walls[k]:.2f}x", "", "staleness"))
    if "sync" in cmds and (d := load("sync.json")):
        for r in d:
            rows.append((f"publish -> adopt, {r['mode']}", f"p50 {r['p50_s']} s, p95 {r['p95_s']} s", "", "sync"))
    if "tput" in cmds and (d := load("tput.json")):
        for r in d:
            rows.append((f"rollout service / direct engine tok/s, {r['mode']}", f"{r['ratio']:.2f}", ">= 0.9", "tput"))
    if "scaling" in cmds and (d := load("scaling.json")):
        res = d["results"]
        med = {n: {k: statistics.median(v) for k, v in x.items()} for n, x in res.items()}
        rows.append(
            ("2 / 1 rollout replicas, rollout alone", f"{med['2']['alone'] / med['1']['alone']:.2f}x", "", "scaling")
        )
        rows.append(("2 / 1 rollout replicas, end-to-end", f"{med['2']['e2e'] / med['1']['e2e']:.2f}x", "", "scaling"))
    if "backlog" in cmds and (d := load("backlog.json")):
        for mode in ("windowed", "backlog"):
            idle = [x["idle_frac"] for x in d.get("idle", []) if x["mode"] == mode]
            if idle:
                target = "<= 5%" if mode == "backlog" else ""
                rows.append(
                    (
                        f"rollout idle, trainer absent 75% of the time, {mode}",
                        f"{statistics.median(idle):.1%}",
                        target,
                        "backlog",
                    )
                )
        for store, x in d.get("throughput", {}).items():
            rows.append((f"backlog spill / raw put, {store}", f"{x['spill_ratio']:.2f}", ">= 0.8", "backlog"))
            rows.append((f"backlog restore / raw get, {store}", f"{x['restore_ratio']:.2f}", ">= 0.8", "backlog"))
        for store, x in d.get("first", {}).items():
            rows.append(
                (
                    f"first batch from a {x['backlog_groups']}-group backlog, {store}",
                    f"{x['first_batch_s']} s",
                    "",
                    "backlog",
                )
            )
    if "burst" in cmds and (d := load("burst.json")):
        rows += burst_rows(d)
    if not rows:
        return []
    out = ["## Summary", "", "| measure | result | target | command |", "|---|---|---|---|"]
    out += [f"| {m} | **{v}** | {t} | `{cmds[c]}` |" for m, v, t, c in rows]
    return [*out, ""]


def plots(b: Path) -> list[str]:
    """Summary plots from the benchmarks' JSON; returns markdown image lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    if (b / "pipeline.png").exists():  # bench/pipeline.py draws its own
        out.append("![pipeline](bench/pipeline.png)")
    if (b / "sync.json").exists():
        d = json.loads((b / "sync.json").read_text())
        fig, ax = plt.subplots(figsize=(6, 3.5))
        modes = [r["mode"] for r in d]
        ax.bar([m + " p50" for m in modes], [r["p50_s"] or 0 for r in d], color="tab:blue")
        ax.bar([m + " p95" for m in modes], [r["p95_s"] or 0 for r in d], color="tab:orange")
        ax.set_ylabel("seconds publish -> adopt")
        ax.set_title("weight sync latency")
        fig.tight_layout()
        fig.savefig(b / "sync.png", dpi=100)
        plt.close(fig)
        out.append("![sync](bench/sync.png)")
    for name in ("staleness", "trl", "trl_countup", "burst"):
        if (b / f"{name}.png").exists():
            out.append(f"![{name}](bench/{name}.png)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="Longer jobs and more rounds.")
    ap.add_argument(
        "--only", default="", help="Comma-separated subset: " + ", ".join(n for n, *_ in items(False, ROOT))
    )
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench.md")
    ap.add_argument(
        "--report-only", action="store_true", help="Do not run anything: rebuild the report from docs/bench/ as is."
    )
    ap.add_argument("--timeout", type=float, default=1800, help="Per benchmark, seconds.")
    a = ap.parse_args()
    out = a.out.resolve()
    b = out.parent / "bench"
    b.mkdir(parents=True, exist_ok=True)
    rel = repo_path(b)
    only = set(filter(None, a.only.split(",")))
    header = machine()
    sections, timings = [], []
    ran: dict[str, str] = {}
    for name, cmd, md in items(a.full, rel):
        if only and name not in only:
            continue
        shown = " ".join(cmd)
        print(f"== {name}: {shown}", flush=True)
        t0 = time.time()
        log = b / f"{name}.log"
        if a.report_only:
            if not log.exists():
                continue
            rc = 0 if (md is None or (ROOT / md).exists()) else 1
        else:
            with log.open("w") as f:
                try:
                    rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = -1
        secs = time.time() - t0
        took = f"{secs:.0f}" if not a.report_only else f"(earlier run, log {log.name})"
        timings.append(f"| {name} | {took} | {'ok' if rc == 0 else f'FAILED (rc {rc}, see {log.name})'} |")
        print(f"   {name}: rc {rc} in {secs:.0f}s", flush=True)
        text = log.read_text(errors="replace")
        if rc == 0:
            ran[name] = shown
        if rc != 0:
            tail = "\n".join(text.splitlines()[-15:])
            sections.append(f"## {name}: failed\n\n`{shown}` exited {rc}:\n\n```\n{tail}\n```\n")
            continue
        if md is not None:
            sections.append((ROOT / md).read_text())
        elif name == "sync":
            sections.append(sync_md(shown, json.loads((ROOT / rel / "sync.json").read_text())))
        elif name == "tput":
            sections.append(tput_md(shown, json.loads((ROOT / rel / "tput.json").read_text())))
        else:
            body = "\n".join(ln for ln in text.splitlines() if "Warning" not in ln)
            sections.append(f"## {name}\n\n`{shown}`\n\n```\n{body.strip()}\n```\n")
    if a.report_only:  # say when the numbers were made, not only when the page was rebuilt
        stamps = sorted(f.stat().st_mtime for f in b.glob("*.log"))
        if stamps:
            span = [
                dt.datetime.fromtimestamp(t).astimezone().isoformat(timespec="minutes")
                for t in stamps[:: len(stamps) - 1 or 1]
            ]
            header += f"\n- report rebuilt from logs written {span[0]} .. {span[-1]}"
    imgs = plots(b)
    doc = [
        "# burstrl benchmarks",
        "",
        f"Written by `{PY} bench/run_all.py{' --full' if a.full else ''}"
        f"{' --only ' + a.only if a.only else ''}{' --report-only' if a.report_only else ''}`. Every number below sits under the command that produced it "
        "(run from the repository root).",
        "",
        header,
        "",
        *summary(b, ran),
        *imgs,
        "",
        *sections,
        "## Run log",
        "",
        "| benchmark | seconds | result |",
        "|---|---|---|",
        *timings,
        "",
    ]
    out.write_text("\n".join(doc))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
