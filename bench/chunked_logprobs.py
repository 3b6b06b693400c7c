"""Peak memory of chunked log-probs against the unchunked path, side by side (issue 22, item 4).

A randomly initialized Qwen2.5-0.5B-shaped model (hidden 896, 14/2 heads, MLP 4864, the real
151,936-token vocabulary, tied embeddings) with only `--layers` decoder layers, so the
[tokens, vocab] log-prob tensors are what the unchunked path spends its memory on, on CPU:

- trainer: two `Learner.train_batch` steps (forward, GRPO loss, backward, AdamW) on one
  group, LoRA r16 (all linears, as services/trainer/policy.py) and full fine-tuning;
- ref: `HFScorer.score` of a batch of sequences.

Each side runs in a fresh interpreter: "unchunked" replaces the learner's forward (or the
scorer's pass) with the code before this change (`model(...).logits` then
`shared.ml.logprobs`), "chunked" is the code as it is (`logits_chunk`, default 0 = auto).
Peak = the largest live tensor total that torch's memory profiler sees after the model and
inputs exist (all CPU allocator events; the method of bench/plan_calibration.py), so it
includes the weights, the optimizer states and everything autograd keeps. The peak RSS of the
process is a cross-check. The planner's prediction for the same case
(`services.plan.memory.trainer_memory` / `ref_memory`, GPU overheads off) sits next to it.

    .venv/bin/python bench/chunked_logprobs.py [--layers 2] [--out docs/bench/chunked_logprobs.md]
    .venv/bin/python bench/chunked_logprobs.py --from-log docs/bench/chunked_logprobs.log --out ...  # no re-run

Also rewrites its section of docs/plan_calibration.md (between the chunked_logprobs markers).

Over ~400 lines: each case's measurement, the planner's estimate for it and the report rows sit
together so that the calibration can be read against the code that makes it.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import tempfile
import time
import types
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.output import emit  # noqa: E402
from bench.plan_calibration import allocations, run_fresh  # noqa: E402
from services.plan.memory import Method, TrainerKnobs, Workload, ref_memory, trainer_memory  # noqa: E402
from services.plan.model_shape import ModelShape, shape_from_config  # noqa: E402

QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
}
MARKER = 777_777  # a distinctive allocation marks where the measured work starts
BEGIN, END = "<!-- chunked_logprobs:begin -->", "<!-- chunked_logprobs:end -->"


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


def _config(layers: int):  # noqa: ANN202
    from transformers import Qwen2Config

    return Qwen2Config(**QWEN25_05B, num_hidden_layers=layers, max_position_embeddings=4096, attn_implementation="sdpa")


def _groups(case: Case) -> list:
    import torch

    from shared.schema import Completion, GroupMsg, pack_f32, pack_i32, pack_u8

    gen = torch.Generator().manual_seed(0)
    v = QWEN25_05B["vocab_size"]
    comps = [
        Completion(
            token_ids=pack_i32(torch.randint(1, v, (case.completion_len,), generator=gen).tolist()),
            logprobs=pack_f32([-12.0] * case.completion_len),
            loss_mask=pack_u8([1] * case.completion_len),
            text="",
            finish_reason="length",
            reward=float(i % 2),
        )
        for i in range(case.rows)
    ]
    prompt = torch.randint(1, v, (case.prompt_len,), generator=gen).tolist()
    return [
        GroupMsg(
            job_id="bench",
            group_id="g0",
            item_id="i",
            prompt="p",
            prompt_ids=pack_i32(prompt),
            policy_version=0,
            completions=comps,
            stage="ready",
        )
    ]


def _unchunked_forward(self, b, rows):  # noqa: ANN001, ANN202
    """Learner._forward before chunked log-probs: the whole pass's logits, then log-softmax."""
    import torch

    from shared.ml.logprobs import token_logprobs_and_entropy

    idx = torch.tensor(rows, dtype=torch.long)
    attn = b.attention_mask[idx]
    length = int(attn.sum(dim=1).max())
    ids = b.input_ids[idx, :length].to(self.device)
    logits = self.model(input_ids=ids, attention_mask=attn[:, :length].to(self.device)).logits[:, :-1]
    logp, ent = token_logprobs_and_entropy(logits, ids[:, 1:])
    return logp, ent, length - 1


