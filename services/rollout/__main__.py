"""`python -m services.rollout`: the rollout stage (in-process vLLM, or a remote vLLM server's client)."""

from __future__ import annotations

import logging

from services.rollout.engine import Engine
from services.rollout.errors import EngineUnavailable
from services.rollout.settings import RolloutSettings
from shared.service import ServiceRuntime, setup_logging
from shared.store import open_store

log = logging.getLogger("services.rollout")
LEAVE_WAIT_S = 60.0  # for the spill pass in progress (its segment writes) at shutdown


def build_engine(s: RolloutSettings) -> Engine:
    """The configured engine; raises EngineUnavailable when it cannot be built or reached."""
    if s.engine == "remote":
        from services.rollout.engine import RemoteEngine

        if not s.engine_url:
            raise EngineUnavailable("BURSTRL_ROLLOUT_ENGINE=remote needs BURSTRL_ROLLOUT_ENGINE_URL")
        local, sep, remote = s.engine_path_map.partition("=")
        return RemoteEngine(
            url=s.engine_url,
            api_key=s.engine_api_key.get_secret_value(),
            served_model=s.engine_served_model,
            timeout_s=s.engine_timeout_s,
            concurrency=s.engine_concurrency,
            path_map=(local, remote) if sep else None,
        )
    from services.rollout.engine import InProcessEngine

    return InProcessEngine(
        model=s.model,
        max_model_len=s.max_model_len,
        max_lora_rank=s.max_lora_rank,
        max_loras=s.max_loras,
        dtype=s.dtype,
        seed=s.seed,
        **s.engine_kwargs(),
    )


def engine_context(s: RolloutSettings, engine: Engine) -> int:
    """The engine's context length: the setting in-process; a remote server's if it says (vLLM's
    /v1/models lists max_model_len), else 0 (unknown: the api accepts and warns)."""
    if s.engine != "remote":
        return s.max_model_len
    try:
        cards = engine.base_models()  # type: ignore[attr-defined]
        served = [m for m in cards if m.get("id") == getattr(engine, "served_model", None)] or cards
        return max((int(m.get("max_model_len") or 0) for m in served), default=0)
    except Exception:  # noqa: BLE001 - an older server or an odd reply: unknown, not fatal
        return 0


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
