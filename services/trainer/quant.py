"""The quantized memory savers, both from bitsandbytes: 8-bit AdamW states and an NF4 frozen base.

`optimizer = adamw8bit` keeps AdamW's two moments as 8-bit blockwise-quantized tensors (one
byte each per weight, plus an fp32 absmax per block of 256) instead of two fp32 ones;
`base_bits = 4` loads a LoRA run's frozen base linears as 4-bit NF4 with double-quantized
absmax (QLoRA), dequantized on the fly in forward and backward.

Why bitsandbytes and not torchao (docs/quantized_savers.md has the measurements): it runs both savers on
this project's torch 2.13 CPU build with no compiler (torchao's AdamW8bit goes through
torch.compile), transformers loads a 4-bit base from `BitsAndBytesConfig` and peft puts LoRA on
its `Linear4bit` layers natively, its optimizer state is plain uint8/fp32 tensors (safetensors
checkpoints, no tensor subclasses), and its one wheel carries the CUDA kernels too.

Every saver that cannot run on the device at hand is a start-up error naming the setting and
what to use instead (`check_savers`), never a silent fallback to the 16-bit path.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from services.trainer.settings import TrainerSettings

# The version pyproject.toml's `ml` extra and `make install` pin (bench/gpu_check.sh brings its wheel).
BNB_REQUIREMENT = "bitsandbytes==0.50.2"


class SaverUnavailable(RuntimeError):
    """A memory-saver setting this trainer cannot honour on its device: refuse to start."""


def env_name(setting: str) -> str:
    return f"BURSTRL_TRAINER_{setting.upper()}"


def bitsandbytes(setting: str, value: object, instead: object) -> ModuleType:
    """The bitsandbytes module, or a SaverUnavailable naming `setting` and its alternative."""
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as e:
        raise SaverUnavailable(
            f"{setting}={value} needs bitsandbytes, which is not importable here ({e}). Install it "
            f"(`pip install '{BNB_REQUIREMENT}'`, part of burstrl[ml] and `make install`), or set "
            f"{env_name(setting)}={instead}."
        ) from e


def probe_nf4(device: str) -> None:
    """Quantize and dequantize a small tensor to NF4 on `device`: bitsandbytes has no 4-bit
    kernels for some devices (or, before 0.46, for CPUs), and finding that out at the first
    forward would cost a model load and a claimed job."""
    bnb = bitsandbytes("base_bits", 4, 16)
    w = torch.linspace(-1.0, 1.0, 64 * 64, device=device).reshape(64, 64)
    try:
        packed, state = bnb.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
        err = float((bnb.functional.dequantize_4bit(packed, state, quant_type="nf4") - w).abs().max())
    except Exception as e:  # the library's own "no kernel for this device" errors vary by backend
        raise SaverUnavailable(
            f"base_bits=4: bitsandbytes {bnb.__version__} cannot quantize to NF4 on device {device!r} ({e}). "
            f"Set {env_name('base_bits')}=16 (a 16-bit frozen base), or run the trainer on a CUDA device."
        ) from e
    if not err < 0.2:  # NF4's largest step on [-1, 1] is about 0.16
        raise SaverUnavailable(f"base_bits=4: NF4 round trip on {device!r} is off by {err:.3f}; set base_bits=16.")


def probe_adamw8bit(device: str) -> None:
    """One 8-bit AdamW step on a tensor big enough to get 8-bit states (4096 elements); Adam's
    first step moves every weight by lr, so the result is checked, not only the absence of errors."""
    bnb = bitsandbytes("optimizer", "adamw8bit", "adamw")
    p = torch.nn.Parameter(torch.ones(4096, device=device))
    p.grad = torch.ones_like(p)
    try:
        opt = bnb.optim.AdamW8bit([p], lr=1e-3, weight_decay=0.0)
        opt.step()
        quantized = opt.state[p]["state1"].dtype == torch.uint8
        moved = abs(float(p.detach().mean()) - (1.0 - 1e-3)) < 1e-5
    except Exception as e:
        raise SaverUnavailable(
            f"optimizer=adamw8bit: bitsandbytes {bnb.__version__} has no 8-bit optimizer kernels for device "
            f"{device!r} ({e}). Set {env_name('optimizer')}=adamw, or run the trainer on a CUDA device."
        ) from e
    if not (quantized and moved):
        raise SaverUnavailable(
            f"optimizer=adamw8bit: bitsandbytes' 8-bit AdamW on {device!r} did not take a correct step "
            f"(8-bit states: {quantized}); set {env_name('optimizer')}=adamw."
        )


def check_savers(settings: TrainerSettings, device: str) -> None:
    """Start-up check of the quantized savers against the device and the other savers (raises
    SaverUnavailable)."""
    fsdp = settings.sharding == "fsdp" or settings.cpu_offload
    if fsdp and settings.base_bits == 4:
        # FSDP2 shards parameters as DTensors; bitsandbytes' packed Params4bit (uint8 plus its
        # quant state) is not one it can split and re-gather. Not tried, so not allowed.
        raise SaverUnavailable(
            "base_bits=4 cannot be combined with sharding=fsdp or cpu_offload=true: FSDP2 cannot shard "
            f"bitsandbytes' packed 4-bit weights. Set {env_name('base_bits')}=16 with FSDP, or keep base_bits=4 "
            "with sharding=ddp and cpu_offload=false."
        )
    if fsdp and settings.optimizer == "adamw8bit":
        # bitsandbytes' kernels step plain tensors; FSDP2 hands the optimizer DTensor shards, and
        # the sharded checkpoint path gathers torch AdamW's state layout only.
        raise SaverUnavailable(
            "optimizer=adamw8bit cannot be combined with sharding=fsdp or cpu_offload=true: bitsandbytes' "
            f"8-bit AdamW steps plain tensors, not FSDP2's sharded ones. Set {env_name('optimizer')}=adamw "
            "with FSDP (its states are sharded over the cards instead), or use sharding=ddp."
        )
    if settings.base_bits == 4:
        probe_nf4(device)
    if settings.optimizer == "adamw8bit":
        probe_adamw8bit(device)


def skip_unused_bitsandbytes(settings: TrainerSettings) -> bool:
    """Keep bitsandbytes out of a trainer that uses neither saver (True if it was kept out).

    peft (peft/helpers.py) and transformers import it whenever it is installed. That import alone
    took 1.0-1.3 s of each trainer start here (it loads torch._inductor for its CPU kernels, and logs
    a "kernels" warning), paid in every burst and every restart (bench/results/trainer_startup.md). A
    None entry in sys.modules makes `import bitsandbytes` raise ImportError, Python's documented
    way to block an import, and both libraries then read bitsandbytes as absent, which it is for
    this process: only optimizer=adamw8bit and base_bits=4 use it. A trainer that keeps it gets
    its one irrelevant start-up notice filtered (`quiet_kernel_hub_notice`). Call before peft or
    transformers is imported; once it is imported (a test process, say) nothing changes."""
    if settings.optimizer == "adamw8bit" or settings.base_bits == 4 or "bitsandbytes" in sys.modules:
        quiet_kernel_hub_notice()
        return False
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    return True


# bitsandbytes' CPU backend (bitsandbytes/backends/cpu/ops.py) logs this at import on every CPU with
# AVX512-BF16 unless the `kernels` package can fetch a compiled kernel from the Hugging Face Hub.
KERNEL_HUB_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _KernelHubNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(KERNEL_HUB_NOTICE)


def quiet_kernel_hub_notice() -> None:
    """Drop bitsandbytes' kernel-hub notice, and only it, from this process's log.

    The hub kernel would only speed up bitsandbytes' no-grad 4-bit CPU inference path, whose
    repacked layout the trainer turns off on every Linear4bit (`keep_trainable_layout`); 8-bit
    AdamW never calls it. Installing `kernels` would mean running code fetched from the Hub at
    start-up, which no service here does. So the warning says nothing about this trainer, on
    every start: a filter on that one logger and message, set before the import logs it."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _KernelHubNoticeFilter) for f in logger.filters):
        logger.addFilter(_KernelHubNoticeFilter())


