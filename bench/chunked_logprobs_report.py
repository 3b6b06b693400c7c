"""bench/chunked_logprobs.py's pages (its own, and its section of bench/results/plan_calibration.md)
and headline figures, pure functions of its measured cases."""

from __future__ import annotations

from pathlib import Path

from bench.chunked_logprobs_cases import Case, label, predict, predict_phase, side
from tests.support.lab.results import Figure, figure

BEGIN, END = "<!-- chunked_logprobs:begin -->", "<!-- chunked_logprobs:end -->"
MiB = 2**20


def report(rows: list[tuple[Case, dict[str, float]]], command: str) -> tuple[str, str, dict]:
    """(the benchmark's page, its section of the calibration page, the chunked / unchunked peaks per case)."""
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


def figures(res: dict) -> list[Figure]:
    """The headline figures of a results JSON: each case's peak, chunked against unchunked."""
    return [
        figure(
            f"peak memory, chunked / unchunked log-probs ({case}, Qwen2.5-0.5B shape)",
            f"{x['chunked_mib']:.0f} MiB",
            baseline=f"{x['unchunked_mib']:.0f} MiB unchunked",
            ratio=x["ratio"],
        )
        for case, x in res["summary"].items()
    ]
