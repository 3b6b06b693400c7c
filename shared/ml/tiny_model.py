"""Build the tiny offline model: a byte-level tokenizer and a small random Qwen2.

Nothing is downloaded. The tokenizer is a byte-level BPE with no merges (one token per
byte, so digits are single tokens and text round-trips exactly); special tokens are
registered as special, and a chat template is set so chat-style prompting works too.
Both vLLM and transformers load the saved folder like any hub checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # vocab_size = alphabet + specials: the trainer learns no merges.
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(SPECIALS),
        special_tokens=SPECIALS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(["0123456789+-=*"], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        bos_token=None,
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: Path, *, hidden: int = 128, layers: int = 4, seed: int = 0) -> Path:
    """Write tokenizer + random-init Qwen2 weights (safetensors) into out_dir."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    heads = hidden // 32  # head_dim 32: vLLM's CPU attention needs >= 32
    config = Qwen2Config(
        vocab_size=len(tok),  # type: ignore[arg-type]
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "burstrl_model.json").write_text(
        json.dumps({"kind": "tiny", "hidden": hidden, "layers": layers, "seed": seed})
    )
    return out_dir
