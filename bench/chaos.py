"""Chaos: a real GRPO job on the tiny model through the five real services, under faults.

The stack is what `burstrl up` runs (redis-server with AOF, api, rollout with in-process
vLLM, reward, ref, trainer as local processes); the object store is S3 (moto's server)
reached through a TCP proxy this script controls, so the store can be taken away from
every service at once. While the job runs, faults are injected one at a time at random
moments (a random policy version, then a random delay):
- `kill9:<svc>`: SIGKILL of the service's whole process group (vLLM's engine process
  too), then the one restart a supervisor would do (same port, same settings);
- `redis`: SIGKILL of redis-server, restarted on its port from its AOF;
- `store`: the store unreachable (proxy refuses and cuts connections) for a while;
- `corrupt-ckpt`: a checkpoint whose files do not match its manifest, at a step above
  the job's last (so it stays the newest in the store), then a kill -9 of the trainer so
  the restarted trainer must pass over it; also a partial one (files, no manifest);
- `corrupt-adapter`: policy version v+2 written ahead of the trainer with an adapter
  that does not match its manifest (the trainer keeps an existing version, so the
  pointer will move onto it and rollout must refuse it);
- `malformed`: one undecodable entry into each stage stream (prompts, rollouts,
  scored, ready), counted as fed in the same MULTI, as the feeder counts a prompt.
Afterwards it checks: the job completed; `audit()` balances (fed = trained + dropped +
dead + in flight, against the streams); nothing trained twice — the trainer's own
record (every checkpoint's `trained_groups`, all kept for this run) holds each group
once and exactly `steps x batch` of them, matching the ledger's `trained`; no corrupt
checkpoint was loaded (trainer logs) nor corrupt version adopted (rollout's version
events); every service ready at the end with no restart beyond the injected ones.

    .venv/bin/python bench/chaos.py [--steps 30] [--kills 2] [--out bench/results/chaos.md]   # make chaos
    .venv/bin/python bench/chaos.py --steps 12 --kills 1 --no-baseline                 # the test's size

Every fault and every check is listed here, side by side, so the page's claims can be read against
the code that makes them; the page and the headline figures, from the results alone, are
bench/chaos_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.chaos_report import figures, report  # noqa: E402
from shared import keys  # noqa: E402
from shared.ledger import audit  # noqa: E402
from shared.metrics import read_ledger, read_points  # noqa: E402
from shared.policy import read_pointer  # noqa: E402
from shared.redis_conn import connect  # noqa: E402
from tests.support.lab.jobs import DEMO_SHAPE  # noqa: E402
from tests.support.lab.results import emit, shown_command  # noqa: E402
from tests.support.lab.s3 import moto_s3, s3_env  # noqa: E402
from tests.support.lab.stack import MODEL, Stack, run_job, submit  # noqa: E402
from tests.support.proxy import TcpProxy  # noqa: E402

SERVICES = ["api", "rollout", "reward", "ref", "trainer"]
STAGE_STREAMS = {"prompts": keys.prompts, "rollouts": keys.rollouts, "scored": keys.scored, "ready": keys.ready}


# -- the run ------------------------------------------------------------------------------
class Chaos:
    def __init__(self, stack: Stack, proxy: TcpProxy, store: Any, job_id: str, steps: int, rng: random.Random) -> None:
        self.st, self.proxy, self.store, self.job, self.steps, self.rng = stack, proxy, store, job_id, steps, rng
        self.faults: list[dict[str, Any]] = []
        self.restarts: dict[str, int] = dict.fromkeys(stack.names, 0)
        self.corrupt_ckpt_step = steps + 7
        self.corrupt_version: int | None = None
        self.r = connect(stack.redis_url)

    # helpers
    def version(self) -> int:
        try:
            return read_pointer(self.r, self.job)
        except Exception:  # noqa: BLE001 (redis may be the thing that is down)
            return -1

    def ready(self, name: str) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.st.ports[name]}/readyz", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def wait(self, pred: Any, timeout: float, what: str) -> float:
        t0 = time.time()
        while not pred():
            if time.time() - t0 > timeout:
                raise RuntimeError(f"chaos: timed out waiting for {what}\n{self.st.logs()}")
            time.sleep(0.25)
        return time.time() - t0

    def done(self) -> bool:
        try:
            return httpx.get(f"{self.st.api}/v1/jobs/{self.job}", timeout=5).json()["job"]["state"] == "completed"
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def record(self, kind: str, t0: float, v0: int, **extra: Any) -> None:
        """Time cost: until every service is ready again, and until the next policy version."""
        self.wait(lambda: all(self.ready(n) for n in self.st.names), 600, f"recovery after {kind}")
        ready_after = time.time() - t0
        self.wait(lambda: self.version() > v0 or self.done(), 600, f"progress after {kind}")
        f = {
            "fault": kind,
            "at_version": v0,
            "all_ready_after_s": round(ready_after, 1),
            "next_version_after_s": round(time.time() - t0, 1),
            "survived": True,  # recovered within the timeouts above (else wait() raised)
            **extra,
        }
        self.faults.append(f)
        print(f"chaos: {json.dumps(f)}", flush=True)

    # faults
    def kill9(self, name: str) -> None:
        v0, t0 = self.version(), time.time()
        self.st.signal(name, signal.SIGKILL)
        time.sleep(self.rng.uniform(0.5, 2.0))  # the supervisor notices, then restarts it once
        self.st.start(name)
        self.restarts[name] += 1
        self.record(f"kill9:{name}", t0, v0)

    def redis(self) -> None:
        v0, t0 = self.version(), time.time()
        os.kill(self.st.launcher.procs()["redis"].pid, signal.SIGKILL)
        time.sleep(self.rng.uniform(1.0, 3.0))
        self.st.start_redis_again()
        self.r = connect(self.st.redis_url)
        self.record("kill9:redis (AOF restart)", t0, v0)

    def store_outage(self, seconds: float) -> None:
        v0, t0 = self.version(), time.time()
        self.proxy.down()
        time.sleep(seconds)
        self.proxy.up()
        self.record(f"store unavailable {seconds:.0f}s", t0, v0)

    def corrupt_checkpoint(self) -> None:
        from services.trainer.checkpoint import ckpt_prefix
        from shared.folders import MANIFEST, put_folder

        v0, t0 = self.version(), time.time()
        step = self.corrupt_ckpt_step
        fake = {
            "adapter_model.safetensors": os.urandom(4096),
            "optimizer.safetensors": os.urandom(4096),
            "state.json": json.dumps({"step": step, "trained_groups": ["forged"], "extra": {}}).encode(),
        }
        prefix = ckpt_prefix(self.job, step)
        put_folder(self.store, prefix, fake, {"step": step})
        self.store.put(f"{prefix}/adapter_model.safetensors", os.urandom(4096))  # bit rot after the manifest
        partial = ckpt_prefix(self.job, step - 3)  # an upload cut short: files, no manifest
        self.store.put(f"{partial}/adapter_model.safetensors", os.urandom(4096))
        assert not self.store.exists(f"{partial}/{MANIFEST}")
        self.st.signal("trainer", signal.SIGKILL)  # so a restarted trainer meets them in the store
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.st.start("trainer")
        self.restarts["trainer"] += 1
        self.record("corrupt + partial checkpoint, trainer kill9", t0, v0, corrupt_step=step)

    def corrupt_adapter(self) -> None:
        from shared.folders import folder_file
        from shared.policy import Manifest, publish_version, version_prefix

        v0, t0 = self.version(), time.time()
        v = v0 + 2  # ahead of the trainer, which is at most publishing v0 + 1
        if v > self.steps:
            self.faults.append({"fault": "corrupt adapter", "skipped": f"v{v} is past the job's last version"})
            return
        m = Manifest(job_id=self.job, version=v, step=v, base_model=self.st.model, files={})
        files = {"adapter_model.safetensors": os.urandom(8192), "adapter_config.json": b"{}"}
        try:
            publish_version(self.store, m, files)
        except Exception as e:  # noqa: BLE001
            print(f"chaos: could not write the corrupt adapter: {e}", flush=True)
            return
        self.store.put(
            folder_file(self.store, version_prefix(self.job, v), "adapter_model.safetensors"), os.urandom(8192)
        )
        self.corrupt_version = v
        self.record("corrupt adapter (version ahead of the trainer)", t0, v0, corrupt_version=v)

    def malformed(self) -> None:
        v0, t0 = self.version(), time.time()
        for name, stream in STAGE_STREAMS.items():
            pipe = self.r.pipeline(transaction=True)
            pipe.hincrby(keys.ledger(self.job), "fed", 1)  # injected entries count as fed, like any prompt
            pipe.xadd(stream(self.job), {b"m": b"\xc1 not msgpack " + name.encode()})
            pipe.execute()
        self.record("malformed entry into each stage stream (4)", t0, v0)

    def plan(self, kills: int, outage_s: float) -> list[tuple[str, Any]]:
        faults: list[tuple[str, Any]] = [("kill9", s) for s in SERVICES for _ in range(kills)]
        faults += [("redis", None), ("store", outage_s), ("corrupt_checkpoint", None)]
        faults += [("corrupt_adapter", None), ("malformed", None)]
        self.rng.shuffle(faults)
        return faults

    def run(self, kills: int, outage_s: float) -> None:
        faults = self.plan(kills, outage_s)
        # Trigger versions spread evenly over the job (in random order of faults), leaving the
        # last two steps clean: random ones clustered, and the job could finish first.
        span = max(1, self.steps - 2)
        gap = span / len(faults)
        # Where in its slot each fault lands is random (a version offset, not a sleep: a sleep
        # lets a fast job run ahead past the faults still to come).
        triggers = [i * gap + self.rng.uniform(0.0, 0.5 * gap) for i in range(len(faults))]
        for (kind, arg), trig in zip(faults, triggers, strict=True):
            if self.done():
                self.faults.append({"fault": f"{kind} {arg or ''}".strip(), "skipped": "job already complete"})
                continue
            if kind == "corrupt_adapter":  # it needs versions after it: the pointer must move onto it
                trig = min(trig, max(0, self.steps - 4))
            self.wait(lambda t=trig: self.version() >= int(t) or self.done(), 900, f"version {int(trig)}")
            if kind == "kill9":
                self.kill9(arg)
            elif kind == "store":
                self.store_outage(arg)
            else:
                getattr(self, kind)()


def trained_record(store: Any, job_id: str, steps: int) -> dict[str, Any]:
    """The trainer's own record of what it trained: every checkpoint's groups, each step once."""
    from services.trainer.checkpoint import checkpoint_steps, load_checkpoint

    ids: list[str] = []
    missing = []
    for step in range(1, steps + 1):
        if step not in checkpoint_steps(store, job_id):
            missing.append(step)
            continue
        ids += load_checkpoint(store, job_id, step).state.trained_groups
    dupes = sorted({g for g in ids if ids.count(g) > 1})
    return {"groups": len(ids), "unique": len(set(ids)), "duplicates": dupes, "missing_steps": missing}


def _intact(store: Any, job_id: str, version: int) -> bool:
    from shared.folders import get_folder
    from shared.policy import version_prefix

    try:
        get_folder(store, version_prefix(job_id, version))
        return True
    except Exception:  # noqa: BLE001
        return False


def check(stack: Stack, chaos: Chaos, store: Any, job_id: str, spec: dict[str, Any]) -> dict[str, Any]:
    r = connect(stack.redis_url)
    status = httpx.get(f"{stack.api}/v1/jobs/{job_id}", timeout=10).json()
    a = audit(r, job_id)
    rec = trained_record(store, job_id, spec["steps"])
    logs = stack.launcher.logs
    trainer_log = (logs / "trainer.log").read_text(errors="replace")
    resumed = [int(s) for s in re.findall(r"resumed from checkpoint step (\d+)", trainer_log)]
    skipped = [int(s) for s in re.findall(r"checkpoint step (\d+) is corrupt, skipped", trainer_log)]
    vpoints = read_points(r, job_id, "rollout_version")
    adopted = sorted({p["version"] for p in vpoints if p.get("event") == "adopted"})
    refused = sorted({p["version"] for p in vpoints if p.get("event") == "refused"})
    dead = r.xrange(keys.dead_letter(job_id))
    ready = {n: chaos.ready(n) for n in stack.names}
    alive = {n: stack.launcher.procs()[n].pid for n in stack.names}
    expected = spec["steps"] * spec["batch_size"]
    checks = {
        "job completed": status["job"]["state"] == "completed" and status["policy_version"] == spec["steps"],
        "ledger balances (audit)": a.balanced,
        "nothing trained twice (trainer's checkpoints)": not rec["duplicates"] and rec["groups"] == expected,
        "trainer's record == ledger trained": rec["groups"] == a.counters.get("trained", 0),
        "no corrupt checkpoint loaded": chaos.corrupt_ckpt_step not in resumed,
        # The trainer replaces a corrupt version in its way, so v may be adopted — but only
        # as the intact copy (rollout checks every hash; here the store's copy must verify).
        "no corrupt version adopted": chaos.corrupt_version is None
        or chaos.corrupt_version not in adopted
        or _intact(store, job_id, chaos.corrupt_version),
        "malformed entries dead-lettered": len(dead) >= len(STAGE_STREAMS),
        "every service ready at the end": all(ready.values()),
    }
    return {
        "checks": checks,
        "ok": all(checks.values()),
        "ledger": a.counters,
        "audit_problems": a.problems,
        "trained_record": rec,
        "resumed_from": resumed,
        "corrupt_skipped": skipped,
        "adopted_versions": adopted,
        "refused_versions": refused,
        "dead_letters": len(dead),
        "ready": ready,
        "pids": alive,
        "restarts": chaos.restarts,
        "final_eval": status["evals"][-1] if status["evals"] else None,
        "ledger_view": read_ledger(r, job_id),
    }


def run_chaos(
    steps: int, kills: int, outage_s: float, seed: int, baseline: bool, model: str = str(MODEL)
) -> dict[str, Any]:
    rng = random.Random(seed)
    env = {
        # Keep every checkpoint: together their trained_groups are the trainer's full record.
        "BURSTRL_TRAINER_KEEP_CHECKPOINTS": "100000",
        # A restarted trainer has a new replica id: it waits out the old one's lease.
        "BURSTRL_TRAINER_LEASE_S": "10",
    }
    # Batches of 32 (the demo's 8 x 4): each step is long enough that the job does not run
    # ahead of the faults still to come while one fault is handled (a restart, a check).
    spec = {**DEMO_SHAPE, "name": "chaos", "steps": steps, "batch_size": 32, "eval_size": 32}
    out: dict[str, Any] = {"steps": steps, "kills_per_service": kills, "outage_s": outage_s, "seed": seed}
    with moto_s3("chaos") as endpoint:
        # The services reach the store through a proxy this script can cut (the store's outage).
        proxy = TcpProxy(int(endpoint.rsplit(":", 1)[1]))
        proxy.up()
        try:
            with (
                s3_env(f"http://127.0.0.1:{proxy.port}"),
                tempfile.TemporaryDirectory(prefix="burstrl-chaos-") as tmp,
                Stack(Path(tmp), model, env=env, store_url="s3://chaos/run") as stack,
            ):
                from shared.store import open_store

                out["startup_s"] = round(stack.startup_s, 1)
                store = open_store("s3://chaos/run")
                if baseline:
                    clean = run_job(stack, {**spec, "name": "clean"})
                    out["clean_wall_s"] = round(clean["trained_at"] - clean["submitted_at"], 1)
                t0 = time.time()
                job_id = submit(stack, spec)
                chaos = Chaos(stack, proxy, store, job_id, steps, rng)
                chaos.run(kills, outage_s)
                chaos.wait(chaos.done, 900, "job completion")
                out["chaos_wall_s"] = round(time.time() - t0, 1)
                time.sleep(3)  # heartbeats and readiness settle
                out["job_id"] = job_id
                out["faults"] = chaos.faults
                out.update(check(stack, chaos, store, job_id, spec))
        finally:
            proxy.down()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kills", type=int, default=2, help="kill -9 per service")
    ap.add_argument("--outage-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="Skip the fault-free run of the same job.")
    ap.add_argument("--out", type=Path, default=None, help="Markdown report here (and .json beside it).")
    ap.add_argument("--model", default=None, help="Model dir (default: the demo's tiny model, built if missing).")
    a = ap.parse_args()
    cmd = shown_command(__file__)
    res = run_chaos(a.steps, a.kills, a.outage_s, a.seed, not a.no_baseline, **({"model": a.model} if a.model else {}))
    emit(report(res, cmd), a.out, res, figures=figures(res), command=cmd)
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
