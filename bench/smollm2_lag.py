"""Staleness on SmolLM2: how far the policy that trains a group is from the one that sampled it,
k versions older, for k = 1, 2, 4, 8 and 16, on one GRPO run's own policy versions.

The versions are the SmolLM2 demo's (`bench/smollm2_demo.py --versions DIR`: the demo's job,
20 steps, every version kept). For each current version c and lag k: 16 held-out prompts of the
job's task, rendered with the model's chat template, 4 completions each sampled at T=1 (the job's
max tokens) from version c-k, the behaviour policy; both versions then score those tokens in fp32
through the trainer's own log-prob path. The trainer's own corrections and statistics
(services/trainer/corrections.py, stats.py) give, per lag:

- m2: mean (log pi_c - log pi_{c-k})^2 over the completion tokens, what M2PO bounds (tau 0.04);
- ess_raw: the normalised effective sample size of the raw ratios pi_c / pi_{c-k};
- TIS (token_truncate, cap 2): the fraction of tokens whose weight was truncated;
- M2PO (tau 0.04): the fraction of tokens masked, and the ESS of the weights left.

This isolates the policy lag: sampler and trainer are the same fp32 code, so a lag of 0 gives 0
(the engine's own error, measured by the probe, is ~1e-5). It measures what lag does to the data a
step trains on, not what it does to learning: training runs at each lag and correction on this
model (4 lags x 3 corrections x ~20 steps of ~1.5 min) take hours on 2 cores (docs/smollm2.md).

The planner's `--max-lag` default rests on this table, by a rule fixed before the first run: the
largest measured lag at which M2PO masks at most 5% of the tokens at every current version
measured (so M2PO still trains on nearly all of a stale batch); where every measured lag passes,
the largest lag measured, since nothing beyond it was.

    PYTHONPATH=. .venv/bin/python bench/smollm2_demo.py --versions /tmp/smollm2-versions
    PYTHONPATH=. .venv/bin/python bench/smollm2_lag.py --versions /tmp/smollm2-versions \\
        --out bench/results/smollm2_lag.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.lab.results import emit, figure, machine, shown_command, table  # noqa: E402

MODEL = ROOT / ".burstrl" / "models" / "smollm2-135m-instruct"
LAGS = (1, 2, 4, 8, 16)
M2PO_TAU = 0.04  # the trainer's default (services/trainer/corrections.py, mismatch_correction)
TIS_CAP = 2.0  # likewise
MASK_LIMIT = 0.05  # the rule for the planner's --max-lag default (above)


def load_model() -> tuple[Any, Any, Any]:
    """The demo job's LoRA policy on SmolLM2 (adapter weights swapped in per version), its
    tokenizer, and the job's spec."""
    from services.cli.demo import SMOLLM2_JOB
    from services.trainer.policy import load_policy
    from shared.job import JobSpec

    spec = JobSpec(**{**SMOLLM2_JOB, "steps": 1, "base_model": str(MODEL)})
    model, tok = load_policy(str(MODEL), rank=spec.lora_rank, alpha=spec.lora_alpha, device="cpu", seed=0)
    model.eval()
    return model, tok, spec


def set_version(model: Any, versions: Path, v: int) -> None:
    """Version v's adapter into the model (the manifest names its data folder); v0, never
    published, is the base model (LoRA B = 0)."""
    import torch

    from services.trainer.policy import ADAPTER_WEIGHTS, load_adapter_weights
    from shared.folders import MANIFEST
    from shared.policy import parse_manifest

    manifest = versions / f"v{v}" / MANIFEST
    if manifest.exists():
        data_dir = parse_manifest(manifest.read_bytes(), str(manifest)).data_dir
        load_adapter_weights(model, (versions / f"v{v}" / data_dir / ADAPTER_WEIGHTS).read_bytes())
    elif v == 0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
    else:
        raise FileNotFoundError(f"{manifest}: version {v} is not in {versions} (run the demo with --versions)")


def prompts(spec: Any, n: int) -> list[list[int]]:
    """The job's first n held-out prompts, in chat form, as token ids (rollout's renderer)."""
    from services.rollout.chat import ChatTemplate
    from shared.domain.tasks.base import task_for_job

    chat = ChatTemplate(spec.base_model)
    return [
        chat.first_ids([{"role": "user", "content": it.prompt}], None) for it in task_for_job(spec).heldout_items(n)
    ]


