"""`python -m services.rollout`: the rollout stage (in-process vLLM, or a remote vLLM server's client)."""

from __future__ import annotations

import logging

from services.rollout.engine import Engine, build_engine, engine_context
from services.rollout.errors import EngineUnavailable
from services.rollout.settings import RolloutSettings
from shared.service import ServiceRuntime, setup_logging
from shared.store import open_store

log = logging.getLogger("services.rollout")
LEAVE_WAIT_S = 60.0  # for the spill pass in progress (its segment writes) at shutdown


def main() -> None:
    setup_logging("rollout")
    settings = RolloutSettings()
    if settings.trainer_reserve_gb is not None:
        # A burst-side replica: refuse before anything loads when it cannot fit beside the trainer.
        from services.rollout.fit import DoesNotFit, check_fit, measure

        try:
            log.info("memory: %s", check_fit(settings, measure()))
        except DoesNotFit as e:
            log.critical("%s", e)
            raise SystemExit(2) from e
    rt = ServiceRuntime("rollout", settings)
    from services.rollout import agent_routes
    from services.rollout.agents import AgentServer

    # The OpenAI-compatible agent endpoint (docs/agents.md): routed from the start, 503 until
    # the engine and the worker are up.
    served: dict[str, AgentServer] = {}
    agent_routes.install(rt, lambda: served.get("agents"))
    rt.start()
    # An unknown model path or an unreachable remote engine keeps the service up and
    # not-ready with the reason, retrying; no prompt is read meanwhile, so none is lost.
    engine: Engine | None = None
    while engine is None and not rt.stop.is_set():
        what = settings.engine_url if settings.engine == "remote" else settings.model
        rt.health.set("engine", False, f"starting {settings.engine} engine ({what})")
        try:
            engine = build_engine(settings)
        except EngineUnavailable as e:
            rt.health.set("engine", False, str(e))
            rt.stop.wait(settings.engine_retry_s)
    if engine is None:
        rt.shutdown()
        return
    rt.health.set("engine", True)
    # Advertised so the api can refuse a job whose completions cannot fit the context.
    rt.gauges["rollout_model"] = settings.model
    rt.gauges["max_model_len"] = engine_context(settings, engine)
    rt.preflight()
    from services.rollout.spill import Spiller
    from services.rollout.worker import RolloutWorker

    store = open_store(settings.store_url)
    worker = RolloutWorker(rt, settings, engine, store)
    served["agents"] = worker.agents
    # Beside the engine loop: moves the ready groups of backlog jobs beyond their hot window to the store.
    spiller = Spiller(rt, store, replica=settings.replica, model=settings.model, claim_idle_s=settings.claim_idle_s)
    spilling = spiller.start()
    try:
        while not rt.stop.is_set():
            rt.survive(worker.tick)
    finally:
        # SIGTERM (a burst ending, a scale-down): the round in progress is settled by now; leave
        # the consumer groups before the heartbeat goes, so what this replica still holds is
        # handed to a live peer at once (docs/architecture.md, "Backlog and bursts").
        rt.stop.set()
        for leave in (worker.leave, lambda: spiller.leave(spilling, LEAVE_WAIT_S)):
            try:
                leave()
            except Exception:  # noqa: BLE001 - e.g. Redis gone: entries stay pending, taken once the heartbeat expires
                log.exception("could not leave the consumer groups cleanly")
        worker.close()
        engine.close()
        rt.shutdown()


if __name__ == "__main__":
    main()
