"""Resource planner: will GRPO on model M fit on these cards, with what settings, how fast?

catalog (cards) + model_shape (config.json) -> memory (pure math per role) -> placement
(which cards run trainer/rollout/ref) -> report (rich table / JSON); cli wires them together.
Light by design: no torch or vllm imports, so every service and laptop can run it.
"""

from shared.plan.catalog import Card, Catalog
from shared.plan.memory import Method, TrainerSettings, Workload, trainer_memory
from shared.plan.model_shape import ModelShape, resolve_shape
from shared.plan.placement import Plan, plan

__all__ = [
    "Card",
    "Catalog",
    "Method",
    "ModelShape",
    "Plan",
    "TrainerSettings",
    "Workload",
    "plan",
    "resolve_shape",
    "trainer_memory",
]
