"""`python -m services.ref`: attaches reference log-probs to scored groups (KL jobs only)."""

from __future__ import annotations

import logging

import msgspec
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared import keys
from shared.bus import Bus, Entry
from shared.job import load_job, same_model
from shared.schema import GroupMsg, decode, encode, pack_f32, unpack_i32
from shared.service import ServiceRuntime, active_job_ids, setup_logging
from shared.settings import CommonSettings

log = logging.getLogger("burstrl.ref")


class RefSettings(CommonSettings):
    """ref settings: env BURSTRL_REF_*."""

    model_config = SettingsConfigDict(env_prefix="BURSTRL_REF_", extra="ignore")
    model: str = Field(..., description="Reference model (the base model when training LoRA).")
    device: str = Field("cpu", description="cpu or cuda.")


def main() -> None:
    setup_logging("ref")
    settings = RefSettings()
    rt = ServiceRuntime("ref", settings)
    rt.start()
    rt.health.set("model", False, f"loading {settings.model}")
    from services.ref.engine import HFScorer

    scorer = HFScorer(settings.model, settings.device)
    rt.health.set("model", True)
    rt.preflight()
    bus = Bus(rt.redis, keys.GROUP_REF, settings.replica)

    def handle(e: Entry) -> None:
        rec = load_job(rt.redis, e.job_id)
        if rec is None or not same_model(rec.spec.base_model, settings.model):
            bus.dead_letter(e, "job unknown or its base model is not this ref's model")
            return
        try:
            g = decode(e.data, GroupMsg)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as err:
            bus.dead_letter(e, f"undecodable group: {err}")
            return
        try:
            lps = scorer.score(
                unpack_i32(g.prompt_ids).tolist(), [unpack_i32(c.token_ids).tolist() for c in g.completions]
            )
        except ValueError as err:  # too long for the reference: rejected per group, not a crash
            bus.dead_letter(e, str(err))
            return
        for c, lp in zip(g.completions, lps, strict=True):
            c.ref_logprobs = pack_f32(lp)
        g.stage = "ready"
        bus.forward([e], [(keys.ready(e.job_id), encode(g))], {e.job_id: {"refd": 1}})

    def tick() -> None:
        streams = [keys.scored(j) for j in active_job_ids(rt.redis)]
        for e in bus.read(streams, count=16, block_ms=1000):
            handle(e)

    while not rt.stop.is_set():
        rt.survive(tick)
    rt.shutdown()


if __name__ == "__main__":
    main()
