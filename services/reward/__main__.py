"""`python -m services.reward`: the reward stage."""

from __future__ import annotations

from prometheus_client import Counter

from services.reward.worker import handle
from shared import keys
from shared.bus import Bus
from shared.service import ServiceRuntime, active_job_ids, setup_logging
from shared.settings import CommonSettings


def main() -> None:
    setup_logging("reward")
    settings = CommonSettings()
    rt = ServiceRuntime("reward", settings)
    rt.start()
    rt.preflight()
    scored = Counter("burstrl_reward_groups", "Groups scored", registry=rt.registry)
    bus = Bus(rt.redis, keys.GROUP_REWARD, settings.replica)
    rt.health.set("verifiers", True)

    def tick() -> None:
        streams = [keys.rollouts(j) for j in active_job_ids(rt.redis)]
        entries = bus.read(streams, count=32, block_ms=1000)
        scored.inc(handle(bus, entries))

    while not rt.stop.is_set():
        rt.survive(tick)
    rt.shutdown()


if __name__ == "__main__":
    main()