def check_base_bits(base_bits: int, finetune: str) -> None:
    """A 4-bit base is frozen by construction: it only makes sense under LoRA."""
    if base_bits == 4 and finetune != "lora":
        raise SaverUnavailable(
            f"base_bits=4 quantizes the frozen base of a LoRA run, but this job has finetune={finetune!r}, which "
            f"trains every weight. Set {env_name('base_bits')}=16 for it (optimizer=adamw8bit and "
            "gradient_checkpointing still save memory under full fine-tuning)."
        )


def nf4_load_kwargs(dtype: torch.dtype, device: str) -> dict[str, Any]:
    """`from_pretrained` keywords for an NF4 base (QLoRA's recipe: NF4, double-quantized absmax,
    matmuls in `dtype`). lm_head and the embeddings stay in `dtype` (transformers skips lm_head)."""
    from transformers import BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    return {"quantization_config": q, "device_map": {"": device}}


def keep_trainable_layout(model: torch.nn.Module) -> None:
    """Stop bitsandbytes repacking NF4 weights for CPU inference.

    On CPUs with AVX512-BF16, a Linear4bit's first eval-mode forward without grad (the trainer's
    probe, services/trainer/probe.py) converts its weight, in place and for good, to a layout only
    the inference kernel reads; the next training forward then fails inside bitsandbytes. The
    trainer trains, so every Linear4bit keeps the layout both paths read."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
