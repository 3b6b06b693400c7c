"""The trainer's optimizer, by the `optimizer` setting, and the check that a checkpoint's state fits it.

adamw: torch's AdamW. adamw8bit: bitsandbytes' AdamW8bit (services/trainer/quant.py says why
that library): the same update with both moments stored 8-bit blockwise. Tensors under
bitsandbytes' `min_8bit_size` (4096 elements: biases, norms, small LoRA factors) keep fp32
states, as in the 8-bit optimizers paper; the planner counts them the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from services.trainer.quant import bitsandbytes, env_name

# The key bitsandbytes' state_dict nests its quantization tensors under (services/trainer/checkpoint.py
# flattens it to state.{i}.__bnb_optimizer_quant_state__.{name}).
BNB_STATE = "__bnb_optimizer_quant_state__"


def build_optimizer(params: Iterable[torch.nn.Parameter], kind: str, *, lr: float) -> torch.optim.Optimizer:
    params = list(params)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if kind == "adamw8bit":
        bnb = bitsandbytes("optimizer", kind, "adamw")
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=0.0)
    raise ValueError(f"optimizer={kind!r}: expected adamw or adamw8bit")


def state_kind(tensors: dict[str, torch.Tensor]) -> str | None:
    """Which optimizer wrote a checkpoint's state tensors (None: no state yet)."""
    names = {k.split(".", 2)[2] for k in tensors if k.startswith(("state.", "pystate.")) and k.count(".") >= 2}
    if any(n.startswith(BNB_STATE) for n in names):
        return "adamw8bit"
    if any(n.startswith("exp_avg") for n in names):
        return "adamw"
    return None


def check_resume(kind: str, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse to load one optimizer's state into the other: torch would take bitsandbytes'
    keys (and vice versa) without complaint and then fail, or worse, step from zeroed moments."""
    found = state_kind(tensors)
    if found is not None and found != kind:
        raise ValueError(
            f"optimizer={kind}, but the checkpoint's optimizer state was written by {found}: set "
            f"{env_name('optimizer')}={found} to resume this job (the optimizer cannot change mid-run)."
        )
