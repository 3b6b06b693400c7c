"""The trainable policy: a base model with a peft LoRA adapter (or all of its weights), and its files.

LoRA (default): the files are adapter_model.safetensors + adapter_config.json, as vLLM and
peft load them. Full fine-tuning: the files are what `save_pretrained` writes
(model*.safetensors, config.json, ...), so any HF-compatible engine can load a version.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load, save

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def load_policy(  # noqa: ANN201
    base_model: str,
    *,
    rank: int,
    alpha: int,
    device: str,
    seed: int,
    finetune: str = "lora",
    gradient_checkpointing: bool = False,
    base_bits: int = 16,
):
    """`base_bits=4`: the frozen base's linears load as NF4 (services/trainer/quant.py), LoRA only."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.quant import check_base_bits, keep_trainable_layout, nf4_load_kwargs

    check_base_bits(base_bits, finetune)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_model)
    # bf16 on GPUs (the FLOPs we rent), fp32 on CPU (bf16 matmuls are slow and lossy there).
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if base_bits == 4:
        # Quantized as it loads (on `device`): the 16-bit base never exists in full there.
        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype, **nf4_load_kwargs(dtype, device))
        keep_trainable_layout(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype).to(device)
    if gradient_checkpointing:
        # Non-reentrant: works with frozen inputs (LoRA) without enable_input_require_grads.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if finetune == "full":
        return model, tok
    if finetune != "lora":
        raise ValueError(f"unknown finetune mode {finetune!r}")
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg), tok


def is_lora(model) -> bool:  # noqa: ANN001
    return hasattr(model, "peft_config")


def adapter_files(model, base_model: str, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, bytes]:  # noqa: ANN001
    """The adapter as vLLM/peft load it: safetensors weights + adapter_config.json.
    `state_dict`: the model's tensors when they are not its own (a sharded model's gathered ones)."""
    from peft import get_peft_model_state_dict

    sd = get_peft_model_state_dict(model, state_dict=state_dict)
    sd = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}
    cfg = model.peft_config["default"].to_dict()
    cfg["base_model_name_or_path"] = base_model
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    return {ADAPTER_WEIGHTS: save(sd), ADAPTER_CONFIG: json.dumps(cfg, indent=1, default=str).encode()}


def full_files(model, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, bytes]:  # noqa: ANN001
    """Every file `save_pretrained` writes (handles tied embeddings and sharding).
    `state_dict`: as in `adapter_files`."""
    with tempfile.TemporaryDirectory(prefix="burstrl-weights-") as d:
        model.save_pretrained(d, safe_serialization=True, state_dict=state_dict)
        return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}


def policy_files(model, base_model: str) -> dict[str, bytes]:  # noqa: ANN001
    """The files of a policy version / checkpoint: the adapter under LoRA, else all weights."""
    return adapter_files(model, base_model) if is_lora(model) else full_files(model)


def load_adapter_weights(model, data: bytes) -> None:  # noqa: ANN001
    from peft import set_peft_model_state_dict

    device = next(model.parameters()).device
    sd = {k: v.to(device) for k, v in load(data).items()}
    result = set_peft_model_state_dict(model, sd)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter keys do not fit the model: {result.unexpected_keys[:3]}")


def load_full_weights(model, files: dict[str, bytes]) -> None:  # noqa: ANN001
    sd: dict[str, torch.Tensor] = {}
    for name, data in files.items():
        if name.endswith(".safetensors"):
            sd.update(load(data))
    if not sd:
        raise ValueError("no *.safetensors weights in the checkpoint")
    param = next(model.parameters())
    sd = {k: v.to(param.device, param.dtype) for k, v in sd.items()}
    result = model.load_state_dict(sd, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied]
    if result.unexpected_keys or missing:
        raise ValueError(
            f"weights do not fit the model: unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def load_policy_files(model, files: dict[str, bytes]) -> None:  # noqa: ANN001
    """Inverse of `policy_files`: put a checkpoint's weights into the model in place."""
    if is_lora(model):
        load_adapter_weights(model, files[ADAPTER_WEIGHTS])
    else:
        load_full_weights(model, files)
