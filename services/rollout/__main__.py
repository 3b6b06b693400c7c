"""`python -m services.rollout`: the rollout stage (in-process vLLM)."""

from __future__ import annotations

from services.rollout.settings import RolloutSettings
from shared.service import ServiceRuntime, setup_logging
from shared.store import open_store


def main() -> None:
    setup_logging("rollout")
    settings = RolloutSettings()
    rt = ServiceRuntime("rollout", settings)
    rt.start()
    rt.health.set("engine", False, f"loading {settings.model}")
    from services.rollout.engine import InProcessEngine
    from services.rollout.worker import RolloutWorker

    engine = InProcessEngine(
        model=settings.model,
        max_model_len=settings.max_model_len,
        max_lora_rank=settings.max_lora_rank,
        max_loras=settings.max_loras,
        dtype=settings.dtype,
        seed=settings.seed,
    )
    rt.health.set("engine", True)
    rt.preflight()
    worker = RolloutWorker(rt, settings, engine, open_store(settings.store_url))
    while not rt.stop.is_set():
        rt.survive(worker.tick)
    rt.shutdown()


if __name__ == "__main__":
    main()
