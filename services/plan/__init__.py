"""Resource planner: will GRPO on model M fit on these cards, with what settings, how fast?

catalog (cards) + model_shape (config.json) -> memory (pure math per role) -> placement
(which cards run trainer/rollout/ref) -> report (rich table / JSON); cli wires them together.
Light by design: no torch or vllm imports, so every service and laptop can run it.
"""

from services.plan.catalog import Card, Catalog
from services.plan.memory import Method, TrainerSettings, Workload, trainer_memory
from services.plan.model_shape import ModelShape, resolve_shape
from services.plan.placement import Plan, plan

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
