"""`python -m services.trainer`: claims a running job and trains it (one job at a time)."""

from __future__ import annotations

import logging

from services.trainer.settings import TrainerSettings
from shared import keys
from shared.service import ServiceRuntime, setup_logging
from shared.store import open_store

log = logging.getLogger("burstrl.trainer")


def main() -> None:
    setup_logging("trainer")
    settings = TrainerSettings()
    rt = ServiceRuntime("trainer", settings)
    rt.start()
    import torch

    from services.trainer.loop import JobTrainer, claim_job

    if settings.threads:
        torch.set_num_threads(settings.threads)
    rt.preflight()
    store = open_store(settings.store_url)
    rt.health.set("store", True)

    def tick() -> None:
        rec = claim_job(rt, settings)
        if rec is None:
            rt.health.set("job", True, "idle: no running job to claim")
            rt.stop.wait(1.0)
            return
        rt.health.set("job", True, f"training {rec.id}")
        try:
            JobTrainer(rt, settings, store, rec).run()
        finally:
            rt.redis.delete(keys.trainer_lease(rec.id))

    while not rt.stop.is_set():
        rt.survive(tick)
    rt.shutdown()


if __name__ == "__main__":
    main()
