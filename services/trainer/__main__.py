"""`python -m services.trainer [--time-budget S] [--deadline T] [--leave-when-idle S]`: claims a
running job and trains it.

One job at a time. A burst session ends at its budget or deadline, or, with --leave-when-idle,
as soon as the backlog is drained and no batch has formed for that long: the rented card is not
billed for waiting on rollout. Under torchrun (WORLD_SIZE > 1) rank 0 is the service (HTTP, heartbeat,
Redis, store) and the other ranks follow it (see distributed.py).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from datetime import datetime

import redis

from services.trainer.settings import TrainerSettings
from shared.service import ServiceRuntime, setup_logging
from shared.store import open_store

log = logging.getLogger("burstrl.trainer")


def _deadline(value: str) -> float:
    """A unix time, or an ISO 8601 date-time (local time when it has no zone)."""
    try:
        return float(value)
    except ValueError:
        return datetime.fromisoformat(value).timestamp()


def _seconds(value: str) -> float:
    """A finite, non-negative number of seconds."""
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(s) or s < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: give a finite number of seconds >= 0")
    return s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.trainer", description=__doc__)
    p.add_argument("--time-budget", type=_seconds, default=None, help="Session length in seconds from now.")
    p.add_argument("--deadline", type=_deadline, default=None, help="Session end: unix time or ISO 8601.")
    p.add_argument(
        "--leave-when-idle",
        type=_seconds,
        default=None,
        metavar="S",
        help="Exit, checkpointed, once no batch has formed for S seconds and no backlog segment is left.",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    started = time.time()  # the budget counts model loading and resuming too
    args = parse_args(argv)
    setup_logging("trainer")
    settings = TrainerSettings()
    if args.time_budget is not None:
        settings.time_budget_s = args.time_budget
    if args.deadline is not None:
        settings.deadline = args.deadline
    if args.leave_when_idle is not None:
        settings.leave_when_idle_s = args.leave_when_idle

    import torch

    from services.trainer.claim import claim_job
    from services.trainer.distributed import CMD_EXIT, CMD_STEP, Comm
    from services.trainer.loop import JobTrainer
    from services.trainer.progress import note_failure
    from services.trainer.quant import SaverUnavailable, check_savers, skip_unused_bitsandbytes
    from services.trainer.sharding import ShardingError, check_sharding, resolve_device
    from shared.lease import LeaseKeeper, LeaseLost

    # Before peft and transformers: 1 s of every start, or one irrelevant notice (quant.py).
    skip_unused_bitsandbytes(settings)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    comm = Comm.from_env()
    device = resolve_device(settings.device)
    try:  # before claiming anything: a setting this machine cannot run is the operator's to fix
        check_sharding(sharding=settings.sharding, cpu_offload=settings.cpu_offload, world=comm.world, device=device)
        check_savers(settings, device)  # refuse, never fall back to 16 bit
    except (ShardingError, SaverUnavailable) as e:
        log.error("%s", e)
        raise SystemExit(f"trainer: {e}") from None
    store = open_store(settings.store_url)
    if not comm.is_main:
        _follower(settings, store, comm)
        return

    rt = ServiceRuntime("trainer", settings)
    rt.start()
    rt.preflight()
    rt.health.set("store", True)
    if settings.time_budget_s or settings.deadline:
        log.info(
            "session budget: %.0fs",
            min(d for d in (settings.deadline, started + settings.time_budget_s) if d) - started,
        )

    def tick() -> None:
        claimed = claim_job(rt, settings, store)
        if claimed is None:
            rt.health.set("job", True, "idle: no running job to claim")
            rt.stop.wait(1.0)
            return
        rec, lease = claimed
        rt.health.set("job", True, f"training {rec.id}")
        if comm.world > 1:
            comm.broadcast_int(CMD_STEP)
            comm.broadcast_bytes([rec.model_dump_json().encode()])
        try:
            with LeaseKeeper(lease) as keeper:
                try:
                    trainer = JobTrainer(
                        rt, settings, store, rec, lease=lease, keeper=keeper, comm=comm, session_start=started
                    )
                    trainer.run()
                except (LeaseLost, redis.ConnectionError):
                    raise  # not the job's fault
                except Exception as e:
                    # A job the trainer cannot load or train would crash-loop it and starve every
                    # other job: after max_attempts in a row it is failed with the error.
                    if note_failure(rt.redis, rec.id, e, max_attempts=settings.max_attempts):
                        log.error("job %s failed after %d attempts: %s", rec.id, settings.max_attempts, e)
                    raise
        finally:
            lease.release()  # compare-and-delete: never the lease another trainer took

    try:
        while not rt.stop.is_set():
            if comm.world > 1:
                tick()  # no survive-and-retry: the followers would hang in a collective
            else:
                rt.survive(tick)
    finally:
        if comm.world > 1:
            comm.broadcast_int(CMD_EXIT)
        rt.shutdown()


def _follower(settings: TrainerSettings, store, comm) -> None:  # noqa: ANN001
    """Ranks > 0: build the same JobTrainer for each job rank 0 announces and follow its steps."""
    import signal
    import threading
    from types import SimpleNamespace

    from services.trainer.distributed import CMD_STEP
    from services.trainer.loop import JobTrainer
    from shared.job import JobRecord
    from shared.redis_conn import connect
    from shared.service import Health

    # torchrun forwards SIGTERM to every rank; a follower must outlive it so that rank 0's
    # exit checkpoint and its final STOP broadcast can complete.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rt = SimpleNamespace(redis=connect(settings.redis_url), stop=threading.Event(), gauges={}, health=Health())
    while comm.broadcast_int(0) == CMD_STEP:
        rec = JobRecord.model_validate_json(comm.broadcast_bytes(None)[0])
        JobTrainer(rt, settings, store, rec, comm=comm).run()  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
