"""`python -m services.api`: the control plane (job API + prompt feeder)."""

from __future__ import annotations

import time

from services.api.app import build_routes
from services.api.feeder import Feeder
from services.api.recovery import orphaned_jobs
from services.api.settings import ApiSettings
from shared.job import ensure_indexes
from shared.service import ServiceRuntime, setup_logging
from shared.store import open_store

ORPHAN_CHECK_S = 30.0  # how often the api looks for jobs the store has and Redis lost


def main() -> None:
    setup_logging("api")
    settings = ApiSettings()
    rt = ServiceRuntime("api", settings)
    store = open_store(settings.store_url)
    build_routes(rt, store)
    rt.start()
    rt.preflight()
    ensure_indexes(rt.redis)  # a Redis written before the job table's indexes gets them here
    feeder = Feeder(rt.redis, store)
    checked = [0.0]

    def check_orphans() -> None:
        """Jobs Redis lost (the store still has them) show as a degraded check with the way out."""
        if time.monotonic() - checked[0] < ORPHAN_CHECK_S:
            return
        checked[0] = time.monotonic()
        found = [o.job_id for o in orphaned_jobs(rt.redis, store) if o.recoverable]
        rt.health.set(
            "orphans",
            not found,
            f"Redis does not know jobs {', '.join(found[:10])} that the object store holds: "
            "`burstrl jobs --orphaned`, then `burstrl recover`"
            if found
            else "",
            scope="job",
        )

    def tick() -> None:
        rt.health.set("feeder", True)
        feeder.tick()
        feeder.wait(settings.feed_interval_s)  # wakes early when a job records progress

    rt.run(tick, watch=check_orphans)  # the orphan check runs while the feeder pauses on a lost Redis


if __name__ == "__main__":
    main()
