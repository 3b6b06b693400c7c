"""`python -m services.api`: the control plane (job API + prompt feeder)."""

from __future__ import annotations

from services.api.app import build_routes
from services.api.feeder import Feeder
from services.api.settings import ApiSettings
from shared.service import ServiceRuntime, setup_logging


def main() -> None:
    setup_logging("api")
    settings = ApiSettings()
    rt = ServiceRuntime("api", settings)
    build_routes(rt)
    rt.start()
    rt.preflight()
    feeder = Feeder(rt.redis)

    def tick() -> None:
        rt.health.set("feeder", True)
        feeder.tick()
        feeder.wait(settings.feed_interval_s)  # wakes early when a job records progress

    while not rt.stop.is_set():
        rt.survive(tick)
    rt.shutdown()


if __name__ == "__main__":
    main()
