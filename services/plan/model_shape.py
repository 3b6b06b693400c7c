"""Model shapes: the handful of numbers from a decoder-only config.json that memory and FLOPs depend on.

`resolve_shape` turns what the user typed after `--model` into a `ModelShape`, offline only:
a config.json path, a model folder, a hub id already in the local Hugging Face cache, or one
of the shapes built in below (so `burstrl plan` works on a fresh machine). It never downloads.
`memory.py` and `placement.py` consume the shape; nothing here knows about cards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field


class ModelShape(BaseModel):
    """A Llama/Qwen-style decoder: RMSNorm, GQA attention with RoPE, gated (SwiGLU) MLP."""

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False
    qkv_bias: bool = Field(default=False, description="Qwen2 has biases on q/k/v projections.")
    qk_norm: bool = Field(default=False, description="Qwen3 normalizes q and k per head.")
    quant_bits: int | None = Field(default=None, description="Set when the checkpoint itself is GPTQ/AWQ.")
    quant_method: str | None = None

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear in one layer, keyed by the names LoRA targets use."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def linear_params(self) -> int:
        """Weights of all per-layer linears: what GPTQ/AWQ quantize and FLOPs scale with."""
        return self.num_layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def small_params(self) -> int:
        """Biases and norms: negligible in size, but counted so totals match HF's."""
        per_layer = 2 * self.hidden_size
        per_layer += (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        return self.num_layers * per_layer + self.hidden_size

    @property
    def embed_params(self) -> int:
        """Input embedding plus an untied lm_head."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def n_params(self) -> int:
        return self.linear_params + self.small_params + self.embed_params

    def lora_params(self, rank: int, targets: list[str] | None = None) -> int:
        """A (r x in) plus B (out x r) for every targeted linear in every layer."""
        shapes = self.linear_shapes()
        names = targets or list(shapes)
        return self.num_layers * sum(rank * (shapes[n][0] + shapes[n][1]) for n in names)

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V for one token across all layers."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def forward_flops_per_token(self, context: float) -> float:
        """2 FLOPs per weight use (incl. lm_head) plus causal attention over `context` tokens."""
        matmul = 2 * (self.linear_params + self.vocab_size * self.hidden_size)
        # QK^T and AV: 2 matmuls x 2 FLOPs x q_dim per attended token; causal halves the average.
        attention = 2 * 2 * self.num_layers * self.q_dim * context / 2
        return matmul + attention


def _qwen2(
    name: str,
    layers: int,
    h: int,
    heads: int,
    kv: int,
    inter: int,
    vocab: int,
    tied: bool,
) -> ModelShape:
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=h // heads,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        qkv_bias=True,
    )


# Copied from the public config.json files, so the planner works without any download.
BUILTIN_SHAPES: dict[str, ModelShape] = {
    s.name.lower(): s
    for s in [
        _qwen2("Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, True),
        _qwen2("Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, True),
        _qwen2("Qwen2.5-3B", 36, 2048, 16, 2, 11008, 151936, True),
        _qwen2("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, False),
        _qwen2("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, False),
        _qwen2("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, False),
        ModelShape(
            name="Qwen3-0.6B",
            num_layers=28,
            hidden_size=1024,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
            tie_word_embeddings=True,
            qk_norm=True,
        ),
        ModelShape(
            name="Llama-3.1-8B",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
        ),
    ]
}


def shape_from_config(config: dict[str, Any], name: str = "model") -> ModelShape:
    """Read a HF config.json dict (Llama, Qwen2/2.5/3, Mistral and alike)."""
    cfg = config.get("text_config", config)  # multimodal wrappers nest the language model
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    model_type = cfg.get("model_type", "")
    quant = cfg.get("quantization_config") or config.get("quantization_config") or {}
    return ModelShape(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type.startswith("qwen3"),
        quant_bits=quant.get("bits") or quant.get("w_bit"),
        quant_method=quant.get("quant_method"),
    )


def hf_cache_dir() -> Path:
    """Where huggingface_hub keeps snapshots, honouring the same env vars it does."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache)
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(hf_home).expanduser() / "hub"


def find_cached_config(repo_id: str, cache_dir: Path | None = None) -> Path | None:
    """config.json of `repo_id` in the local HF cache (the `main` snapshot first), or None."""
    repo = (cache_dir or hf_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
        return snapshots / ref.read_text().strip() / "config.json"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def _builtin(model: str) -> ModelShape | None:
    # "Qwen/Qwen2.5-7B-Instruct" has the same shape as "Qwen2.5-7B".
    key = model.rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-base"):
        key = key.removesuffix(suffix)
    return BUILTIN_SHAPES.get(key)


def resolve_shape(model: str, cache_dir: Path | None = None) -> ModelShape:
    """Path to config.json or a model folder, a cached hub id, or a built-in name -> shape."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return shape_from_config(json.loads(path.read_text()), name=path.parent.name or model)
    if "/" in model and (cached := find_cached_config(model, cache_dir)) is not None:
        return shape_from_config(json.loads(cached.read_text()), name=model)
    if (shape := _builtin(model)) is not None:
        return shape.model_copy(update={"name": model})
    known = ", ".join(s.name for s in BUILTIN_SHAPES.values())
    raise FileNotFoundError(
        f"no config for {model!r}: not a file/folder, not in the HF cache ({hf_cache_dir()}), "
        f"not built in ({known}). Pass a config.json path."
    )
