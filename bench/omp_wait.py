"""OpenMP threads that spin against ones that sleep, with torch processes sharing the cores.

    .venv/bin/python bench/omp_wait.py [--procs 1,2] [--steps 40] [--rounds 2] [--out bench/results/omp_wait.md]

A service stack runs several torch processes on one box (rollout, ref, trainer; two test
workers run two stacks). libgomp's default lets an idle OpenMP thread spin for a while before
it sleeps, so threads of different processes burn each other's cores. The Makefile exports
OMP_WAIT_POLICY=PASSIVE for that reason; this measures what it buys and what it costs.

Workload: the tiny model's SFT step (forward + backward + AdamW on a batch of 64 x 24 tokens,
fp32, torch's default thread count), in N processes started together. Per N, the two policies
alternate within each round (A/B side by side), and the figure is each process's median step
time; the ratio is default / PASSIVE.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.lab.results import Figure, emit, figure, shown_command  # noqa: E402

WORKER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, model.config.vocab_size, (64, 24), generator=torch.Generator().manual_seed(0))
times = []
for i in range(int(sys.argv[2]) + 3):
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if i >= 3:  # warm-up steps left out
        times.append(time.perf_counter() - t)
print(json.dumps({"threads": torch.get_num_threads(), "median_s": sorted(times)[len(times) // 2]}))
"""


def run_group(model: Path, procs: int, steps: int, policy: str | None) -> list[float]:
    """`procs` processes at once under one OMP_WAIT_POLICY (None: libgomp's default)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(model), str(steps)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(procs)
    ]
    out = [p.communicate()[0] for p in ps]
    for p, o in zip(ps, out, strict=True):
        if p.returncode:
            raise SystemExit(f"worker failed ({p.returncode}): {o}")
    return [json.loads(o.strip().splitlines()[-1])["median_s"] for o in out]


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: per number of processes, default / PASSIVE step time."""
    out = []
    for r in res["rows"]:
        title = f"tiny-model step time, OpenMP default / PASSIVE ({r['procs']} torch processes at once)"
        default, passive = f"{r['default_s'] * 1000:.1f} ms/step", f"PASSIVE {r['passive_s'] * 1000:.1f} ms/step"
        out.append(figure(title, default, passive, r["ratio"], ">= 1 (the Makefile's OMP_WAIT_POLICY)"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="1,2", help="comma-separated process counts")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="The page (and its .json beside it); default: stdout only.")
    a = ap.parse_args()
    from shared.ml.tiny_model import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        build_model(model)  # the tiny model's architecture; its weights do not matter here
        rows = []
        for n in (int(x) for x in a.procs.split(",")):
            got: dict[str, list[float]] = {"default": [], "PASSIVE": []}
            for _ in range(a.rounds):
                for name, policy in (("default", None), ("PASSIVE", "PASSIVE")):
                    got[name] += run_group(model, n, a.steps, policy)
            d, p = statistics.median(got["default"]), statistics.median(got["PASSIVE"])
            rows.append({"procs": n, "default_s": d, "passive_s": p, "ratio": d / p})
            print(f"{n} process(es): default {d * 1000:.1f} ms/step, PASSIVE {p * 1000:.1f} ms/step, {d / p:.2f}x")
    cmd = shown_command(__file__)
    md = [
        "## OpenMP wait policy: spinning against sleeping threads",
        "",
        f"`{cmd}` ({os.cpu_count()} cores, load average at end {os.getloadavg()[0]:.1f})",
        "",
        "| torch processes at once | default ms/step | PASSIVE ms/step | default / PASSIVE |",
        "|---|---|---|---|",
    ]
    md += [
        f"| {r['procs']} | {r['default_s'] * 1000:.1f} | {r['passive_s'] * 1000:.1f} | **{r['ratio']:.2f}x** |"
        for r in rows
    ]
    data = {"cores": os.cpu_count(), "rows": rows}
    emit("\n".join(md) + "\n", a.out, data, figures=figures(data), command=cmd)


if __name__ == "__main__":
    main()
