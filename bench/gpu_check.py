"""Peak memory and tokens/s of the trainer's memory savers on one CUDA card, against the planner.

A randomly initialized Qwen2.5-0.5B-shaped model (no download), bf16, LoRA (r16) and full
fine-tuning, with and without each saver: gradient checkpointing, 8-bit AdamW, an NF4 base
(LoRA), chunked log-probs and CPU offload (full). Each case runs the GRPO-shaped step
bench/plan_calibration.py runs on CPU (forward over prompt + completion, fp32 log-probs of
the completion, clipped-ratio loss, backward, optimizer step): one warm-up step, then timed
steps. Measured = torch.cuda.max_memory_allocated over the steps (allocator bytes, so no CUDA
context and no caching slack, which is what the planner's estimate with overheads set to zero
counts); reserved is printed beside it.

Savers that are not in this checkout (chunked log-probs and offload land separately) or whose
library is missing are reported as skipped with the reason, never measured another way. The
planner's estimate needs pydantic; without it the column says so.

Usage (bench/gpu_check.sh wraps it with the wheels it may need):
    python bench/gpu_check.py --out $OUT/gpu_calibration.md [--doc bench/results/plan_calibration.md]
    python bench/gpu_check.py --dry-run --doc bench/results/plan_calibration.md   # no CUDA: estimates, "not measured"
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.support.lab.results import emit  # noqa: E402

# Qwen2.5-0.5B's config.json (the shapes only; the weights are random).
QWEN05B = {
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
MICRO_BATCH, PROMPT, COMPLETION = 4, 256, 256
RANK = 16
STEPS = 3  # timed, after one warm-up step
BUDGET_S = 390.0  # cases not started by then are reported as not run: the script stays under 8 minutes
GPU_HEADING = "## GPU (CUDA, bf16): bench/gpu_check.sh"
DEV = "cuda"  # --smoke: "cpu", a tiny shape, no memory numbers (checks the code paths without a GPU)
SMOKE_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 256,
    "vocab_size": 1024,
}


@dataclass
class Case:
    method: str  # lora | full
    ckpt: bool = False
    optimizer: str = "adamw"
    base_bits: int = 16
    chunk: bool = False
    offload: bool = False

    @property
    def name(self) -> str:
        on = [
            n
            for n, v in [
                ("ckpt", self.ckpt),
                ("adamw8bit", self.optimizer == "adamw8bit"),
                ("nf4", self.base_bits == 4),
                ("chunk", self.chunk),
                ("offload", self.offload),
            ]
            if v
        ]
        return f"{self.method}:{'+'.join(on) or 'none'}"


@dataclass
class Result:
    case: Case
    estimate: float | None = None
    measured: float | None = None
    reserved: float | None = None
    tokens_per_s: float | None = None
    chunk_tokens: int | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def cases() -> list[Case]:
    # The "everything" rows take chunked log-probs when this checkout has them.
    chunk = importlib.util.find_spec("shared.ml.chunked_logprobs") is not None
    return [
        Case("lora"),
        Case("lora", ckpt=True),
        Case("lora", optimizer="adamw8bit"),
        Case("lora", base_bits=4),
        Case("lora", chunk=True),
        Case("lora", ckpt=True, optimizer="adamw8bit", base_bits=4, chunk=chunk),
        Case("full"),
        Case("full", ckpt=True),
        Case("full", optimizer="adamw8bit"),
        Case("full", chunk=True),
        Case("full", offload=True),
        Case("full", ckpt=True, optimizer="adamw8bit", chunk=chunk),
    ]


def unavailable(case: Case) -> str:
    """Why this checkout cannot run `case` here ('' when it can)."""
    if case.optimizer == "adamw8bit" or case.base_bits == 4:
        if importlib.util.find_spec("bitsandbytes") is None:
            return "skipped: bitsandbytes not installed (bench/gpu_wheels.sh fetches its wheel)"
    if case.chunk and importlib.util.find_spec("shared.ml.chunked_logprobs") is None:
        return "skipped: chunked log-probs not in this checkout"
    if case.offload and importlib.util.find_spec("services.trainer.sharding") is None:
        return "skipped: cpu offload not in this checkout"
    return ""


def chunk_tokens() -> int | None:
    if importlib.util.find_spec("shared.ml.chunked_logprobs") is None:
        return None
    from shared.ml.chunked_logprobs import resolve_logits_chunk

    return resolve_logits_chunk(0, QWEN05B["vocab_size"])


def estimate(case: Case) -> tuple[float | None, str]:
    """The planner's tensor bytes for `case` (no context, no slack), or None and why."""
    try:
        from services.plan.memory import Method, TrainerKnobs, Workload, trainer_memory
        from services.plan.model_shape import shape_from_config
    except ImportError as e:
        return None, f"no estimate: {e}"
    c = QWEN05B
    shape = shape_from_config({**c, "model_type": "qwen2"}, "qwen2.5-0.5b-shape")
    knobs = TrainerKnobs(
        dtype="bf16",
        micro_batch=MICRO_BATCH,
        gradient_checkpointing=case.ckpt,
        logits_chunk=chunk_tokens() if case.chunk else None,
        optimizer=case.optimizer,  # type: ignore[arg-type]
        optimizer_impl="fused",
        master_weights=False,  # pure bf16, as measured: AdamW's states follow the parameters' dtype
        cpu_offload=case.offload,
        base_bits=case.base_bits,  # type: ignore[arg-type]
        grad_accumulation=False,
        overhead_gb=0.0,
        fragmentation=0.0,
    )
    work = Workload(prompt_len=PROMPT, completion_len=COMPLETION, group_size=1, batch=1)
    method = Method(kind=case.method, rank=RANK)  # type: ignore[arg-type]
    return trainer_memory(shape, method, work, knobs).peak_bytes, ""


