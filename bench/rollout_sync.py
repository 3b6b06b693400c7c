"""Publish -> adopt latency of policy versions in the rollout service, both engine modes.

A publisher thread plays the trainer: every `--interval` seconds it writes version N of a
LoRA of the tiny model (adapter files + a manifest with sha256s and the log-prob probe)
into a file store and moves the job's policy pointer. The main thread runs the rollout
worker's real loop (`tick`) against a real engine while prompts keep arriving, so
adoption competes with generation as it does in a run. Latency per version is what the
worker records: manifest written -> version verified (hashes + probe) and serving.

With `--eval-size N` the job also has a held-out evaluation of N prompts (eval_samples
samples + 1 greedy each), long enough that nearly every version is published while one runs,
and the run is made twice side by side in the same process and engine:
- "blocking": the evaluation in one round (`eval_chunk = N`), as rollout evaluated before
  evaluation rounds existed: adoption and generation wait for the whole evaluation;
- "rounds": the evaluation in rounds of `--eval-chunk` prompts between generation rounds.
Reported per run: for each version published while an evaluation was in progress, the time
from its publication until rollout serves it or a newer version (the blocking evaluation
makes rollout skip the versions published meanwhile), and how long evaluations took. A
third run without evaluation ("none") gives the floor: what a generation round costs.

Usage (one engine at a time; the remote mode starts `python -m vllm.entrypoints.openai.api_server`):
    .venv/bin/python bench/rollout_sync.py                 # both modes, 12 versions each
    .venv/bin/python bench/rollout_sync.py --modes remote --versions 20 --out bench/results/sync.md
    .venv/bin/python bench/rollout_sync.py --modes inprocess --eval-size 256 --versions 8 --interval 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import keys  # noqa: E402
from shared.bus import FIELD  # noqa: E402
from shared.metrics import read_evals, read_points  # noqa: E402
from shared.policy import read_manifest  # noqa: E402
from shared.schema import PromptMsg, encode  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command  # noqa: E402
from tests.support.lab.stack import MODEL  # noqa: E402
from tests.support.rollout import (  # noqa: E402
    add_job,
    bench_stack,
    lora_versions,
    make_worker,
    percentile,
    publish,
    started_engine,
)


def run_mode(mode: str, model: str, n_versions: int, interval: float, versions: list, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    with bench_stack(workdir) as (r, redis_url, store), started_engine(mode, model, workdir) as (engine, _):
        res = run_once(engine, model, r, redis_url, store, workdir, n_versions, interval, versions, eval_size=0)
    return {"mode": mode, **res}


def run_eval_mode(
    mode: str, model: str, n_versions: int, interval: float, versions: list, workdir: Path, size: int, chunk: int
) -> list[dict]:
    """Blocking and round-by-round evaluation, alternately on one engine (same run, same machine load)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = []
    with bench_stack(workdir) as (r, redis_url, store), started_engine(mode, model, workdir) as (engine, _):
        # "none": no evaluation at all, the floor (what a generation round costs an adoption).
        for i, (name, n, c) in enumerate((("none", 0, 8), ("blocking", size, size), ("rounds", size, chunk))):
            res = run_once(
                engine, model, r, redis_url, store, workdir / f"run{i}", n_versions, interval, versions, n, c, True
            )
            out.append({"mode": mode, "eval": name, "eval_chunk": c, **res})
            print(json.dumps(out[-1]), flush=True)
    return out