def _unchunked_run(self, seqs, rows, out) -> None:  # noqa: ANN001
    """HFScorer._run before chunked log-probs."""
    import torch

    from services.ref.engine import right_padded
    from shared.ml.logprobs import token_logprobs

    ids, attn = right_padded(seqs, rows)  # the padding HFScorer._run still does
    with torch.no_grad():
        logits = self.net(input_ids=ids, attention_mask=attn).logits[:, :-1]
        lp = token_logprobs(logits, ids[:, 1:]).float().cpu()
    for r, i in enumerate(rows):
        p, c = seqs[i]
        out[i] = lp[r, len(p) - 1 : len(p) - 1 + len(c)].tolist()


def measure(case: Case) -> dict[str, float]:
    """Run the case under torch's memory profiler; peak live tensor bytes after setup."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    torch.set_num_threads(case.threads)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t_work = 0.0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if case.role == "trainer":
            from transformers import Qwen2ForCausalLM

            from services.trainer.learner import Learner
            from shared.job import JobSpec

            model = Qwen2ForCausalLM(_config(case.layers))
            if case.method == "lora":
                from peft import LoraConfig, get_peft_model

                lcfg = LoraConfig(
                    r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
                )
                model = get_peft_model(model, lcfg)
            spec = JobSpec(base_model="bench", group_size=case.rows, batch_size=1, steps=10, lora_rank=16)
            learner = Learner(
                model, spec, pad_id=0, grad_clip=1.0, micro_batch_tokens=0, logits_chunk=case.logits_chunk
            )
            if not case.chunked:
                learner._forward = types.MethodType(_unchunked_forward, learner)  # type: ignore[method-assign]
            groups = _groups(case)
            marker = torch.empty(MARKER, dtype=torch.uint8)
            del marker
            t0 = time.perf_counter()
            for _ in range(2):
                learner.train_batch(groups)
            t_work = (time.perf_counter() - t0) / 2
        else:
            from services.ref.engine import HFScorer

            scorer = HFScorer(
                case.model_dir, "cpu", "float32", max_batch_tokens=case.tokens, logits_chunk=case.logits_chunk
            )
            # transformers maps the safetensors file: those weights are not allocator memory and the
            # profiler would not see them. Copies are, so the peak counts the weights as the planner does.
            with torch.no_grad():
                for p in scorer.net.parameters():
                    p.data = p.data.clone()
            if not case.chunked:
                scorer._run = types.MethodType(_unchunked_run, scorer)  # type: ignore[method-assign]
            gen = torch.Generator().manual_seed(0)
            v = QWEN25_05B["vocab_size"]
            seqs = [
                (
                    torch.randint(1, v, (case.prompt_len,), generator=gen).tolist(),
                    torch.randint(1, v, (case.completion_len,), generator=gen).tolist(),
                )
                for _ in range(case.rows)
            ]
            marker = torch.empty(MARKER, dtype=torch.uint8)
            del marker
            t0 = time.perf_counter()
            scorer.score(seqs)
            t_work = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    allocs = allocations(prof)
    start = next(i for i, e in enumerate(allocs) if e.extra_fields.alloc_size == MARKER)
    top = max(allocs[start:], key=lambda e: e.extra_fields.total_allocated)
    op = top.parent
    while op is not None and op.parent is not None and not op.name.startswith(("autograd::", "Optimizer.")):
        op = op.parent  # the outermost op: which phase (forward op, autograd node, optimizer step)
    return {
        "peak_at": top.parent.name if top.parent is not None else "?",
        "peak_phase": op.name if op is not None else "?",
        "measured": float(top.extra_fields.total_allocated),
        "setup": float(allocs[start].extra_fields.total_allocated - MARKER),
        "rss_peak": float(rss1),
        "rss_delta": float(rss1 - rss0),
        "seconds": t_work,
    }


def run_case(case: Case, timeout: float) -> dict[str, float]:
    """Measure `case` in a fresh interpreter, so nothing from other cases is alive or cached."""
    return run_fresh(__file__, case, timeout)


def save_ref_model(layers: int, folder: Path) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(_config(layers)).save_pretrained(folder, safe_serialization=True)


MiB = 2**20


def label(case: Case) -> str:
    what = f"trainer {case.method}{'-r16' if case.method == 'lora' else ''}" if case.role == "trainer" else "ref"
    return f"{what}, {case.rows} x {case.prompt_len + case.completion_len} tokens"


def side(case: Case) -> str:
    if not case.chunked:
        return "unchunked"
    return f"logits_chunk {case.logits_chunk or 'auto'} ({resolved_chunk(case)})"


def report(rows: list[tuple[Case, dict[str, float]]], command: str) -> tuple[str, str, dict]:
    """(docs/bench section, docs/plan_calibration.md section, JSON summary)."""
    by_label: dict[str, dict[bool, dict[str, float]]] = {}
    for case, r in rows:
        by_label.setdefault(label(case), {})[case.chunked] = r
    bench = [
        "## Chunked log-probs: peak memory, Qwen2.5-0.5B-shaped model on CPU (issue 22)",
        "",
        f"`{command}`",
        "",
        "Random-init Qwen2.5-0.5B shape with the real 151,936-token vocabulary and "
        f"{rows[0][0].layers} decoder layers, fp32, {rows[0][0].threads} torch threads. Peak = live tensor bytes "
        "(torch memory profiler) after the model and inputs exist, weights and optimizer states included; each "
        "row a fresh process; the two sides of a case run one after the other in the same invocation. s / step is "
        "wall time on a shared 2-core machine with other work running: a rough figure, not a speed comparison.",
        "",
        "| case | side | peak MiB | above setup MiB | MiB / token above setup | peak vs unchunked | peak RSS MiB "
        "| s / step | peak during |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary: dict[str, dict] = {}
    for case, r in rows:
        base = by_label[label(case)].get(False)
        ratio = f"**{r['measured'] / base['measured']:.2f}x**" if base and case.chunked else "1 (baseline)"
        above = r["measured"] - r["setup"]
        bench.append(
            f"| {label(case)} | {side(case)} | {r['measured'] / MiB:.0f} | {above / MiB:.0f} "
            f"| {above / case.tokens / MiB:.2f} | {ratio} | {r['rss_peak'] / MiB:.0f} | {r['seconds']:.1f} "
            f"| {r.get('peak_phase', '?')} ({r.get('peak_at', '?')}) |"
        )
        if case.chunked and base:
            summary[label(case)] = {
                "ratio": r["measured"] / base["measured"],
                "chunked_mib": r["measured"] / MiB,
                "unchunked_mib": base["measured"] / MiB,
            }
    cal = [
        BEGIN,
        "## Chunked log-probs (`logits_chunk`): trainer and ref, estimate vs measured",
        "",
        f"Produced by `{command}` (torch CPU, random-init Qwen2.5-0.5B shape with the real 151,936-token "
        f"vocabulary and {rows[0][0].layers} layers, fp32; fresh process per row). Measured = peak live tensor "
        "bytes from torch's memory profiler, as above. Estimate = `services.plan.memory.trainer_memory` (one "
        "pass per step, torch's default AdamW = the planner's foreach) or `ref_memory` (fp32 weights), GPU "
        "overheads set to zero. The unchunked rows are the code before this change (which no longer runs), "
        "modelled as `logits_chunk = None`; that code computed log-probs at every position, prompt included, "
        "and kept the entropy's [tokens, vocab] buffers too, which the planner does not count.",
        "",
        "| case | side | estimate MiB | measured MiB | error | within ±10% | peak during (measured / planner) |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for case, r in rows:
        est = predict(case)
        err = (est - r["measured"]) / r["measured"]
        worst = max(worst, abs(err))
        cal.append(
            f"| {label(case)} | {side(case)} | {est / MiB:.0f} | {r['measured'] / MiB:.0f} | {err:+.1%} "
            f"| {'yes' if abs(err) <= 0.10 else '**no**'} | {r.get('peak_phase', '?')} / {predict_phase(case)} |"
        )
    cal += [
        "",
        f"Largest absolute error in this section: **{worst:.1%}**.",
        "",
        "Why the misses (from the phases above): the unchunked rows are the code this change replaced. The "
        "planner counts three fp32 [completion tokens, vocab] tensors; that code built logits at every "
        "position, prompt included, and kept the entropy's exp and product buffers too, so it needed more "
        "than predicted (the reason a 4096-token default did not fit, issue 22). Full fine-tuning peaks in "
        "AdamW's step with or without chunking: torch's CPU AdamW (the for-loop one) holds two temporaries "
        "of the largest weight at once (sqrt, then div, of the tied embedding's second moment, 2 x 520 MiB "
        "here), where the planner's foreach model holds one temporary per weight (636 MiB in all). That is "
        "the CPU's optimizer, not the log-probs; on CUDA the learner's AdamW is foreach, the case the "
        "planner models.",
        END,
    ]
    return "\n".join(bench) + "\n", "\n".join(cal) + "\n", summary


def write_calibration(section: str, path: Path) -> None:
    """Replace this bench's section of the calibration page (or append it), leaving the rest as is."""
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help="JSON of one Case: measure it here and print JSON")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="lora,full", help="Trainer cases, comma-separated (lora, full).")
    ap.add_argument("--trainer-rows", type=int, default=2, help="Completions in the trainer's group.")
    ap.add_argument("--ref-rows", type=int, default=4)
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--out", type=Path, help="Markdown for docs/bench/ (default: stdout only).")
    ap.add_argument("--json", type=Path, help="Also write the summary as JSON here.")
    ap.add_argument("--calibration", type=Path, default=ROOT / "docs" / "plan_calibration.md")
    ap.add_argument("--timeout", type=float, default=1800, help="Per case, seconds.")
    ap.add_argument(
        "--from-log", type=Path, help="Measure nothing: rebuild the report from an earlier run's log (same args)."
    )
    a = ap.parse_args(argv)
    if a.case:
        print(json.dumps(measure(Case.model_validate_json(a.case))))
        return 0
    common = {"layers": a.layers, "threads": a.threads}
    cases = [
        Case(role="trainer", method=m, chunked=c, rows=a.trainer_rows, **common)
        for m in filter(None, a.methods.split(","))
        for c in (False, True)
    ]
    ref_cases = (
        []
        if a.no_ref
        else [
            Case(role="ref", chunked=c, rows=a.ref_rows, prompt_len=128, completion_len=384, **common)
            for c in (False, True)
        ]
    )
    rows: list[tuple[Case, dict[str, float]]] = []
    command = " ".join([".venv/bin/python bench/chunked_logprobs.py", *(argv if argv is not None else sys.argv[1:])])
    if a.from_log:
        text = a.from_log.read_text()
        found = [json.loads(m) for m in re.findall(r"^[^\n]* / [^\n]*: (\{.*\}) \(\d+s\)$", text, flags=re.M)]
        rows = list(zip(cases + ref_cases, found, strict=True))
        command = re.search(r"^`(\.venv/bin/python bench/chunked_logprobs\.py[^`]*)`$", text, flags=re.M).group(1)  # type: ignore[union-attr]
    else:
        with tempfile.TemporaryDirectory(prefix="burstrl-chunk-bench-") as d:
            if ref_cases:
                save_ref_model(a.layers, Path(d))
            for case in cases + [c.model_copy(update={"model_dir": d}) for c in ref_cases]:
                t0 = time.time()
                r = run_case(case, a.timeout)
                print(f"{label(case)} / {side(case)}: {json.dumps(r)} ({time.time() - t0:.0f}s)", file=sys.stderr)
                rows.append((case, r))
    bench, cal, summary = report(rows, command)
    emit(bench, a.out)
    if a.json:
        a.json.write_text(json.dumps(summary, indent=1) + "\n")
    write_calibration(cal, a.calibration)
    print(cal)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
