"""`python -m services.trainer.tinker`: the trainer's Tinker worker (docs/tinker.md).

Holds every running Tinker model (or BURSTRL_TRAINER_JOB only) under its job's lease and
applies its queued training calls; on SIGTERM it checkpoints what it can and hands the leases
back, and the next worker replays the rest.
"""

from __future__ import annotations

from services.trainer.settings import TrainerSettings
from shared.service import ServiceRuntime, setup_logging
from shared.store import open_store


def main() -> None:
    setup_logging("trainer")
    settings = TrainerSettings()

    import torch

    from services.trainer.quant import skip_unused_bitsandbytes
    from services.trainer.sharding import resolve_device
    from services.trainer.tinker.worker import TinkerWorker

    skip_unused_bitsandbytes(settings)  # before peft and transformers (services/trainer/quant.py)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    store = open_store(settings.store_url)
    rt = ServiceRuntime("trainer", settings)
    rt.start()
    rt.preflight()
    rt.health.set("store", True)
    worker = TinkerWorker(rt, settings, store, resolve_device(settings.device))
    rt.run(worker.tick, close=worker.close)


if __name__ == "__main__":
    main()