def run_once(
    engine,  # noqa: ANN001
    model: str,
    r,  # noqa: ANN001
    redis_url: str,
    store,  # noqa: ANN001
    workdir: Path,
    n_versions: int,
    interval: float,
    versions: list,
    eval_size: int,
    eval_chunk: int = 8,
    serving: bool = False,
) -> dict:
    worker = make_worker(
        engine, model, redis_url, store, workdir, prompts_per_batch=8, eval_chunk=eval_chunk, score_workers=1
    )
    job = add_job(r, model, name="sync", group_size=8, eval_size=eval_size, max_staleness=1)
    stop = threading.Event()

    met_eval: set[int] = set()  # versions published while an evaluation of the job was in progress

    def trainer() -> None:
        for v in range(1, n_versions + 1):
            if stop.wait(interval):
                return
            publish(store, r, job.id, v, *versions[(v - 1) % len(versions)])
            if job.id in worker.evaluator.running:  # a dict read from another thread: fine for a bench
                met_eval.add(v)

    def feeder() -> None:  # keep the engine busy: ~2 batches of prompts always waiting
        i = 0
        while not stop.is_set():
            if i - int(r.hget(keys.ledger(job.id), "produced") or 0) < 16:
                for _ in range(8):
                    msg = PromptMsg(job_id=job.id, group_id=f"g{i}", item_id=str(i), prompt=f"{i % 50}+{i % 7}=")
                    r.xadd(keys.prompts(job.id), {FIELD: encode(msg)})
                    i += 1
            stop.wait(0.05)

    threads = [threading.Thread(target=trainer, daemon=True), threading.Thread(target=feeder, daemon=True)]
    for t in threads:
        t.start()
    t_start = time.time()
    deadline = t_start + n_versions * interval + (600 if eval_size else 120)
    try:
        while time.time() < deadline:
            worker.tick()
            view = worker.jobs.get(job.id)
            # With an evaluation: also until one has finished, so its duration is measured.
            if view and view.version == n_versions and (not eval_size or r.hlen(keys.evals(job.id))):
                break
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    wall_s = time.time() - t_start
    produced = int(r.hget(keys.ledger(job.id), "produced") or 0)
    points = read_points(r, job.id, "rollout_version")
    evals = read_evals(r, job.id)
    seen = met_eval | {p["version"] for p in points} | (set() if eval_size else set(range(1, n_versions + 1)))
    published = {v: read_manifest(store, job.id, v).created_at for v in seen}
    worker.close()
    r.srem(keys.active_jobs(), job.id)  # the next run's worker must not serve this job
    adopted = [p for p in points if p["event"] == "adopted"]
    refused = [p for p in points if p["event"] == "refused"]
    if serving:
        # Each tracked version waits until rollout serves it or a newer one (versions published
        # meanwhile are skipped: adopting the newest is the point). Tracked: the versions
        # published while an evaluation was in progress (all of them without evaluation).
        tracked = sorted(met_eval) if eval_size else sorted(published)
        served_at = sorted((published[p["version"]] + p["adopt_s"], p["version"]) for p in adopted)
        lat = [
            next((t for t, got in served_at if got >= v and t >= published[v]), time.time()) - published[v]
            for v in tracked
        ]
    else:
        lat = [p["adopt_s"] for p in adopted]
    out = {
        "versions_published": n_versions,
        "adopted": len(adopted),
        "refused": len(refused),
        "p50_s": round(percentile(lat, 50), 3) if lat else None,
        "p95_s": round(percentile(lat, 95), 3) if lat else None,
        "max_s": round(max(lat), 3) if lat else None,
        "probe_mean_diff": max((p["probe_mean_diff"] or 0.0) for p in adopted) if adopted else None,
        "groups_per_s": round(produced / wall_s, 2),  # training groups generated meanwhile
    }
    if eval_size:
        out["published_during_eval"] = len(met_eval)  # the latencies above: publish -> serving it or newer
        out["evals"] = len(evals)
        out["eval_s_mean"] = round(sum(e["seconds"] for e in evals) / len(evals), 2) if evals else None
    return out


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: publish -> adopt latency per engine mode (and evaluation)."""
    return [
        figure(
            f"publish -> adopt, {r['mode']}" + (f", evaluation {r['eval']}" if "eval" in r else ""),
            f"p50 {r['p50_s']} s, p95 {r['p95_s']} s",
        )
        for r in res["runs"]
    ]


def report(res: dict[str, Any], cmd: str) -> str:
    runs = res["runs"]
    evals = any("eval" in r for r in runs)
    rate = any("groups_per_s" in r for r in runs)  # not recorded before the runs kept it
    columns = ["engine mode", *(["evaluation"] if evals else []), "versions adopted", "refused", "p50 s", "p95 s"]
    columns += ["max s", *(["evaluation s (mean)"] if evals else []), *(["groups/s meanwhile"] if rate else [])]
    lines = ["## Weight sync: publish -> adopt", "", f"`{cmd}`", "", "| " + " | ".join(columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    for r in runs:
        cells = [r["mode"], *([r.get("eval", "-")] if evals else []), f"{r['adopted']}/{r['versions_published']}"]
        cells += [r["refused"], r["p50_s"], r["p95_s"], r["max_s"], *([r.get("eval_s_mean")] if evals else [])]
        lines.append("| " + " | ".join(str(c) for c in [*cells, *([r["groups_per_s"]] if rate else [])]) + " |")
    by = {r.get("eval"): r for r in runs}
    if {"blocking", "rounds"} <= set(by) and by["rounds"]["p50_s"]:
        ratio = by["blocking"]["p50_s"] / by["rounds"]["p50_s"]
        lines += ["", f"Publish -> adopt during an evaluation, p50 blocking / rounds: **{ratio:.1f}x**."]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], png: Path) -> None:
    """p50 and p95 publish -> adopt, per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    names = [r["mode"] + (f" {r['eval']}" if "eval" in r else "") for r in runs]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([n + " p50" for n in names], [r["p50_s"] or 0 for r in runs], color="tab:blue")
    ax.bar([n + " p95" for n in names], [r["p95_s"] or 0 for r in runs], color="tab:orange")
    ax.set_ylabel("seconds publish -> adopt")
    ax.set_title("weight sync latency")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="inprocess,remote")
    ap.add_argument("--versions", type=int, default=12)
    ap.add_argument("--interval", type=float, default=1.5, help="Seconds between published versions.")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--eval-size", type=int, default=0, help="Held-out prompts per evaluation (0: none).")
    ap.add_argument("--eval-chunk", type=int, default=16, help="Held-out prompts per evaluation round.")
    ap.add_argument("--out", type=Path, help="The page (and its .json and .png beside it); default: stdout only.")
    args = ap.parse_args()
    cmd = shown_command(__file__)
    versions = lora_versions(args.model, list(range(1, 5)))  # 4 distinct LoRAs, reused round-robin
    results = []
    with tempfile.TemporaryDirectory(prefix="burstrl-bench-sync-") as tmp:
        for mode in args.modes.split(","):
            if args.eval_size:
                results += run_eval_mode(
                    mode,
                    args.model,
                    args.versions,
                    args.interval,
                    versions,
                    Path(tmp) / mode,
                    args.eval_size,
                    args.eval_chunk,
                )
                continue
            res = run_mode(mode, args.model, args.versions, args.interval, versions, Path(tmp) / mode)
            results.append(res)
            print(json.dumps(res), flush=True)
    data = {"runs": results}
    emit(report(data, cmd), args.out, data, figures=figures(data), command=cmd)
    if args.out:
        plot(data, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
