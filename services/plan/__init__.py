"""Resource planner: will GRPO on model M fit on these cards, with what settings, how fast, and
what does the rented card cost per trained step?

catalog (cards, prices) + model_shape (config.json) -> memory (pure math per role) -> roles
(each role's settings and time on a card group) -> placement (which cards run what) ->
pricing + bursts (rented hours and dollars per 1000 steps per way of running) -> report
(rich table / JSON / env lines); vocabulary spells settings as the services do; cli wires them.
Light by design: no torch or vllm imports, so every service and laptop can run it.
"""

from services.plan.bursts import BurstCycle, predict_bursts
from services.plan.catalog import Card, Catalog
from services.plan.memory import Method, TrainerKnobs, Workload, trainer_memory
from services.plan.model_shape import ModelShape, resolve_shape
from services.plan.placement import LayoutOptions, Plan, plan
from services.plan.pricing import BurstPattern, ModeCost

__all__ = [
    "BurstCycle",
    "BurstPattern",
    "Card",
    "Catalog",
    "Method",
    "LayoutOptions",
    "ModeCost",
    "ModelShape",
    "Plan",
    "TrainerKnobs",
    "Workload",
    "plan",
    "predict_bursts",
    "resolve_shape",
    "trainer_memory",
]
