"""The trainable policy: a base model with a peft LoRA adapter, and its (de)serialisation."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load, save

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def load_policy(base_model: str, *, rank: int, alpha: int, device: str, seed: int):  # noqa: ANN201
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_model)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype).to(device)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    return model, tok


def adapter_files(model, base_model: str) -> dict[str, bytes]:  # noqa: ANN001
    """The adapter as vLLM/peft load it: safetensors weights + adapter_config.json."""
    from peft import get_peft_model_state_dict

    sd = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    cfg = model.peft_config["default"].to_dict()
    cfg["base_model_name_or_path"] = base_model
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    return {ADAPTER_WEIGHTS: save(sd), ADAPTER_CONFIG: json.dumps(cfg, indent=1, default=str).encode()}


def load_adapter_weights(model, data: bytes) -> None:  # noqa: ANN001
    from peft import set_peft_model_state_dict

    device = next(model.parameters()).device
    sd = {k: v.to(device) for k, v in load(data).items()}
    result = set_peft_model_state_dict(model, sd)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter keys do not fit the model: {result.unexpected_keys[:3]}")
