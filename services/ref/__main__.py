"""`python -m services.ref`: attaches reference (or teacher) log-probs to scored groups.

Only jobs with a KL term or a teacher route their groups here (`JobSpec.uses_ref`); a
replica handles the jobs whose reference model is the one it serves.
"""

from __future__ import annotations

import logging
import time

from services.ref.settings import RefSettings
from shared.service import ServiceRuntime, setup_logging

__all__ = ["RefSettings", "main"]  # RefSettings is imported from here by deploy checks

log = logging.getLogger("burstrl.ref")


def main() -> None:
    setup_logging("ref")
    settings = RefSettings()
    rt = ServiceRuntime("ref", settings)
    rt.start()
    rt.health.set("model", False, f"loading {settings.model} ({settings.engine} engine)")
    rt.preflight()

    from services.ref.engine import ScorerUnavailable, build_scorer
    from services.ref.worker import RefWorker

    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)

    scorer = None
    while scorer is None and not rt.stop.is_set():
        try:
            scorer = build_scorer(settings)
        except ScorerUnavailable as e:  # stay up and say why in /readyz; a remote server may come later
            rt.health.set("model", False, str(e))
            rt.stop.wait(settings.engine_retry_s)
    if scorer is None:
        rt.shutdown()
        return
    rt.health.set("model", True, f"{settings.model} ({scorer.mode}, {scorer.dtype}, context {scorer.max_len})")
    worker = RefWorker(rt, settings, scorer)
    last_check = 0.0

    def tick() -> None:
        nonlocal last_check
        if time.monotonic() - last_check > 10:  # a remote server may go away between batches
            last_check = time.monotonic()
            try:
                scorer.check()
                rt.health.set("engine", True)
            except ScorerUnavailable as e:
                rt.health.set("engine", False, str(e))
        worker.tick()

    rt.run(tick, close=scorer.close)


if __name__ == "__main__":
    main()