def build(case: Case, saved: Path):  # noqa: ANN201
    """The model on the card (or sharded to host RAM for offload), as the trainer builds it."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    dev = DEV
    if case.base_bits == 4:
        from services.trainer.quant import keep_trainable_layout, nf4_load_kwargs

        model = AutoModelForCausalLM.from_pretrained(
            saved, dtype=torch.bfloat16, **nf4_load_kwargs(torch.bfloat16, dev)
        )
        keep_trainable_layout(model)
    else:
        cfg = Qwen2Config(**QWEN05B, attn_implementation="sdpa")
        torch.manual_seed(0)
        with torch.device("cpu" if case.offload else dev):
            model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    if case.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if case.method == "lora":
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules="all-linear")
        model = get_peft_model(model, lcfg)
    if case.offload:
        from services.trainer.sharding import shard_model

        model = shard_model(model, device=dev, cpu_offload=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if case.optimizer == "adamw8bit":
        from services.trainer.optim import build_optimizer

        opt = build_optimizer(params, "adamw8bit", lr=1e-5)
    else:
        # Offloaded states live in host RAM and step there (foreach, as the planner assumes for offload).
        opt = torch.optim.AdamW(params, lr=1e-5, fused=not case.offload)
    return model, opt


def completion_logprobs(model, ids: torch.Tensor, chunk: int | None) -> torch.Tensor:  # noqa: ANN001
    P = ids.shape[1] - COMPLETION
    if chunk:
        from shared.ml.chunked_logprobs import chunked_token_logprobs, head_params, model_hidden

        hidden = model_hidden(model, ids, None)[:, P - 1 : -1]
        weight, bias = head_params(model)
        return chunked_token_logprobs(hidden, weight, ids[:, P:], chunk=chunk, bias=bias)
    logits = model(input_ids=ids, logits_to_keep=COMPLETION + 1).logits[:, :-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, P:, None]).squeeze(-1)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def measure(case: Case, saved: Path) -> Result:
    res = Result(case)
    cuda = DEV == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    model, opt = build(case, saved)
    chunk = chunk_tokens() if case.chunk else None
    res.chunk_tokens = chunk
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(0, QWEN05B["vocab_size"], (MICRO_BATCH, PROMPT + COMPLETION), device=DEV, generator=g)
    adv = torch.randn(MICRO_BATCH, 1, device=DEV, generator=g)
    times = []
    for step in range(1 + STEPS):
        sync()
        t0 = time.perf_counter()
        logp = completion_logprobs(model, ids, chunk)
        ratio = torch.exp(logp - logp.detach())
        loss = -(torch.clamp(ratio, 0.8, 1.2) * adv).mean()
        loss.backward()
        del logp, ratio, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step:
            times.append(time.perf_counter() - t0)
    if cuda:
        res.measured = float(torch.cuda.max_memory_allocated() - before)
        res.reserved = float(torch.cuda.max_memory_reserved())
    res.tokens_per_s = MICRO_BATCH * (PROMPT + COMPLETION) * len(times) / sum(times)
    res.note = "" if cuda else "smoke run on cpu"
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def table(results: list[Result], device: str, command: str) -> str:
    mib = 1 / 2**20
    lines = [
        GPU_HEADING,
        "",
        f"Produced by `{command}` on {device}: random-init Qwen2.5-0.5B shape (vocab 151,936), bf16, "
        f"{MICRO_BATCH} x {PROMPT + COMPLETION} tokens ({COMPLETION} completion), LoRA r{RANK} or full, "
        f"1 warm-up + {STEPS} timed steps per case. Measured = torch.cuda.max_memory_allocated (no context, "
        "no caching slack); estimate = the planner with overheads set to zero.",
        "",
        *(
            [
                "No GPU machine was available when these rows were written: they hold the planner's estimates "
                "and are marked not measured. `bash bench/gpu_check.sh` on a CUDA machine measures them.",
                "",
            ]
            if all(r.measured is None for r in results)
            else []
        ),
        "| config | method | dtype | micro-batch x tokens | accum | ckpt | optimizer | base bits | logits chunk "
        "| cpu offload | estimate MiB | measured MiB | error | reserved MiB | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.case
        est = f"{r.estimate * mib:.0f}" if r.estimate is not None else "n/a"
        if r.measured is None:
            meas, err, resv = (r.note or "not measured"), "", ""
            tps = f"{r.tokens_per_s:.0f}" if r.tokens_per_s else ""
        else:
            meas = f"{r.measured * mib:.0f}"
            err = f"{(r.estimate - r.measured) / r.measured:+.1%}" if r.estimate is not None else ""
            resv, tps = f"{r.reserved * mib:.0f}", f"{r.tokens_per_s:.0f}"
        lines.append(
            f"| qwen2.5-0.5b | {c.method}{'-r' + str(RANK) if c.method == 'lora' else ''} | bf16 "
            f"| {MICRO_BATCH} x {PROMPT + COMPLETION} | 1 | {'on' if c.ckpt else 'off'} | {c.optimizer} "
            f"| {c.base_bits} | {r.chunk_tokens or 'off'} | {'on' if c.offload else 'off'} | {est} | {meas} "
            f"| {err} | {resv} | {tps} |"
        )
    return "\n".join(lines) + "\n"


def put_section(doc: Path, section: str) -> None:
    """Replace (or append) the GPU section at the end of bench/results/plan_calibration.md."""
    text = doc.read_text() if doc.exists() else ""
    head = text.split(GPU_HEADING, 1)[0].rstrip("\n")
    doc.write_text(head + "\n\n" + section)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the markdown table (and a .json beside it) here")
    ap.add_argument("--doc", type=Path, help="also put the table in this calibration doc's GPU section")
    ap.add_argument("--dry-run", action="store_true", help="no CUDA needed: estimates only, rows 'not measured'")
    ap.add_argument("--only", help="comma-separated case names (e.g. lora:none,full:ckpt)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on cpu: runs every code path, measures nothing")
    args = ap.parse_args(argv)
    global DEV, MICRO_BATCH, PROMPT, COMPLETION
    if args.smoke:
        DEV, MICRO_BATCH, PROMPT, COMPLETION = "cpu", 2, 16, 16
        QWEN05B.update(SMOKE_SHAPE)
    start = time.time()
    todo = cases()
    if args.only:
        todo = [c for c in todo if c.name in args.only.split(",")]
    results: list[Result] = []
    cuda = (torch.cuda.is_available() or args.smoke) and not args.dry_run
    device = torch.cuda.get_device_name(0) if cuda and not args.smoke else "no CUDA device (not measured)"
    saved = Path(tempfile.mkdtemp(prefix="burstrl-gpu-check-"))
    if cuda and any(c.base_bits == 4 and not unavailable(c) for c in todo):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        with torch.device(DEV):
            Qwen2ForCausalLM(Qwen2Config(**QWEN05B)).to(torch.bfloat16).save_pretrained(saved)
    for case in todo:
        res = Result(case)
        res.estimate, why = estimate(case)
        res.chunk_tokens = chunk_tokens() if case.chunk else None
        if why:
            res.extra["estimate"] = why
        skip = unavailable(case)
        if not cuda:
            res.note = "not measured" + (f" ({skip})" if skip else "")
        elif skip:
            res.note = skip
        elif time.time() - start > BUDGET_S:
            res.note = "not run: time budget"
        else:
            try:
                est, chunk = res.estimate, res.chunk_tokens
                res = measure(case, saved)
                res.estimate, res.chunk_tokens = est, chunk
            except Exception as e:  # one saver failing must not lose the other rows
                res.note = f"failed: {type(e).__name__}: {str(e)[:120]}".replace("|", "/").replace("\n", " ")
                gc.collect()
                if DEV == "cuda":
                    torch.cuda.empty_cache()
        print(json.dumps({"case": case.name, **{k: v for k, v in asdict(res).items() if k != "case"}}), flush=True)
        results.append(res)
    command = "bash bench/gpu_check.sh" if not args.dry_run else "python bench/gpu_check.py --dry-run"
    section = table(results, device, command)
    emit(section, args.out, {"rows": [asdict(r) for r in results]}, command=command)
    if args.doc:
        put_section(args.doc, section)
    print(f"done in {time.time() - start:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
