"""Generated tokens/s of the rollout service vs. calling the same vLLM engine directly.

Same run, same engine, same adapter, same prompts and sampling settings. "Direct" is one
`LLM.generate` over all prompts (in-process) or the same `/v1/completions` requests sent
concurrently with httpx (remote). "Service" is the rollout worker's real loop: prompts
read from the Redis stream in batches of `--batch`, generated, packed into GroupMsgs,
forwarded downstream with the ledger update. Rounds alternate direct/service so engine
warm-up and machine noise hit both; the ratio of the medians is reported (target >= 0.9).

Usage:
    .venv/bin/python bench/rollout_throughput.py                      # both modes
    .venv/bin/python bench/rollout_throughput.py --modes inprocess --prompts 128 --rounds 5 --out bench/results/tput.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from shared import keys  # noqa: E402
from shared.bus import FIELD  # noqa: E402
from shared.domain.tasks import get_task  # noqa: E402
from shared.schema import PromptMsg, encode  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command, table  # noqa: E402
from tests.support.lab.stack import MODEL  # noqa: E402
from tests.support.rollout import add_job, bench_stack, lora_versions, make_worker, publish, started_engine  # noqa: E402


def direct_inprocess(engine, prompts: list[str], adapter, g: int, temp: float, max_tokens: int) -> int:  # noqa: ANN001
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(n=g, temperature=temp, top_p=1.0, max_tokens=max_tokens, logprobs=0)
    lora = LoRARequest(adapter.name, adapter.lora_id, adapter.path)
    outs = engine.llm.generate(prompts, params, lora_request=[lora] * len(prompts), use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


def direct_remote(url: str, prompts: list[str], adapter, g: int, temp: float, max_tokens: int) -> int:  # noqa: ANN001
    with httpx.Client(base_url=url, timeout=300) as http, ThreadPoolExecutor(32) as pool:

        def one(p: str) -> int:
            body = {"model": adapter.name, "prompt": p, "n": g, "temperature": temp, "max_tokens": max_tokens}
            resp = http.post("/v1/completions", json={**body, "logprobs": 0, "return_tokens_as_token_ids": True})
            resp.raise_for_status()
            return sum(len(c["logprobs"]["tokens"]) for c in resp.json()["choices"])

        return sum(pool.map(one, prompts))


def service_round(worker, r, job_id: str, prompts: list[str], rnd: int) -> tuple[int, float]:  # noqa: ANN001
    produced0 = int(r.hget(keys.ledger(job_id), "produced") or 0)
    for i, p in enumerate(prompts):
        msg = PromptMsg(job_id=job_id, group_id=f"r{rnd}-g{i}", item_id=str(i), prompt=p)
        r.xadd(keys.prompts(job_id), {FIELD: encode(msg)})
    tokens0 = worker.generator.m_tokens._value.get()
    t0 = time.perf_counter()
    while int(r.hget(keys.ledger(job_id), "produced") or 0) - produced0 < len(prompts):
        worker.tick()
    return int(worker.generator.m_tokens._value.get() - tokens0), time.perf_counter() - t0


def run_mode(mode: str, args: argparse.Namespace, version: tuple, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    prompts = [it.prompt for it in get_task("arith").heldout_items(args.prompts)]
    with bench_stack(workdir) as (r, redis_url, store), started_engine(mode, args.model, workdir) as (engine, url):
        worker = make_worker(engine, args.model, redis_url, store, workdir, prompts_per_batch=args.batch)
        job = add_job(
            r,
            args.model,
            name="tput",
            group_size=args.g,
            eval_size=0,
            sampling={"temperature": args.temperature, "max_tokens": args.max_tokens},
            # the direct side sends the task's text as is: the service must too (a chat model's
            # default would render its template, a longer prompt than the direct side's)
            prompt_format="raw",
        )
        publish(store, r, job.id, 1, *version)
        worker.refresh_jobs()
        adapter = worker.jobs[job.id].current.adapter
        assert adapter is not None, "the version was not adopted"

        def direct() -> int:
            if mode == "inprocess":
                return direct_inprocess(engine, prompts, adapter, args.g, args.temperature, args.max_tokens)
            return direct_remote(url, prompts, adapter, args.g, args.temperature, args.max_tokens)

        direct()  # warm-up both paths once
        service_round(worker, r, job.id, prompts, -1)
        d_tps, s_tps = [], []
        for rnd in range(args.rounds):
            t0 = time.perf_counter()
            tokens = direct()
            d_tps.append(tokens / (time.perf_counter() - t0))
            tokens, secs = service_round(worker, r, job.id, prompts, rnd)
            s_tps.append(tokens / secs)
        worker.close()
    d, s = statistics.median(d_tps), statistics.median(s_tps)
    return {
        "model": model_label(args.model),
        "mode": mode,
        "prompts": args.prompts,
        "g": args.g,
        "batch": args.batch,
        "direct_tok_s": round(d, 1),
        "service_tok_s": round(s, 1),
        "ratio": round(s / d, 3),
        "direct_rounds": [round(x, 1) for x in d_tps],
        "service_rounds": [round(x, 1) for x in s_tps],
    }


def model_label(model: str) -> str:
    """ "" for the tiny model the page was first made for (its figures keep their names), else the folder's name."""
    return "" if Path(model).resolve() == Path(MODEL).resolve() else Path(model).name


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: the service's tokens/s over the engine's, per mode."""
    out = []
    for r in res["runs"]:
        direct = f"direct {r['direct_tok_s']} tok/s"
        on = f", {r['model']}" if r.get("model") else ""
        title = f"rollout service / direct engine tok/s, {r['mode']}{on}"
        out.append(figure(title, f"{r['service_tok_s']} tok/s", direct, r["ratio"], ">= 0.9"))
    return out


def report(res: dict[str, Any], cmd: str) -> str:
    rows = [(r["mode"], r["direct_tok_s"], r["service_tok_s"], f"**{r['ratio']:.2f}**") for r in res["runs"]]
    columns = ["engine mode", "direct tok/s", "service tok/s", "service / direct"]
    on = f" ({res['runs'][0]['model']})" if res["runs"] and res["runs"][0].get("model") else ""
    lines = [f"## Rollout service vs the engine called directly{on}", "", f"`{cmd}`", "", *table(columns, rows)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="inprocess,remote")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--g", type=int, default=8, help="Completions per prompt.")
    ap.add_argument("--batch", type=int, default=64, help="The service's prompts_per_batch.")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", type=Path, help="The page (and its .json beside it); default: stdout only.")
    args = ap.parse_args()
    cmd = shown_command(__file__)
    version = lora_versions(args.model, [1])[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="burstrl-bench-tput-") as tmp:
        for mode in args.modes.split(","):
            res = run_mode(mode, args, version, Path(tmp) / mode)
            results.append(res)
            print(json.dumps(res), flush=True)
    data = {"runs": results}
    emit(report(data, cmd), args.out, data, figures=figures(data), command=cmd)


if __name__ == "__main__":
    main()
