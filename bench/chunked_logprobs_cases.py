"""bench/chunked_logprobs.py's cases: a Qwen2.5-0.5B-shaped model with a few layers, the trainer
(LoRA or full) or ref, chunked or not; what each is called on the page, and the planner's estimate
of its peak (services.plan.memory, GPU overheads off)."""

from __future__ import annotations

from pydantic import BaseModel

from services.plan.memory import Method, TrainerKnobs, Workload, ref_memory, trainer_memory
from services.plan.model_shape import ModelShape, shape_from_config

QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
}


class Case(BaseModel):
    role: str = "trainer"  # trainer | ref
    method: str = "lora"  # trainer: lora | full
    chunked: bool = True
    logits_chunk: int = 0  # chunked side: the setting (0 = auto)
    rows: int = 2
    prompt_len: int = 32
    completion_len: int = 224
    layers: int = 2
    threads: int = 2
    model_dir: str = ""  # ref: a saved model (HFScorer loads from a folder)

    @property
    def tokens(self) -> int:
        return self.rows * (self.prompt_len + self.completion_len)


def shape(layers: int) -> ModelShape:
    c = QWEN25_05B
    return shape_from_config(
        {**c, "model_type": "qwen2", "num_hidden_layers": layers}, f"qwen2.5-0.5b-shaped-{layers}l"
    )


def resolved_chunk(case: Case) -> int:
    from shared.ml.chunked_logprobs import resolve_logits_chunk

    return resolve_logits_chunk(case.logits_chunk, QWEN25_05B["vocab_size"]) if case.chunked else 0


def predict(case: Case) -> float:
    """The planner's peak for this case: tensor bytes only (no GPU context, no allocator slack)."""
    return planned(case).peak_bytes


def predict_phase(case: Case) -> str:
    return planned(case).peak_phase


def planned(case: Case):  # noqa: ANN201 (services.plan.memory.RoleMemory)
    w = Workload(prompt_len=case.prompt_len, completion_len=case.completion_len, group_size=1, batch=1)
    chunk = resolved_chunk(case)
    if case.role == "ref":
        return ref_memory(shape(case.layers), w, case.rows, weights="fp32", overhead_gb=0.0, logits_chunk=chunk)
    knobs = TrainerKnobs(
        dtype="fp32",
        micro_batch=case.rows,
        logits_chunk=chunk or None,
        grad_accumulation=False,  # one pass per optimizer step (micro_batch_tokens 0)
        # The learner's torch.optim.AdamW default: foreach on CUDA; on CPU the for-loop version, whose
        # temporaries (one per weight, the embedding's the largest) the foreach model covers best.
        optimizer_impl="foreach",
        master_weights=False,
        overhead_gb=0.0,
        fragmentation=0.0,
    )
    return trainer_memory(shape(case.layers), Method(kind=case.method, rank=16), w, knobs)  # type: ignore[arg-type]


def label(case: Case) -> str:
    what = f"trainer {case.method}{'-r16' if case.method == 'lora' else ''}" if case.role == "trainer" else "ref"
    return f"{what}, {case.rows} x {case.prompt_len + case.completion_len} tokens"


def side(case: Case) -> str:
    if not case.chunked:
        return "unchunked"
    return f"logits_chunk {case.logits_chunk or 'auto'} ({resolved_chunk(case)})"