def sample(
    model: Any, tok: Any, ids: list[list[int]], k: int, max_tokens: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) pairs: k completions per prompt at T=1, each up to and including its
    EOS. One generate call over every prompt, left-padded (generate derives each row's positions
    from its attention mask); `score` then reads them unpadded."""
    import torch

    torch.manual_seed(seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in ids)
    x = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    with torch.no_grad():
        y = model.generate(
            input_ids=x,
            attention_mask=att,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_tokens,
            num_return_sequences=k,
            use_cache=True,
            pad_token_id=pad,
        )
    out = []
    for row, completion in enumerate(y[:, width:].tolist()):
        comp = []
        for t in completion:
            comp.append(t)
            if t == tok.eos_token_id:
                break
        out.append((ids[row // k], comp))  # generate repeats each prompt k times in a row
    return out


def score(model: Any, pairs: list[tuple[list[int], list[int]]]) -> tuple[Any, Any]:
    """Each completion token's log-prob under the model as it is: [N, T] and the mask [N, T]
    (right-padded, so positions are unshifted), through the trainer's log-prob path."""
    import torch

    from services.ref.engine import right_padded
    from shared.ml.chunked_logprobs import model_token_logprobs

    n_t = max(len(c) for _, c in pairs)
    logp = torch.zeros(len(pairs), n_t)
    mask = torch.zeros(len(pairs), n_t)
    with torch.no_grad():
        for i in range(0, len(pairs), 16):
            chunk = pairs[i : i + 16]
            ids, att = right_padded(chunk, list(range(len(chunk))))
            lp = model_token_logprobs(model, ids, att, chunk=4096)
            for j, (p, c) in enumerate(chunk):
                # lp[:, t] is log p(ids[t+1] | ids[:t+1]): completion token u sits at len(p)+u.
                logp[i + j, : len(c)] = lp[j, len(p) - 1 : len(p) - 1 + len(c)]
                mask[i + j, : len(c)] = 1.0
    return logp, mask


def lag_stats(cur: Any, behav: Any, mask: Any) -> dict[str, float]:
    """What the trainer would report for this batch: raw M2 and ESS, and each correction's
    truncated/masked fraction and ESS (the trainer's own functions)."""
    from services.trainer.corrections import mismatch_correction
    from services.trainer.stats import finish, mismatch_stats

    out: dict[str, float] = {}
    for mode, key in (("token_truncate", "tis"), ("m2po", "m2po")):
        c = mismatch_correction(cur, behav, mask, mode=mode, cap=TIS_CAP, m2po_tau=M2PO_TAU)
        st = finish(mismatch_stats(cur, behav, mask, c.weight, c.truncated, c.masked))
        out[f"{key}_frac"], out[f"{key}_ess"] = st["is_frac"], st["ess"]
    # The raw columns do not depend on the correction: the last pass's.
    return out | {"m2": st["m2"], "ess_raw": st["ess_raw"], "kl": st["mismatch_kl"]}


def measure(versions: Path, currents: list[int], lags: list[int], n_prompts: int, k: int, seed: int) -> list[dict]:
    from tqdm import tqdm

    model, tok, spec = load_model()
    ids = prompts(spec, n_prompts)
    pairs = [(c, lag) for c in currents for lag in lags if c - lag >= 0]
    rows = []
    for behav_v in tqdm(sorted({c - lag for c, lag in pairs}), desc="behaviour versions"):
        set_version(model, versions, behav_v)
        t0 = time.time()
        samples = sample(model, tok, ids, k, spec.sampling.max_tokens, seed + behav_v)
        behav_lp, mask = score(model, samples)
        t_sample = time.time() - t0
        for c, lag in pairs:
            if c - lag != behav_v:
                continue
            set_version(model, versions, c)
            cur_lp, _ = score(model, samples)
            rows.append(
                {
                    "current": c,
                    "lag": lag,
                    "tokens": int(mask.sum()),
                    "sample_s": round(t_sample, 1),
                    **lag_stats(cur_lp, behav_lp, mask),
                }
            )
    return sorted(rows, key=lambda r: (r["lag"], -r["current"]))


def max_lag(rows: list[dict]) -> int:
    """The rule above: the largest measured lag at which M2PO masks <= MASK_LIMIT of the tokens
    at every current version measured, below the first lag that fails; 0 if lag 1 fails."""
    best = 0
    for lag in sorted({r["lag"] for r in rows}):
        if max(r["m2po_frac"] for r in rows if r["lag"] == lag) > MASK_LIMIT:
            break
        best = lag
    return best


