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
inputs exist (all CPU allocator events; tests/support/lab/memory.py), so it
includes the weights, the optimizer states and everything autograd keeps. The peak RSS of the
process is a cross-check. The planner's prediction for the same case
(`services.plan.memory.trainer_memory` / `ref_memory`, GPU overheads off) sits next to it.

    .venv/bin/python bench/chunked_logprobs.py [--layers 2] [--out bench/results/chunked_logprobs.md]
    .venv/bin/python bench/chunked_logprobs.py --report-only --out bench/results/chunked_logprobs.md  # no re-run

Also rewrites its section of bench/results/plan_calibration.md (between the chunked_logprobs markers).

The cases and the planner's estimate for each are bench/chunked_logprobs_cases.py; the pages and the
headline figures, from the results alone, bench/chunked_logprobs_report.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.chunked_logprobs_cases import QWEN25_05B, Case, label, side  # noqa: E402
from bench.chunked_logprobs_report import figures, report, write_calibration  # noqa: E402
from tests.support.lab.memory import allocations, run_fresh  # noqa: E402
from tests.support.lab.results import RESULTS, emit, shown_command  # noqa: E402

MARKER = 777_777  # a distinctive allocation marks where the measured work starts


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help="JSON of one Case: measure it here and print JSON")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="lora,full", help="Trainer cases, comma-separated (lora, full).")
    ap.add_argument("--trainer-rows", type=int, default=2, help="Completions in the trainer's group.")
    ap.add_argument("--ref-rows", type=int, default=4)
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--out", type=Path, help="The page (and its .json beside it); default: stdout only.")
    ap.add_argument("--calibration", type=Path, default=RESULTS / "plan_calibration.md")
    ap.add_argument("--timeout", type=float, default=1800, help="Per case, seconds.")
    ap.add_argument("--report-only", action="store_true", help="Measure nothing: rebuild the pages from --out's JSON.")
    a = ap.parse_args(argv)
    if a.case:
        print(json.dumps(measure(Case.model_validate_json(a.case))))
        return 0
    if a.report_only:
        if not a.out:
            ap.error("--report-only rebuilds --out's page from its JSON: give --out")
        saved = json.loads(a.out.with_suffix(".json").read_text())
        rows = [(Case.model_validate(x["case"]), x["result"]) for x in saved["rows"]]
        command = saved["command"]
    else:
        saved = {}
        rows = measure_all(a)
        command = shown_command(__file__, argv)
    bench, cal, summary = report(rows, command)
    data = {"rows": [{"case": c.model_dump(), "result": r} for c, r in rows], "summary": summary}
    if a.report_only:  # the run's own record of where and when
        data |= {k: saved[k] for k in ("machine", "date") if k in saved}
    emit(bench, a.out, data, figures=figures(data), command=command)
    write_calibration(cal, a.calibration)
    print(cal)
    return 0


def measure_all(a: argparse.Namespace) -> list[tuple[Case, dict[str, float]]]:
    """Every case of the run, each in a fresh interpreter; the ref cases load a model saved here."""
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
    with tempfile.TemporaryDirectory(prefix="burstrl-chunk-bench-") as d:
        if ref_cases:
            save_ref_model(a.layers, Path(d))
        for case in cases + [c.model_copy(update={"model_dir": d}) for c in ref_cases]:
            t0 = time.time()
            r = run_case(case, a.timeout)
            print(f"{label(case)} / {side(case)}: {json.dumps(r)} ({time.time() - t0:.0f}s)", file=sys.stderr)
            rows.append((case, r))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
