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
import threading
import time
from datetime import datetime

import redis

from services.trainer.settings import TrainerSettings
from shared.service import ServiceRuntime, setup_logging
from shared.store import ObjectStore, open_store

log = logging.getLogger("burstrl.trainer")
STORE_CHECK_S = 5.0
STORE_PROBE_KEY = "burstrl-readiness-probe"  # read, never written: its absence is an answer too


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
    store_ok = StoreCheck(rt, store)
    threading.Thread(target=store_ok.run, name="store-check", daemon=True).start()
    if settings.time_budget_s or settings.deadline:
        log.info(
            "session budget: %.0fs",
            min(d for d in (settings.deadline, started + settings.time_budget_s) if d) - started,
        )

    def tick() -> None:
        try:
            claimed = claim_job(rt, settings, store)
        except Exception as e:
            # Taking a job writes its takeover record to the store first: an outage fails here.
            store_ok.probe()
            rt.health.set("job", False, f"holds no lease: taking a job failed ({type(e).__name__}: {e}); retrying")
            raise
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
                    # other job: after max_attempts in a row it is failed with the error. An
                    # unreachable store is not the job's fault.
                    if store_ok.probe() and note_failure(rt.redis, rec.id, e, max_attempts=settings.max_attempts):
                        log.error("job %s failed after %d attempts: %s", rec.id, settings.max_attempts, e)
                    raise
        except Exception as e:
            rt.health.set("job", False, f"holds no lease: job {rec.id} stopped ({type(e).__name__}: {e}); retrying")
            raise
        finally:
            lease.release()  # compare-and-delete: never the lease another trainer took
        if trainer.lease_lost:
            rt.health.set("job", False, f"holds no lease: lost job {rec.id}'s: {trainer.lease_lost}")
        else:
            rt.health.set("job", True, f"idle: left job {rec.id} ({trainer.exit_reason or 'completed'})")

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


class StoreCheck:
    """The `store` check of /readyz: one cheap read every STORE_CHECK_S, from its own thread (an
    S3 outage makes each try wait out boto's retries, which the heartbeat must not), and at once
    when a job attempt fails. Before, it was set `ok` at start and never again: the trainer said
    200 and "store ok" through a whole outage while it failed every second and held no lease."""

    def __init__(self, rt: ServiceRuntime, store: ObjectStore) -> None:
        self.rt, self.store = rt, store

    def probe(self) -> bool:
        try:
            self.store.exists(STORE_PROBE_KEY)
        except Exception as e:  # noqa: BLE001 (whatever the backend raises: the store is not usable)
            self.rt.health.set(
                "store",
                False,
                f"object store {self.store.url} unreachable ({type(e).__name__}: {e}): no checkpoint or "
                "version can be written",
            )
            return False
        self.rt.health.set("store", True)
        return True

    def run(self) -> None:
        while not self.rt.stop.is_set():
            self.probe()
            self.rt.stop.wait(STORE_CHECK_S)


def _follower(settings: TrainerSettings, store, comm) -> None:  # noqa: ANN001
    """Ranks > 0: build the same JobTrainer for each job rank 0 announces and follow its steps."""
    import signal
    import threading
    from types import SimpleNamespace

    from services.trainer.distributed import CMD_STEP
    from services.trainer.loop import JobTrainer
    from shared.dataset import DatasetGuard
    from shared.job import JobRecord
    from shared.redis_conn import connect
    from shared.service import Health

    # torchrun forwards SIGTERM to every rank; a follower must outlive it so that rank 0's
    # exit checkpoint and its final STOP broadcast can complete.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    r = connect(settings.redis_url)
    rt = SimpleNamespace(redis=r, stop=threading.Event(), gauges={}, health=Health(), dataset=DatasetGuard(r))
    while comm.broadcast_int(0) == CMD_STEP:
        rec = JobRecord.model_validate_json(comm.broadcast_bytes(None)[0])
        JobTrainer(rt, settings, store, rec, comm=comm).run()  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
