"""A pipeline stage as a real process, for the bus chaos tests (run as a script).

Modes, each a loop over the real `shared.bus.Bus` against a real redis-server:
- `feed`: the feeder's contract — group ids come from the `fed` counter in the same
  server-side step as the XADD, so a Redis crash that loses a feed re-feeds the same
  id; keeps in flight under a window; trims acknowledged entries as it goes;
- `stage`: reads one stage stream, optionally holds entries for HOLD_S seconds between
  read and hand-on (the window in which the test kills it), forwards downstream;
- `sink`: the trainer's contract — makes each batch durable (fsync'd ids in a file,
  standing in for the checkpoint) before acknowledging it; a redelivered group that
  the file already holds is acknowledged and counted, never trained again.

Every Redis error is survived with a back-off, as the services do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis  # noqa: E402

from shared import keys  # noqa: E402
from shared.bus import FIELD, Bus, trim_job  # noqa: E402
from shared.metrics import read_ledger  # noqa: E402
from shared.redis_conn import connect  # noqa: E402

FEED_LUA = """
local n = redis.call('HINCRBY', KEYS[2], 'fed', 1)
redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2] .. (n - 1))
return n
"""

STAGES = {  # group -> (source stream, destination stream, counter)
    keys.GROUP_ROLLOUT: (keys.prompts, keys.rollouts, "produced"),
    keys.GROUP_REWARD: (keys.rollouts, keys.scored, "scored"),
    keys.GROUP_REF: (keys.scored, keys.ready, "refd"),
}


def feed(r: redis.Redis, job: str, total: int, window: int) -> None:
    Bus.ensure_groups(r, job)
    script = r.register_script(FEED_LUA)
    while True:
        led = read_ledger(r, job)
        if led.get("fed", 0) >= total and led["in_flight"] == 0:
            trim_job(r, job)
            return
        for _ in range(min(window - led["in_flight"], total - led.get("fed", 0))):
            script(keys=[keys.prompts(job), keys.ledger(job)], args=[FIELD, f"{job}:g"])
        trim_job(r, job)
        time.sleep(0.02)


def stage(r: redis.Redis, job: str, group: str, consumer: str, hold_s: float, marker: Path | None) -> None:
    src, dst, counter = STAGES[group]
    bus = Bus(r, group, consumer, claim_idle_ms=400)
    while True:
        entries = bus.read([src(job)], count=4, block_ms=200)
        if entries and marker is not None:
            marker.write_text(json.dumps([e.data.decode() for e in entries]))
        time.sleep(hold_s if entries else 0)
        for e in entries:
            bus.forward([e], [(dst(job), e.data)], {job: {counter: 1}})


def sink(r: redis.Redis, job: str, consumer: str, ckpt: Path, batch: int) -> None:
    bus = Bus(r, keys.GROUP_TRAINER, consumer, claim_idle_ms=400)
    trained = set(ckpt.read_text().split()) if ckpt.exists() else set()
    while True:
        entries = bus.read([keys.ready(job)], count=batch, block_ms=200)
        new = [e for e in entries if e.data.decode() not in trained]
        if new:
            with ckpt.open("a") as f:  # the "checkpoint": durable before the ack
                f.write("".join(e.data.decode() + "\n" for e in new))
                f.flush()
                os.fsync(f.fileno())
            trained.update(e.data.decode() for e in new)
        if entries:
            bus.ack(entries, {job: {"trained": len(entries)}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["feed", "stage", "sink"])
    ap.add_argument("--redis", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--group", default=keys.GROUP_ROLLOUT)
    ap.add_argument("--consumer", default="c1")
    ap.add_argument("--hold-s", type=float, default=0.0)
    ap.add_argument("--marker", type=Path)
    ap.add_argument("--ckpt", type=Path)
    ap.add_argument("--total", type=int, default=50)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    r = connect(a.redis)
    down_since: float | None = None
    while True:
        try:
            if a.mode == "feed":
                feed(r, a.job, a.total, a.window)
                return
            if a.mode == "stage":
                stage(r, a.job, a.group, a.consumer, a.hold_s, a.marker)
            else:
                sink(r, a.job, a.consumer, a.ckpt, a.batch)
        except redis.ConnectionError as e:  # Redis down or restarting: back off, go on
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since > 120:  # the test is gone; don't linger forever
                sys.exit(f"redis unreachable for 2 minutes: {e}")
            print(f"redis unreachable, retrying: {e}", file=sys.stderr, flush=True)
            time.sleep(0.3)
        except redis.RedisError as e:  # e.g. NOGROUP before the feeder made the groups
            down_since = None
            print(f"redis error, retrying: {e}", file=sys.stderr, flush=True)
            time.sleep(0.3)


if __name__ == "__main__":
    main()
