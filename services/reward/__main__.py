"""`python -m services.reward`: the reward stage."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from services.reward.scorer import Scorer
from services.reward.settings import RewardSettings
from services.reward.tool_api import add_tool_routes
from services.reward.worker import handle
from shared import keys
from shared.domain.sandbox import check_isolation
from shared.domain.verifiers import TagBudget, verifier_names
from shared.service import ServiceRuntime, active_job_ids, setup_logging


def main() -> None:
    setup_logging("reward")
    settings = RewardSettings()
    rt = ServiceRuntime("reward", settings)
    add_tool_routes(rt, settings)  # POST /v1/sandbox/run: the "python" environment's tool calls
    rt.start()
    rt.preflight()
    scored = Counter("burstrl_reward_groups", "Groups scored", registry=rt.registry)
    tagged = Counter(
        "burstrl_reward_tags",
        "Completions tagged by a verifier: errors, timeouts, sandbox limits (part!reason)",
        ["tag"],
        registry=rt.registry,
    )
    sandbox_ok = Gauge("burstrl_reward_sandbox_available", "1 when code rewards can run isolated", registry=rt.registry)
    scorer = Scorer(settings.workers, settings.plugin_modules, settings.timeout_s)
    ok, why = check_isolation()
    sandbox_ok.set(1 if ok else 0)
    rt.gauges["sandbox"] = why
    if not ok:  # not a readiness failure: non-code jobs still score; code rewards score 0, tagged
        rt.health.set("sandbox-info", True, f"code rewards disabled: {why}")
    rt.health.set("verifiers", True, ", ".join(verifier_names()))
    bus = rt.stage_bus(keys.GROUP_REWARD)

    def count_tags(tags: dict[str, int]) -> None:
        for t, n in tags.items():
            tagged.labels(t).inc(n)

    budget = TagBudget()  # the tags a job may add to the label above and to its metric points

    def tick() -> None:
        streams = [keys.rollouts(j) for j in active_job_ids(rt.redis)]
        entries = bus.read(streams, count=settings.batch, block_ms=1000)
        scored.inc(handle(bus, entries, scorer, count_tags, budget))

    rt.run(tick, close=scorer.close)


if __name__ == "__main__":
    main()