def page(rows: list[dict], currents: list[int], command: str, where: str, n_prompts: int, k: int) -> tuple[str, list]:
    by_lag: dict[int, list[dict]] = {}
    for r in rows:
        by_lag.setdefault(r["lag"], []).append(r)

    def med(lag: int, key: str) -> float:
        return statistics.median(r[key] for r in by_lag[lag])

    summary = [
        (
            lag,
            len(by_lag[lag]),
            f"{med(lag, 'm2'):.4f}",
            f"{max(r['m2'] for r in by_lag[lag]):.4f}",
            f"{med(lag, 'kl'):.4f}",
            f"{med(lag, 'ess_raw'):.3f}",
            f"{med(lag, 'tis_frac'):.4f}",
            f"{med(lag, 'm2po_frac'):.4f}",
            f"{max(r['m2po_frac'] for r in by_lag[lag]):.4f}",
            f"{med(lag, 'm2po_ess'):.3f}",
        )
        for lag in sorted(by_lag)
    ]
    detail = [
        (
            r["lag"],
            f"v{r['current'] - r['lag']} -> v{r['current']}",
            r["tokens"],
            f"{r['m2']:.4f}",
            f"{r['ess_raw']:.3f}",
            f"{r['tis_frac']:.4f}",
            f"{r['m2po_frac']:.4f}",
        )
        for r in rows
    ]
    chosen = max_lag(rows)
    measured = max(by_lag)
    lines = [
        "## Staleness on SmolLM2-135M-Instruct: the data a stale step trains on",
        "",
        f"`{command}`",
        "",
        f"The SmolLM2 demo's own policy versions (GRPO-LoRA, lr 2e-4, r16/a32, 8x8 a step). Current versions "
        f"{', '.join(f'v{c}' for c in currents)}; for each lag k, {n_prompts} held-out prompts x {k} completions "
        "sampled at T=1 from version c-k, scored by both versions in fp32 with the trainer's log-prob path; "
        f"statistics by the trainer's own code. TIS: token_truncate, cap {TIS_CAP:g}. M2PO: tau {M2PO_TAU:g}.",
        "",
        "Medians over the current versions (max where said):",
        "",
        *table(
            [
                "lag",
                "pairs",
                "M2",
                "M2 max",
                "KL(behav||cur)",
                "ESS raw",
                "TIS truncated",
                "M2PO masked",
                "M2PO masked max",
                "M2PO ESS",
            ],
            summary,
        ),
        "",
        f"**The planner's `--max-lag` default: {chosen}.** The rule, fixed before the run: the largest measured "
        f"lag at which M2PO masks at most {MASK_LIMIT:.0%} of the tokens at every current version; "
        + (
            f"every lag measured passed, so the largest measured ({measured}), not an extrapolation beyond it."
            if chosen == measured
            else f"lag {min(lag for lag in by_lag if lag > chosen)} was the first to fail."
        ),
        "",
        "Not measured here: learning itself at each lag and correction (training runs on this model at each "
        "setting take hours on 2 cores). Lag is counted in optimizer steps of this job; a step that moves "
        "the policy further (a higher lr, a smaller batch) makes every lag costlier.",
        "",
        "### Every pair",
        "",
        *table(["lag", "behaviour -> current", "tokens", "M2", "ESS raw", "TIS truncated", "M2PO masked"], detail),
        "",
        where,
    ]
    figs = [
        figure(
            f"M2 at lag {lag} (median)", f"{med(lag, 'm2'):.4f}", f"M2PO tau {M2PO_TAU:g}", med(lag, "m2") / M2PO_TAU
        )
        for lag in sorted(by_lag)
    ]
    figs.append(figure("planner --max-lag default (measured)", str(chosen)))
    return "\n".join(lines), figs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=Path, required=True, help="the demo's policy versions (v0 .. vN folders)")
    ap.add_argument("--currents", default="", help="current versions, comma-separated (default: N, N-2, N-4)")
    ap.add_argument("--lags", default=",".join(map(str, LAGS)))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="completions per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (2 beside any other load made generate ~10x slower)"
    )
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    stored = sorted(int(p.name[1:]) for p in a.versions.glob("v*") if p.name[1:].isdigit())
    if not stored:
        sys.exit(f"{a.versions}: no policy versions (run bench/smollm2_demo.py --versions {a.versions})")
    last = stored[-1]
    currents = [int(x) for x in a.currents.split(",")] if a.currents else [last, last - 2, last - 4]
    lags = [int(x) for x in a.lags.split(",")]
    rows = measure(a.versions, currents, lags, a.prompts, a.k, a.seed)
    command = shown_command(__file__)
    text, figs = page(rows, currents, command, machine(), a.prompts, a.k)
    emit(text, a.out, {"rows": rows, "currents": currents, "max_lag": max_lag(rows)}, figures=figs, command=command)


if __name__ == "__main__":
    main()
